"""Argument checks shared by the Python API and the command line: types, ranges, devices, memory.

Every check raises ``TypeError`` (wrong kind of value) or ``ValueError`` (right kind, wrong
value) with a message that names the argument and, for a range, the allowed range; the checks
return the value normalised (a Python ``int`` or ``float``, a ``torch.device``).

Integers must be integers: Python ints and NumPy / 0-d integer tensor scalars are accepted
(anything with ``__index__``); bools and floats are refused, never truncated. Floats accept
any real number (ints included) but not bools, NaN or infinities.

Example
-------
>>> import numpy as np
>>> as_int("top_k", np.int64(5), low=0)
5
>>> as_int("max_new_tokens", 2.5, low=0)
Traceback (most recent call last):
    ...
TypeError: max_new_tokens must be an int, got 2.5 (float)
>>> as_temperature("temperature", 1e-40)   # doctest: +ELLIPSIS
Traceback (most recent call last):
    ...
ValueError: temperature must be 0 (greedy) or a finite float >= 1e-30 (...), got 1e-40
"""

from __future__ import annotations

import math
import numbers
import operator
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
# The sampling ops scale logits by 1/T in float32: 1/T overflows below 2**-126 (and T itself
# rounds to 0, silently greedy, below 1.4e-45), and logits/T overflows, ending the request
# 'invalid', once |logit| > 3.4e38 * T. Positive temperatures below 1e-30 are refused (0 means
# greedy): from there up every |logit| < 3e8 scales to a finite value.
MIN_TEMPERATURE = 1e-30
# A cache may take at most this share of the memory available when it is allocated: the
# rest is left for activations, the allocator's rounding and everything else in the process.
MEMORY_FRACTION = 0.9


class InsufficientMemoryError(ValueError):
    """An allocation refused before it was tried: ``what`` needs ``needed`` bytes, more than
    ``MEMORY_FRACTION`` of the ``available`` bytes on ``device``; ``drivers`` names what to lower."""

    def __init__(self, what: str, needed: int, available: int, device: torch.device | str, drivers: str):
        self.what, self.needed, self.available, self.device, self.drivers = what, needed, available, device, drivers
        super().__init__(
            f"{what} needs {format_bytes(needed)}, more than {MEMORY_FRACTION:.0%} of the "
            f"{format_bytes(available)} available on {device}; lower {drivers}"
        )

    def __reduce__(self):
        return type(self), (self.what, self.needed, self.available, self.device, self.drivers)

    def blame(self, drivers: str) -> InsufficientMemoryError:
        """The same refusal naming other arguments to lower (for a caller whose arguments set the size)."""
        return InsufficientMemoryError(self.what, self.needed, self.available, self.device, drivers)


def _range(low, high, low_open: bool = False) -> str:
    if low is not None and high is not None:
        return f"in {'(' if low_open else '['}{low}, {high}]"
    if low is not None:
        return f"{'>' if low_open else '>='} {low}"
    return f"<= {high}"


def _got(value) -> str:
    return f"{value!r} ({type(value).__name__})"


def _scalar(value):
    """0-d tensors and arrays as the Python scalar they hold (so a bool tensor is a bool)."""
    if isinstance(value, (torch.Tensor, np.ndarray)) and value.ndim == 0:
        return value.item()
    return value


def as_int(name: str, value, *, low: int | None = None, high: int | None = None, note: str = "") -> int:
    """``value`` as a Python int in ``[low, high]`` (either bound optional); ``note`` is appended to range errors."""
    value = _scalar(value)
    try:
        if isinstance(value, (bool, np.bool_)):
            raise TypeError
        out = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {_got(value)}") from None
    if (low is not None and out < low) or (high is not None and out > high):
        raise ValueError(f"{name} must be an int {_range(low, high)}{note}, got {out}")
    return out


def _real(name: str, value) -> float:
    value = _scalar(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {_got(value)}")
    return float(value)


def as_float(
    name: str, value, *, low: float | None = None, high: float | None = None, low_open: bool = False
) -> float:
    """``value`` as a finite Python float in ``[low, high]`` (``(low, high]`` with ``low_open``)."""
    out = _real(name, value)
    below = low is not None and (out <= low if low_open else out < low)
    if not math.isfinite(out) or below or (high is not None and out > high):
        bounds = "" if low is None and high is None else " " + _range(low, high, low_open)
        raise ValueError(f"{name} must be a finite number{bounds}, got {out!r}")
    return out


def as_temperature(name: str, value) -> float:
    """0 (greedy) or a finite temperature ``>= MIN_TEMPERATURE`` (1e-30).

    Smaller positive temperatures are refused, not treated as greedy: the caller asked for
    sampling, and the sampling ops' 1/T or logits/T would overflow float32.
    """
    out = _real(name, value)
    if out != 0 and not MIN_TEMPERATURE <= out < math.inf:
        raise ValueError(
            f"{name} must be 0 (greedy) or a finite float >= {MIN_TEMPERATURE:.8g} "
            f"(1/temperature and logits/temperature must stay finite in float32), got {out!r}"
        )
    return out


def as_sequence(value) -> list | None:
    """``value`` as a list when it holds several values (a list, tuple, or a tensor / array of one or
    more dimensions), None when it is one value (strings count as one value)."""
    if isinstance(value, (torch.Tensor, np.ndarray)):
        return value.tolist() if value.ndim > 0 else None
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return list(value)
    return None


def per_request(name: str, value, batch: int, check: Callable[[str, object], object]) -> list:
    """One value for every request, or ``batch`` values (``as_sequence``); each passes ``check(name[b], v)``."""
    values = as_sequence(value)
    if values is None:
        return [check(name, value)] * batch
    if len(values) != batch:
        raise ValueError(f"{name} must be one value or {batch} (one per prompt), got {len(values)}")
    return [check(f"{name}[{b}]", v) for b, v in enumerate(values)]


def as_device(name: str, value) -> torch.device:
    """A device torch knows and that exists here (``cuda:3`` on a machine with 2 GPUs is refused)."""
    if not isinstance(value, (str, torch.device)):
        raise TypeError(f"{name} must be a device name such as 'cpu' or 'cuda:0', got {_got(value)}")
    try:
        device = torch.device(value)
    except RuntimeError:
        raise ValueError(f"{name} {str(value)!r} is not a device torch knows (e.g. 'cpu', 'cuda', 'cuda:1')") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"{name} {str(value)!r}: CUDA is not available here")
        if device.index is not None and device.index >= count:
            raise ValueError(f"{name} {str(value)!r}: this machine has {count} CUDA device(s)")
        # indexed as its tensors will report it: torch.device("cuda") != cuda:0 in every device comparison
        return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
    if device.type not in ("cpu", "meta"):
        try:
            torch.empty(0, device=device)
        except (RuntimeError, AssertionError) as exc:
            raise ValueError(f"{name} {str(value)!r} is not usable here ({exc})") from None
    return device


# ---- memory ----------------------------------------------------------------------------------


def format_bytes(n: float) -> str:
    """``1536`` -> ``'1.5 KiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def tensor_bytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    """Bytes of a tensor of ``shape`` and ``dtype`` (Python ints: no overflow for absurd shapes)."""
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def available_memory(device: torch.device | str) -> int | None:
    """Bytes a new allocation on ``device`` can use now; None where it cannot be told.

    CUDA: the device's free memory plus what torch's caching allocator holds unused. CPU: the
    kernel's MemAvailable (``/proc/meminfo``, else ``sysconf``), lowered to the room left under
    the process's cgroup memory limit when there is one (containers).
    """
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    if device.type != "cpu":
        return None
    host = _meminfo_available()
    cgroup = _cgroup_available()
    known = [m for m in (host, cgroup) if m is not None]
    return min(known) if known else None


def check_memory(nbytes: int, device: torch.device | str, what: str, *, drivers: str) -> None:
    """Refuse an allocation of ``nbytes`` beyond ``MEMORY_FRACTION`` of ``available_memory(device)``.

    ``what`` describes the allocation; ``drivers`` names the arguments that set its size. Raises
    ``InsufficientMemoryError`` (a ValueError) with both numbers; does nothing when the
    available memory cannot be told.
    """
    available = available_memory(device)
    if available is not None and nbytes > MEMORY_FRACTION * available:
        raise InsufficientMemoryError(what, nbytes, available, torch.device(device), drivers)


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _cgroup_available(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Limit minus usage (reclaimable file cache counted as free) of the cgroup, v2 or v1; None without a limit."""
    for limit_file, usage_file, stat_key in (
        ("memory.max", "memory.current", "inactive_file"),
        ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes", "total_inactive_file"),
    ):
        try:
            limit = (root / limit_file).read_text().strip()
            if limit == "max" or int(limit) >= 2**60:  # no limit
                return None
            usage = int((root / usage_file).read_text())
            stats = (root / limit_file).with_name("memory.stat").read_text().split("\n")
            cache = next((int(s.split()[1]) for s in stats if s.startswith(stat_key + " ")), 0)
            return max(int(limit) - usage + cache, 0)
        except (OSError, ValueError):
            continue
    return None
