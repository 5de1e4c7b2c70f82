"""Triton launches: the fast path launches what Triton's own dispatch would, constants compare cheaply, and the
host-time benchmark runs with Triton's dispatch in it (``bench/stand_in_driver.py``: no GPU needed)."""

import copy
import json

import pytest
from helpers import run_bench

from specdec.kernels import triton_dispatch
from specdec.kernels._triton import constant, triton
from specdec.kernels.compile_target import toolchain

needs_toolchain = pytest.mark.skipif(not toolchain()[0], reason=f"no NVIDIA toolchain: {toolchain()[1]}")


@needs_toolchain
def test_fast_launches_equal_tritons_own_dispatch():
    # the script asserts it all (bench/dispatch_equivalence.py); CI runs it again under Triton 3.6
    done = run_bench("dispatch_equivalence.py", cpu_path=True)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["dispatches"]["fast round 2"] == 0 and summary["launches"] > 0
    assert summary["compiled"] > len(summary["kernels"])


@needs_toolchain
def test_host_time_bench_runs_with_tritons_dispatch(tmp_path):
    done = run_bench("bench_host_time.py", "--dispatch", "--dry-run", "--out", str(tmp_path), cpu_path=True)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "host_time.json").read_text())
    assert report["mode"].startswith("launches dispatched by Triton")
    verify = [row for row in report["rows"] if row["op"] == "verify_chain"]
    assert verify and all(row["launches"] == 3 for row in verify)
    # what the fast launch path saves: rows with Triton's own dispatch, reported beside the targets, not as ones
    off = [row for row in report["rows"] if row["entry"].endswith("fast launch off")]
    assert off and all(row["target_us"] is None for row in off)
    assert len(report["targets"]) == len(report["rows"]) - len(off)


@pytest.mark.parametrize("value, expected", [("", True), ("1", True), ("0", False), (" 0 ", False)])
def test_fast_launch_variable_values(monkeypatch, value, expected):
    monkeypatch.setenv(triton_dispatch.FAST_LAUNCH_ENV, value)
    monkeypatch.setattr(triton_dispatch, "_enabled", None)
    assert triton_dispatch.fast_launch_enabled() is expected
    monkeypatch.setenv(triton_dispatch.FAST_LAUNCH_ENV, "1" if value == "0" else "0")
    assert triton_dispatch.fast_launch_enabled() is expected  # read once


@pytest.mark.parametrize("value", ["yes", "off", "2"])
def test_fast_launch_variable_refuses_other_values(monkeypatch, value):
    monkeypatch.setenv(triton_dispatch.FAST_LAUNCH_ENV, value)
    monkeypatch.setattr(triton_dispatch, "_enabled", None)
    with pytest.raises(ValueError, match=f"SPECDEC_FAST_LAUNCH must be 1 .* got '{value}'"):
        triton_dispatch.fast_launch_enabled()


@pytest.mark.skipif(triton is None, reason="needs Triton")
def test_kernel_constants_compare_as_plain_values():
    # Triton compares each global a kernel read with a deep copy before every launch
    five = constant(5)
    assert isinstance(five, triton.language.constexpr) and five.value == 5
    assert (five != copy.deepcopy(five)) is False
    assert (five != constant(6)) is True
    assert bool(five != triton.language.constexpr(6))  # another constexpr: Triton's own comparison
