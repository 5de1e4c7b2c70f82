"""``bench/bench_step_mixing.py``: decoders forced to fixed patterns of depths, each kind of step timed apart."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def quick_table(tmp_path: Path, *args: str) -> dict[str, list[str]]:
    """``--quick`` with ``args``: pattern -> its cells after the batch and the name."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "TRITON_INTERPRET": "0"}  # the CPU's own path, not the GPU stand-in
    done = subprocess.run([sys.executable, "bench/bench_step_mixing.py", "--quick", *args, "--out", str(tmp_path)],
                          cwd=root, capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = [
        [cell.strip() for cell in line.split("|")[1:-1]]
        for line in (tmp_path / "step_mixing.md").read_text().splitlines()
        if line.startswith("| 2 ")
    ]
    return {row[1]: row[2:] for row in rows}


def test_the_mixing_benchmark_times_each_depths_steps_in_each_pattern(tmp_path):
    """The quick run's table: the plain pattern has plain steps only, the chain drafting steps only, the mixed
    patterns both; each peer against itself is 1.00x. Two drafting depths mix alike (``--against``)."""
    table = quick_table(tmp_path / "plain")
    assert list(table) == ["plain", "K=2", "mostly plain", "mostly K=2"]
    assert table["plain"][1] == "-" and table["plain"][2] == "1.00x" and float(table["plain"][0]) > 0
    assert table["K=2"][0] == "-" and table["K=2"][3] == "1.00x" and float(table["K=2"][1]) > 0
    for mixed in ("mostly plain", "mostly K=2"):
        assert all(float(cell.rstrip("x")) > 0 for cell in table[mixed])
    table = quick_table(tmp_path / "depths", "--depth", "3", "--against", "1")
    assert list(table) == ["K=1", "K=3", "mostly K=1", "mostly K=3"]
    assert table["K=1"][2] == "1.00x" and table["K=3"][3] == "1.00x"


def test_the_mixing_benchmark_refuses_a_depth_under_one_and_a_depth_against_itself():
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    for args, message in ((["--depth", "0"], "--depth must be >= 1"), (["--against", "2"], "--against must be")):
        done = subprocess.run([sys.executable, "bench/bench_step_mixing.py", *args], cwd=root, capture_output=True,
                              text=True, env=env, timeout=120)  # fmt: skip
        assert done.returncode == 2 and message in done.stderr
