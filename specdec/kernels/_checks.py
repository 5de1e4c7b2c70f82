"""Argument validation shared by the public ops.

Every message names the argument, so a caller deep inside a serving stack sees
which tensor was wrong. Dtype problems raise TypeError, everything else ValueError.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def check_tensor(
    name: str,
    value,
    *,
    dtype: torch.dtype | Sequence[torch.dtype] | None = None,
    ndim: int | None = None,
    shape: Sequence[int | None] | None = None,
    device: torch.device | None = None,
    contiguous: bool = False,
) -> torch.Tensor:
    """Check one tensor argument; ``None`` entries of ``shape`` match any size.

    Host attributes only (dtype, sizes, device, strides), compared directly: public ops call this
    for every argument of every call."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if dtype is not None and value.dtype is not dtype:
        allowed = (dtype,) if isinstance(dtype, torch.dtype) else tuple(dtype)
        if value.dtype not in allowed:
            names = " or ".join(str(d).replace("torch.", "") for d in allowed)
            raise TypeError(f"{name} must have dtype {names}, got {str(value.dtype).replace('torch.', '')}")
    if shape is not None:
        ndim = len(shape)
    got = value.shape
    if ndim is not None and len(got) != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(got)}")
    if shape is not None:
        for axis, (want, size) in enumerate(zip(shape, got)):
            if want is not None and want != size:
                expected = tuple("*" if s is None else s for s in shape)
                raise ValueError(f"{name} must have shape {expected}, got {tuple(got)} (dimension {axis})")
    if device is not None and value.device != device:
        if value.device != torch.device(device):  # (``device`` may be given as a string)
            raise ValueError(f"{name} is on {value.device} but the other inputs are on {device}")
    if contiguous and not value.is_contiguous():
        raise ValueError(f"{name} must be contiguous; call .contiguous() first")
    return value


def check_offsets(name: str, offsets: torch.Tensor, total: int | None = None) -> list[int]:
    """Validate int32 ``[B+1]`` cu_seqlens-style offsets; returns them as a host list.

    Reading the offsets to the host is a synchronisation: call this only where the
    op needs host-side sizes anyway, or on CPU tensors.
    """
    check_tensor(name, offsets, dtype=torch.int32, ndim=1)
    if offsets.numel() < 1:
        raise ValueError(f"{name} must hold B+1 >= 1 entries, got none")
    values = offsets.tolist()
    if values[0] != 0:
        raise ValueError(f"{name} must start at 0, got {values[0]}")
    for i in range(1, len(values)):
        if values[i] < values[i - 1]:
            raise ValueError(
                f"{name} must be non-decreasing, but {name}[{i}]={values[i]} < {name}[{i - 1}]={values[i - 1]}"
            )
    if total is not None and values[-1] != total:
        raise ValueError(f"{name}[-1] must equal the number of rows ({total}), got {values[-1]}")
    return values


def check_same_device(**tensors: torch.Tensor | None) -> torch.device:
    """All non-None tensors on one device; returns it."""
    device = None
    first = None
    for name, value in tensors.items():
        if value is None:
            continue
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
        if device is None:
            device, first = value.device, name
        elif value.device != device:
            raise ValueError(f"{name} is on {value.device} but {first} is on {device}")
    return device


FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_rows(name: str, value: torch.Tensor) -> torch.Tensor:
    """A tensor whose last dim is contiguous (any strides before it: views of a fused projection)."""
    if value.dim() and value.shape[-1] > 1 and value.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dim; call .contiguous() first")
    return value


def unchecked_needs(name: str) -> ValueError:
    """The error for a keyword that ``check=False`` requires: the checked call derives it from the inputs."""
    return ValueError(f"{name} is required with check=False (only the checked call derives it from the inputs)")
