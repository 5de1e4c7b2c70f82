"""specdec.validation: the one module of argument checks (types, ranges, devices, memory)."""

import math
import pickle

import numpy as np
import pytest
import torch

from specdec import validation
from specdec.validation import (
    MIN_TEMPERATURE,
    InsufficientMemoryError,
    as_device,
    as_float,
    as_int,
    as_sequence,
    as_temperature,
    available_memory,
    check_memory,
    format_bytes,
    per_request,
    tensor_bytes,
)


@pytest.mark.parametrize("value", [7, np.int64(7), np.int32(7), np.uint8(7), torch.tensor(7), np.array(7)])
def test_as_int_accepts_integers_of_every_kind(value):
    out = as_int("n", value)
    assert out == 7 and type(out) is int


@pytest.mark.parametrize(
    "value, shown",
    [
        (2.5, r"2\.5 \(float\)"),
        (2.0, r"2\.0 \(float\)"),  # a float is refused even when it holds an integer: never truncated
        (np.float64(1.5), "1.5"),
        (True, r"True \(bool\)"),
        (np.True_, "True"),
        (torch.tensor(True), r"True \(bool\)"),
        (torch.tensor(1.5), r"1\.5 \(float\)"),
        ("3", r"'3' \(str\)"),
        (None, r"None \(NoneType\)"),
        ([3], r"\[3\] \(list\)"),
    ],
)
def test_as_int_refuses_non_integers_by_name(value, shown):
    with pytest.raises(TypeError, match=rf"^top_k must be an int, got .*{shown}"):
        as_int("top_k", value)


def test_as_int_range_errors_name_the_range():
    assert as_int("k", 0, low=0, high=4) == 0 and as_int("k", 4, low=0, high=4) == 4
    with pytest.raises(ValueError, match=r"^k must be an int in \[0, 4\] \(0 = off\), got 5$"):
        as_int("k", 5, low=0, high=4, note=" (0 = off)")
    with pytest.raises(ValueError, match=r"^k must be an int >= 1, got 0$"):
        as_int("k", 0, low=1)
    with pytest.raises(ValueError, match=r"^k must be an int <= 3, got 1180591620717411303424$"):
        as_int("k", 2**70, high=3)


@pytest.mark.parametrize("value", [0.5, 1, np.float32(0.5), np.int64(1), torch.tensor(0.5)])
def test_as_float_accepts_real_numbers(value):
    out = as_float("p", value, low=0.0, high=1.0, low_open=True)
    assert type(out) is float and out == float(value)


@pytest.mark.parametrize(
    "value, error, match",
    [
        (True, TypeError, r"^p must be a number, got True \(bool\)$"),
        ("0.5", TypeError, r"^p must be a number, got '0.5' \(str\)$"),
        (None, TypeError, "p must be a number"),
        (math.nan, ValueError, r"^p must be a finite number in \(0.0, 1.0\], got nan$"),
        (math.inf, ValueError, r"^p must be a finite number in \(0.0, 1.0\], got inf$"),
        (0.0, ValueError, r"^p must be a finite number in \(0.0, 1.0\], got 0.0$"),
        (1.5, ValueError, r"^p must be a finite number in \(0.0, 1.0\], got 1.5$"),
    ],
)
def test_as_float_refusals(value, error, match):
    with pytest.raises(error, match=match):
        as_float("p", value, low=0.0, high=1.0, low_open=True)


def test_temperature_floor_keeps_the_sampling_math_finite_in_float32():
    assert as_temperature("t", 0) == 0.0 and as_temperature("t", MIN_TEMPERATURE) == MIN_TEMPERATURE
    # At the floor both 1/T and a large logit / T are finite in float32 ...
    t = torch.tensor(MIN_TEMPERATURE, dtype=torch.float32)
    assert torch.isfinite(1 / t) and torch.isfinite(torch.tensor(3e8) * (1 / t))
    # ... while the refused values overflow 1/T (1e-40), round to 0 in float32 (1e-50: silently greedy)
    # or overflow a logit of 10 (1e-38).
    assert not torch.isfinite(1 / torch.tensor(1e-40, dtype=torch.float32))
    assert torch.tensor(1e-50, dtype=torch.float32) == 0
    assert not torch.isfinite(torch.tensor(10.0) * (1 / torch.tensor(1e-38, dtype=torch.float32)))
    for bad in (1e-40, 1e-50, 1e-38, MIN_TEMPERATURE / 2, -0.5, -1e-40, math.inf, math.nan):
        with pytest.raises(ValueError, match=r"^temperature must be 0 \(greedy\) or a finite float >= 1e-30 \("):
            as_temperature("temperature", bad)
    with pytest.raises(TypeError, match="temperature must be a number"):
        as_temperature("temperature", "hot")


def test_as_sequence_and_per_request():
    assert as_sequence(3) is None and as_sequence("ab") is None and as_sequence(torch.tensor(3)) is None
    assert as_sequence((1, 2)) == [1, 2] and as_sequence(np.array([1, 2])) == [1, 2]
    assert as_sequence(torch.tensor([1, 2])) == [1, 2]
    check = lambda name, v: as_int(name, v, low=0)
    assert per_request("m", 4, 3, check) == [4, 4, 4]
    assert per_request("m", np.array([1, 2, 3]), 3, check) == [1, 2, 3]
    with pytest.raises(ValueError, match=r"^m must be one value or 3 \(one per prompt\), got 2$"):
        per_request("m", [1, 2], 3, check)
    with pytest.raises(ValueError, match=r"^m\[1\] must be an int >= 0, got -2$"):
        per_request("m", [1, -2, 3], 3, check)
    with pytest.raises(TypeError, match=r"^m\[0\] must be an int, got 1.5"):
        per_request("m", [1.5, 2, 3], 3, check)
    with pytest.raises(TypeError, match=r"^m must be an int, got 'abc'"):
        per_request("m", "abc", 3, check)


def test_as_device():
    assert as_device("device", "cpu") == torch.device("cpu")
    assert as_device("device", torch.device("meta")).type == "meta"
    with pytest.raises(ValueError, match=r"^device 'tpu9' is not a device torch knows"):
        as_device("device", "tpu9")
    with pytest.raises(TypeError, match="device must be a device name"):
        as_device("device", 3)
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        assert as_device("device", "cuda:0").index == 0
        with pytest.raises(ValueError, match=rf"this machine has {count} CUDA device"):
            as_device("device", f"cuda:{count}")
    else:
        with pytest.raises(ValueError, match=r"^device 'cuda': CUDA is not available here$"):
            as_device("device", "cuda")


def test_format_and_tensor_bytes():
    assert [format_bytes(n) for n in (512, 1536, 3 * 2**30, 9 * 2**40)] == ["512 B", "1.5 KiB", "3.0 GiB", "9.0 TiB"]
    assert tensor_bytes((2, 3), torch.bfloat16) == 12
    assert tensor_bytes((10**9, 10**9), torch.float32) == 4 * 10**18  # Python ints: no overflow


def test_available_memory_of_the_host_is_plausible():
    available = available_memory("cpu")
    total = int(next(line for line in open("/proc/meminfo") if line.startswith("MemTotal:")).split()[1]) * 1024
    assert available is not None and 0 < available <= total
    assert available_memory("meta") is None


def test_cgroup_limits_count_reclaimable_cache_as_free(tmp_path):
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "memory.max").write_text("1000000\n")
    (v2 / "memory.current").write_text("600000\n")
    (v2 / "memory.stat").write_text("anon 500000\ninactive_file 100000\nactive_file 5\n")
    assert validation._cgroup_available(v2) == 1000000 - 600000 + 100000
    (v2 / "memory.max").write_text("max\n")
    assert validation._cgroup_available(v2) is None
    v1 = tmp_path / "v1" / "memory"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text("4000\n")
    (v1 / "memory.usage_in_bytes").write_text("3000\n")
    (v1 / "memory.stat").write_text("inactive_file 1\ntotal_inactive_file 500\n")
    assert validation._cgroup_available(tmp_path / "v1") == 4000 - 3000 + 500
    assert validation._cgroup_available(tmp_path / "none") is None


def test_check_memory_refuses_with_the_numbers(monkeypatch):
    monkeypatch.setattr(validation, "available_memory", lambda device: 10 * 2**30)
    check_memory(9 * 2**30, "cpu", "a buffer", drivers="size")  # 90% of what is available: allowed
    with pytest.raises(InsufficientMemoryError, match=r"^a buffer needs 9.2 GiB, more than 90% of the 10.0 GiB "
                       r"available on cpu; lower size$") as info:  # fmt: skip
        check_memory(9 * 2**30 + 2**28, "cpu", "a buffer", drivers="size")
    exc = info.value
    assert isinstance(exc, ValueError) and (exc.needed, exc.available) == (9 * 2**30 + 2**28, 10 * 2**30)
    assert str(pickle.loads(pickle.dumps(exc))) == str(exc)
    assert str(exc.blame("max_new_tokens")).endswith("; lower max_new_tokens")
    monkeypatch.setattr(validation, "available_memory", lambda device: None)
    check_memory(2**80, "cpu", "anything", drivers="size")  # unknown: nothing to compare with
