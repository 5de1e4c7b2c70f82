"""The stacked KV-cache layout that ``kv_append`` and ``kv_compact`` work on, and its checks.

One tensor holds every layer, so one launch can cover all layers:

    contiguous  data [L, 2, B, max_len, Hkv, D]           (2 = K, V)
    paged       data [L, 2, num_blocks, block_size, Hkv, D] with block_tables [B, max_blocks] int32

Position p of request b lives at ``data[l, kv, b, p]`` (contiguous) or at
``data[l, kv, block_tables[b, p // block_size], p % block_size]`` (paged); a request's
capacity is ``max_len`` or ``max_blocks * block_size`` positions. Each position holds one
token row of ``Hkv * D`` contiguous elements in both layouts, which is what the kernels
copy. They copy bits (the cache viewed as integers of the same width), so every move is
exact whatever the float dtype.
"""

from __future__ import annotations

import torch

from specdec.kernels._checks import check_same_device, check_tensor

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BITS_VIEW = {2: torch.int16, 4: torch.int32}  # the kernels copy raw bits through an integer view
MAX_ROW_BLOCK = 1024  # elements of a token row one program copies


def capacity(data: torch.Tensor, block_tables: torch.Tensor | None) -> int:
    """Positions each request can hold."""
    return data.shape[3] if block_tables is None else block_tables.shape[1] * data.shape[3]


def slots(data: torch.Tensor, block_tables: torch.Tensor | None, b, pos):
    """Index of dims 2 and 3 of ``data`` for position(s) ``pos`` of request(s) ``b``."""
    if block_tables is None:
        return b, pos
    page = data.shape[3]
    return block_tables[b, pos // page].long(), pos % page


def check_cache(data: torch.Tensor, block_tables: torch.Tensor | None) -> None:
    check_tensor("data", data, dtype=DTYPES, ndim=6, contiguous=True)
    if data.shape[1] != 2:
        raise ValueError(f"data must have shape [L, 2, ...] (K and V), got {tuple(data.shape)}")
    if block_tables is not None:
        check_tensor("block_tables", block_tables, dtype=torch.int32, ndim=2, device=data.device, contiguous=True)


def check_lengths(seq_lens: torch.Tensor, data: torch.Tensor, block_tables: torch.Tensor | None) -> int:
    """Checks ``seq_lens [B]`` against the cache; returns B."""
    check_tensor("seq_lens", seq_lens, dtype=torch.int32, ndim=1, device=data.device, contiguous=True)
    batch = seq_lens.shape[0]
    if batch == 0:
        raise ValueError("seq_lens is empty: the batch needs at least one request")
    rows = data.shape[2] if block_tables is None else block_tables.shape[0]
    if block_tables is None and batch > rows:
        raise ValueError(f"seq_lens has {batch} requests but data holds {rows} request rows")
    if block_tables is not None and batch != rows:
        raise ValueError(f"seq_lens has {batch} requests but block_tables has {rows} rows")
    check_same_device(data=data, seq_lens=seq_lens)
    return batch


def check_block_ids(data: torch.Tensor, block_tables: torch.Tensor | None, lengths: list[int]) -> None:
    """The block ids covering each request's first ``lengths[b]`` positions name real blocks (reads values)."""
    if block_tables is None:
        return
    pool, page = data.shape[2], data.shape[3]
    for b, row in enumerate(block_tables.tolist()):
        used = row[: -(-lengths[b] // page)]
        if used and (min(used) < 0 or max(used) >= pool):
            raise ValueError(f"block_tables row {b} holds block ids outside [0, {pool}) in its used part")
