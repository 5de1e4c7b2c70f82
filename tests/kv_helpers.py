"""Bit-exact helpers shared by the KV op tests and the KV cache tests (import as `from kv_helpers import ...`)."""

import contextlib
import math

import torch

BITS = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}


def random_bits_(t: torch.Tensor) -> torch.Tensor:
    """Fill a float tensor with random bit patterns (NaNs and infinities included)."""
    t.view(BITS[t.dtype]).random_()
    return t


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(BITS[a.dtype]), b.view(BITS[b.dtype]))


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    a, e = actual.view(BITS[actual.dtype]), expected.view(BITS[expected.dtype])
    if not torch.equal(a, e):
        idx = tuple(int(i) for i in (a != e).nonzero()[0])
        raise AssertionError(f"{what}: first differing element at {idx}: {int(a[idx])} != {int(e[idx])} (bits)")


def slot(data, block_tables, b, pos):
    """Index of dims 2, 3 of the stacked cache for position ``pos`` of request ``b``."""
    if block_tables is None:
        return b, pos
    page = data.shape[3]
    return int(block_tables[b, pos // page]), pos % page


def row(data, block_tables, b, pos):
    """``[L, 2, Hkv, D]``: every layer's K and V at one position."""
    i, j = slot(data, block_tables, b, pos)
    return data[:, :, i, j]


def random_path(gen: torch.Generator, tree_size: int) -> list[int]:
    """The root-to-node path of a random node in a random tree (increasing local indices)."""
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, tree_size)]
    node = int(torch.randint(0, tree_size, (1,), generator=gen))
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def pad(paths: list[list[int]], width: int) -> torch.Tensor:
    return torch.tensor([p + [-1] * (width - len(p)) for p in paths], dtype=torch.int32).view(len(paths), width)


def make_cache_tensors(layout, L, B, max_len, Hkv, D, dtype, page=4, gen=None):
    """A random stacked cache and, for the paged layout, a shuffled block table."""
    if layout == "contiguous":
        return random_bits_(torch.empty(L, 2, B, max_len, Hkv, D, dtype=dtype)), None
    blocks = math.ceil(max_len / page)
    num_blocks = B * blocks + 3  # spare blocks that nobody owns must stay untouched
    perm = torch.randperm(num_blocks, generator=gen)[: B * blocks]
    tables = perm.view(B, blocks).to(torch.int32).contiguous()
    return random_bits_(torch.empty(L, 2, num_blocks, page, Hkv, D, dtype=dtype)), tables


@contextlib.contextmanager
def programs_in_order(order):
    """Run interpreted Triton launches with each grid's programs in another sequence: ``"reverse"``, or a
    shuffle drawn from seed ``order`` (a new one per launch).

    Triton's interpreter runs a launch's programs one at a time in grid order; a GPU runs them at once.
    A kernel whose program reads what another program writes can pass in grid order by luck of that
    order; in reverse or shuffled it gives another result. (The interpreter numbers each program through
    ``set_grid_idx``; this renumbers them.)
    """
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    number = builder.set_grid_idx
    gen = None if order == "reverse" else torch.Generator().manual_seed(order)
    sequence = []

    def renumbered(x, y, z):
        nx, ny, nz = builder.grid_dim
        i = (x * ny + y) * nz + z
        if i == 0:  # a new launch
            total = nx * ny * nz
            sequence[:] = range(total - 1, -1, -1) if gen is None else torch.randperm(total, generator=gen).tolist()
        k = sequence[i]
        number(k // (ny * nz), k // nz % ny, k % nz)

    builder.set_grid_idx = renumbered
    try:
        yield
    finally:
        del builder.set_grid_idx  # the class's method again
