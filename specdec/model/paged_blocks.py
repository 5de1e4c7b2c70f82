"""The paged KV cache's block bookkeeping (host side): which physical blocks each request holds.

Request b's token t lives in block ``tables[b, t // block_size]``, slot ``t % block_size``.
Blocks come from a shared ``BlockAllocator`` when a request grows (``grow``) and go back when
it shrinks or ends (``trim``); the caller (``KVCache``) decides the lengths from its host
bounds, so nothing here reads a device value. Table entries past a request's blocks are stale
but always valid ids (0 at first), so an over-read in a masked lane stays inside the pool; the
table is copied to the device (asynchronously) only when a request grows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from specdec._transfer import to_device
from specdec.model.block_allocator import BlockAllocator


class PagedBlocks:
    """The blocks of ``batch_size`` requests of up to ``max_len`` tokens in a pool of ``num_blocks``.

    Attributes
    ----------
    allocator : the pool's free list.
    blocks : per request, its block ids in token order.
    tables : ``[B, ceil(max_len / block_size)]`` int32 on ``device``, the block tables the kernels read.

    Example
    -------
    >>> pages = PagedBlocks(batch_size=2, max_len=64, block_size=16, num_blocks=5, device="cpu")
    >>> pages.grow([20, 3]); pages.blocks, pages.num_free
    ([[0, 1], [2]], 2)
    >>> pages.short(0, 40), pages.short(1, 16)  # blocks each would still have to take
    (1, 0)
    >>> pages.trim([0, 3]); pages.blocks, pages.num_free
    ([[], [2]], 4)
    """

    def __init__(self, *, batch_size: int, max_len: int, block_size: int, num_blocks: int, device):
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        self.blocks: list[list[int]] = [[] for _ in range(batch_size)]
        self._host_tables = torch.zeros(batch_size, math.ceil(max_len / block_size), dtype=torch.int32)
        self.tables = torch.zeros_like(self._host_tables, device=device)

    @property
    def num_free(self) -> int:
        return self.allocator.num_free

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    def needed(self, length: int) -> int:
        """Blocks that hold ``length`` tokens."""
        return -(-length // self.block_size)

    def short(self, b: int, length: int) -> int:
        """Blocks request ``b`` must still take to hold ``length`` tokens (0 if it holds enough)."""
        return max(self.needed(length) - len(self.blocks[b]), 0)

    def total_short(self, lengths: Sequence[int]) -> int:
        return sum(self.short(b, n) for b, n in enumerate(lengths))

    def grow(self, lengths: Sequence[int]) -> None:
        """Give each request the blocks that hold ``lengths[b]`` tokens, or refuse (ValueError) taking none."""
        short = self.total_short(lengths)
        if short > self.num_free:
            worst = max(range(len(lengths)), key=lambda b: self.short(b, lengths[b]))
            raise ValueError(
                f"the paged cache is out of blocks: this step needs {short} more but only {self.num_free} "
                f"are free (request {worst} alone needs {self.short(worst, lengths[worst])})"
            )
        changed = False
        for b, length in enumerate(lengths):
            missing = self.short(b, length)
            if missing:
                ids = self.allocator.allocate(missing)
                first = len(self.blocks[b])
                self.blocks[b].extend(ids)
                self._host_tables[b, first : first + missing] = torch.tensor(ids, dtype=torch.int32)
                changed = True
        if changed:
            to_device(self._host_tables, torch.int32, self.tables.device, out=self.tables)

    def trim(self, lengths: Sequence[int]) -> None:
        """Return each request's blocks past the first ``needed(lengths[b])`` to the free list."""
        for b, length in enumerate(lengths):
            keep = self.needed(length)
            if len(self.blocks[b]) > keep:
                self.allocator.free(self.blocks[b][keep:])
                del self.blocks[b][keep:]
