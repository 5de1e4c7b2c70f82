"""Triton launches: the fast path launches what Triton's own dispatch would, constants compare cheaply, and the
host-time benchmark runs with Triton's dispatch in it (``bench/stand_in_driver.py``: no GPU needed)."""

import copy
import json

import pytest
import torch
from helpers import run_bench

from specdec import _backend
from specdec.kernels import triton_dispatch
from specdec.kernels._triton import constant, triton
from specdec.kernels.compile_target import toolchain

needs_toolchain = pytest.mark.skipif(not toolchain()[0], reason=f"no NVIDIA toolchain: {toolchain()[1]}")


@needs_toolchain
@pytest.mark.parametrize("key", ["extension", "python"])
def test_fast_launches_equal_tritons_own_dispatch(key, monkeypatch):
    # the script asserts it all (bench/dispatch_equivalence.py); CI runs it again under Triton 3.6
    if key == "extension" and _backend.extension_function("launch_key") is None:
        pytest.skip("specdec._C is not built")
    if key == "python":
        monkeypatch.setenv("SPECDEC_DISABLE_EXTENSION", "1")
    done = run_bench("dispatch_equivalence.py", cpu_path=True)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["launch_key"] == key
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


@pytest.mark.parametrize("which", ["python", "extension"])
def test_launch_keys_part_arguments_as_tritons_specialisation_does(which):
    # equal keys exactly where these launches are specialised alike (a tensor by dtype and 16-byte alignment; an
    # int, float, bool, string or None by type and value, which is finer than Triton for ints and floats; the
    # meta-parameters and options by name and value)
    launch_key = triton_dispatch.python_launch_key
    if which == "extension":
        launch_key = _backend.extension_function("launch_key")
        if launch_key is None:
            pytest.skip("specdec._C is not built")
    base = torch.empty(64)
    groups = [
        [(base, 3), (torch.empty(8), 3), (base[4:], 3), (torch.nn.Parameter(torch.empty(8)), 3)],  # fp32, aligned
        [(base[1:], 3)],  # 4 bytes off
        [(base.half(), 3)],
        [(base, 16)],
        [(base, 1)],
        [(base, True)],  # a bool is not the int 1
        [(base, 1.0)],
        [(base, None)],
        [(base, 2**40)],
        [(base, "3")],
    ]
    keys = [[launch_key(args, {"BLOCK": 64}, {"num_warps": 4}) for args in group] for group in groups]
    warps = {"num_warps": 4}
    launches = [((base, 3), {"BLOCK": 32}, warps), ((base, 3), {"BLOCK": 64}, {"num_warps": 8}),
                ((base, 3), {"BLOCK": 64, "EVEN": True}, warps), ((base, 3), {"BLOCK": 64}, {**warps, "maxnreg": 128}),
                ((base, 3), {"RULE": "greedy"}, {}), ((base, 3), {"RULE": "stochastic"}, {}),
                ((base, 3), {"BLOCK_M": 64}, warps)]  # fmt: skip
    keys += [[launch_key(*launch)] for launch in launches]
    assert all(key is not None for group in keys for key in group)
    for i, group in enumerate(keys):
        assert all(key == group[0] for key in group), i
        assert all(group[0] != other[0] for other in keys[i + 1 :]), i
    assert launch_key((), {}, {}) == launch_key((), {}, {})
    assert launch_key((base, (1, 2)), {}, {}) is None  # Triton's own dispatch decides


def test_extension_launch_key_refuses_what_it_cannot_encode():
    native = _backend.extension_function("launch_key")
    if native is None:
        pytest.skip("specdec._C is not built")
    assert native((2**63,), {}, {}) is None and native((-(2**63) - 1,), {}, {}) is None
    assert native((2**63 - 1,), {}, {}) is not None
    assert native((), {"SHAPE": (1, 2)}, {}) is None  # (the Python key holds any hashable meta-parameter)
    with pytest.raises(TypeError, match="launch_key: args must be a tuple, got list"):
        native([1, 2], {}, {})
    with pytest.raises(TypeError, match=r"launch_key takes \(args, meta, config\), got 1 arguments"):
        native((1, 2))


def test_launch_keys_kept_per_kernel_are_bounded(monkeypatch):
    # every value of an int argument is a key of its own; a kernel's keys start over at MAX_KEYS
    monkeypatch.setattr(triton_dispatch, "_keyed", {})
    monkeypatch.setattr(triton_dispatch, "MAX_KEYS", 4)
    kernel, compiled = object(), object()
    for width in range(10):
        triton_dispatch._keep(kernel, ("cpu", width), compiled, {"x": 0, "width": width, "BLOCK": 64}, 2)
        assert 1 <= len(triton_dispatch._keyed[id(kernel)]) <= 4
    assert triton_dispatch._keyed[id(kernel)][("cpu", 9)] == (compiled, (64,))  # the constexprs after the arguments
    triton_dispatch._keep(kernel, None, compiled, {}, 0)  # a launch without a key keeps nothing
    assert None not in triton_dispatch._keyed[id(kernel)]
