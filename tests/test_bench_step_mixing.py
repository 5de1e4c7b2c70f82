"""``bench/bench_step_mixing.py``: decoders forced to fixed patterns of depths, each kind of step timed apart."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def test_the_mixing_benchmark_times_each_kind_of_step_in_each_pattern(tmp_path):
    """The quick run's table: the plain pattern has plain steps only, the chain drafting steps only, the mixed
    patterns both; each peer against itself is 1.00x."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "TRITON_INTERPRET": "0"}  # the CPU's own path, not the GPU stand-in
    done = subprocess.run([sys.executable, "bench/bench_step_mixing.py", "--quick", "--out", str(tmp_path)],
                          cwd=root, capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = [
        [cell.strip() for cell in line.split("|")[1:-1]]
        for line in (tmp_path / "step_mixing.md").read_text().splitlines()
        if line.startswith("| 2 ")
    ]
    table = {row[1]: row[2:] for row in rows}
    assert list(table) == ["plain", "K=2", "mostly plain", "mostly drafting"]
    assert table["plain"][1] == "-" and table["plain"][2] == "1.00x" and float(table["plain"][0]) > 0
    assert table["K=2"][0] == "-" and table["K=2"][3] == "1.00x" and float(table["K=2"][1]) > 0
    for mixed in ("mostly plain", "mostly drafting"):
        assert all(float(cell.rstrip("x")) > 0 for cell in table[mixed])


def test_the_mixing_benchmark_refuses_a_depth_under_one():
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run([sys.executable, "bench/bench_step_mixing.py", "--depth", "0"], cwd=root,
                          capture_output=True, text=True, env=env, timeout=120)  # fmt: skip
    assert done.returncode == 2 and "--depth must be >= 1" in done.stderr
