"""The paged KV cache's free list of physical blocks (host side)."""

from __future__ import annotations

from collections.abc import Sequence


class BlockAllocator:
    """Free list of physical block ids (host side); detects double frees and foreign ids.

    Example
    -------
    >>> pool = BlockAllocator(4)
    >>> pool.allocate(3), pool.num_free
    ([0, 1, 2], 1)
    >>> pool.free([1]); pool.allocate(1)
    [1]
    """

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: low ids are handed out first
        self._in_use = [False] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise ValueError(f"cannot allocate {n} blocks: only {len(self._free)} of {self.num_blocks} are free")
        ids = [self._free.pop() for _ in range(n)]
        for i in ids:
            self._in_use[i] = True
        return ids

    def free(self, ids: Sequence[int]) -> None:
        for i in ids:
            if not 0 <= i < self.num_blocks or not self._in_use[i]:
                raise ValueError(f"block {i} is not allocated")
            self._in_use[i] = False
            self._free.append(i)
