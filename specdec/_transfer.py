"""Host <-> device copies: uploads that never make the host wait, and the step's one read-back.

A plain ``torch.tensor(values, device="cuda")`` or ``cpu_tensor.to("cuda")`` copies from pageable
memory, which blocks the host until the copy is done -- a hidden synchronisation in the middle of a
step. Here the values go to a pinned buffer (PyTorch's caching host allocator keeps it alive until
the copy has run) and the copy is queued with ``non_blocking=True``, in stream order with the
kernels around it. On the CPU (and other devices) it is an ordinary copy.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(
    values: Sequence[int] | Sequence[float] | torch.Tensor,
    dtype: torch.dtype,
    device: torch.device | str,
    *,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``values`` (a Python list or a CPU tensor) as a ``dtype`` tensor on ``device``, without a host wait.

    With ``out`` (a tensor on ``device``) the values are copied into it instead, keeping its storage
    (CUDA graphs replay on fixed addresses). On a non-CUDA device a CPU tensor of the right dtype
    may come back as is, sharing memory with ``values``.

    Example
    -------
    >>> to_device([3, 1, 2], torch.int32, "cpu")
    tensor([3, 1, 2], dtype=torch.int32)
    >>> buf = torch.zeros(2, dtype=torch.int64)
    >>> to_device([7, 8], torch.int64, "cpu", out=buf) is buf, buf.tolist()
    (True, [7, 8])
    """
    if isinstance(values, torch.Tensor):
        if values.device.type != "cpu":
            raise ValueError(f"values must be host data (a list or a CPU tensor), got a tensor on {values.device}")
        host = values.to(dtype)
    else:
        host = torch.tensor(values, dtype=dtype)
    device = torch.device(device)
    if device.type == "cuda":
        host = host.pin_memory()
    if out is not None:
        return out.copy_(host, non_blocking=device.type == "cuda")
    return host.to(device, non_blocking=device.type == "cuda")


def offsets_to_device(counts: Sequence[int], device: torch.device | str) -> torch.Tensor:
    """int32 ``[B+1]`` cu_seqlens-style offsets of host ``counts`` (``[0, c0, c0+c1, ...]``) on ``device``.

    Example
    -------
    >>> offsets_to_device([3, 0, 2], "cpu").tolist()
    [0, 3, 3, 5]
    """
    out = [0]
    for c in counts:
        out.append(out[-1] + c)
    return to_device(out, torch.int32, device)


def read_back(values: torch.Tensor) -> list:
    """``values.tolist()``: the device -> host copy a decoding step makes once (its ``HOST SYNC``).

    The one synchronisation a step is allowed: under ``torch.cuda.set_sync_debug_mode`` this copy
    is exempt (the mode is lifted around it), so a test can run a whole generation in "error" mode.

    Example
    -------
    >>> read_back(torch.tensor([[3, 1], [2, 0]]))
    [[3, 1], [2, 0]]
    """
    if not values.is_cuda:
        return values.tolist()
    mode = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(0)
    try:
        return values.tolist()
    finally:
        torch.cuda.set_sync_debug_mode(mode)
