"""``bench/bench_step_mixing.py``: decoders forced to fixed patterns of depths, each kind of step timed apart."""

from __future__ import annotations

from pathlib import Path

from helpers import run_bench, table_rows


def quick_table(tmp_path: Path, *args: str) -> dict[str, list[str]]:
    """``--quick`` with ``args``: pattern -> its cells after the batch and the name."""
    done = run_bench("bench_step_mixing.py", "--quick", *args, "--out", str(tmp_path), cpu_path=True)
    assert done.returncode == 0, done.stderr
    return {row[1]: row[2:] for row in table_rows(tmp_path / "step_mixing.md", "2")}


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
    refusals = ((["--depth", "0"], "--depth: must be an integer >= 1"), (["--against", "2"], "--against must be"))
    for args, message in refusals:
        done = run_bench("bench_step_mixing.py", *args, timeout=120)
        assert done.returncode == 2 and message in done.stderr
