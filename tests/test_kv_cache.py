"""KV cache: append and accepted-path compaction (Triton and PyTorch), capacity, the paged allocator.

Every check is bitwise: caches are filled with random bit patterns (NaN payloads
included), so a move that goes through a float conversion, misses a row or writes a
wrong one cannot pass. Expected results come from a plain Python oracle that reads a
snapshot taken before the op, independent of both implementations.
"""

import math

import pytest
import torch

from specdec.kernels import kv_append, kv_compact
from specdec.kernels.kv_cache_ops import kv_append_reference, kv_compact_reference
from specdec.model import BlockAllocator, KVCache

BITS = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}


# ---- helpers ------------------------------------------------------------------------------------


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


# ---- kv_append ----------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_append_matches_oracle(backend, device, layout, dtype):
    gen = torch.Generator().manual_seed(1)
    L, B, max_len, Hkv, D = 3, 4, 23, 3, 5  # odd sizes: rows of 15 elements, blocks of 4
    data, tables = make_cache_tensors(layout, L, B, max_len, Hkv, D, dtype, gen=gen)
    seq_lens = torch.tensor([0, 7, 3, 15], dtype=torch.int32)
    counts = [5, 0, 9, 8]  # request 1 sends nothing; request 3 fills its last slot
    offsets = torch.tensor([0] + counts, dtype=torch.int32).cumsum(0).to(torch.int32)
    T = sum(counts)
    fused = random_bits_(torch.empty(T, 3, Hkv, D, dtype=dtype))  # k, v as strided views of a fused QKV
    k, v = fused[:, 1], fused[:, 2]
    before = data.clone()
    dev = lambda t: None if t is None else t.to(device)
    data_d = data.to(device)
    kv_append(data_d, 1, k.to(device), v.to(device), dev(seq_lens), dev(offsets), dev(tables))
    expected = before.clone()
    t = 0
    for b in range(B):
        for i in range(counts[b]):
            i2, j2 = slot(expected, tables, b, int(seq_lens[b]) + i)
            expected[1, 0, i2, j2] = k[t]
            expected[1, 1, i2, j2] = v[t]
            t += 1
    assert_same_bits(data_d.cpu(), expected, f"{layout} append")


def test_append_reference_equals_kernel_path_on_random_batches(backend, device):
    gen = torch.Generator().manual_seed(2)
    for layout in ("contiguous", "paged"):
        data, tables = make_cache_tensors(layout, 2, 3, 17, 2, 8, torch.float32, gen=gen)
        seq_lens = torch.randint(0, 8, (3,), generator=gen, dtype=torch.int32)
        counts = torch.randint(0, 10, (3,), generator=gen)
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]).to(torch.int32)
        k = random_bits_(torch.empty(int(counts.sum()), 2, 8))
        v = random_bits_(torch.empty_like(k))
        expected = data.clone()
        kv_append_reference(expected, 0, k, v, seq_lens, offsets, tables)
        got = data.to(device)
        kv_append(got, 0, k.to(device), v.to(device), seq_lens.to(device), offsets.to(device),
                  None if tables is None else tables.to(device))  # fmt: skip
        assert_same_bits(got.cpu(), expected, layout)


# ---- kv_compact ---------------------------------------------------------------------------------


def compact_oracle(data, tables, seq_lens, paths):
    """Expected cache and lengths: position s+j gets the snapshot's row at s+path[j]."""
    expected = data.clone()
    for b, path in enumerate(paths):
        s = int(seq_lens[b])
        for j, node in enumerate(path):
            i, p = slot(expected, tables, b, s + j)
            expected[:, :, i, p] = row(data, tables, b, s + node)
    return expected, seq_lens + torch.tensor([len(p) for p in paths], dtype=torch.int32)


def run_compact(data, tables, seq_lens, path, device):
    data_d, lens_d = data.to(device), seq_lens.to(device)
    kv_compact(data_d, lens_d, path.to(device), None if tables is None else tables.to(device))
    return data_d.cpu(), lens_d.cpu()


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_compact_random_paths_mixed_batch(backend, device, layout, dtype):
    """Random tree paths, a chain, an empty path, a lone root: all layers, K and V, ragged prefixes."""
    gen = torch.Generator().manual_seed(3)
    L, B, max_len, Hkv, D = 3, 6, 30, 2, 6
    data, tables = make_cache_tensors(layout, L, B, max_len, Hkv, D, dtype, gen=gen)
    seq_lens = torch.tensor([0, 5, 3, 9, 13, 2], dtype=torch.int32)  # prefixes not aligned to blocks of 4
    paths = [
        random_path(gen, 12),
        [0, 1, 2, 3],  # a chain: nothing moves
        [],  # nothing accepted
        [0],
        [0, 2, 5, 6, 11],  # position s+2 is written (from s+5) and read (for s+1) in the same launch
        [0, 3, 4, 9, 15],  # crosses several block boundaries
    ]
    path = pad(paths, 12)
    expected, lens = compact_oracle(data, tables, seq_lens, paths)
    got, got_lens = run_compact(data, tables, seq_lens, path, device)
    assert_same_bits(got, expected, f"{layout} compact")
    assert got_lens.tolist() == lens.tolist()


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_compact_overlapping_moves(backend, device, layout):
    """Every destination is also a source of a later move: a read-after-write bug shows up here."""
    data, tables = make_cache_tensors(layout, 2, 2, 24, 1, 4, torch.float16)
    seq_lens = torch.tensor([1, 4], dtype=torch.int32)
    paths = [[0, 1, 3, 4, 6, 7, 9, 10], [0, 2, 3, 5, 6, 8, 9, 11]]  # dst j = src of an earlier/later entry
    expected, lens = compact_oracle(data, tables, seq_lens, paths)
    got, got_lens = run_compact(data, tables, seq_lens, pad(paths, 8), device)
    assert_same_bits(got, expected, "overlap")
    assert got_lens.tolist() == lens.tolist() == [9, 12]


def test_compact_chain_and_empty_paths_change_only_lengths(backend, device):
    data, tables = make_cache_tensors("paged", 2, 3, 20, 2, 4, torch.float32)
    seq_lens = torch.tensor([3, 0, 11], dtype=torch.int32)
    path = pad([[0, 1, 2, 3, 4], [], [0]], 6)
    got, got_lens = run_compact(data, tables, seq_lens, path, device)
    assert same_bits(got, data)
    assert got_lens.tolist() == [8, 0, 12]


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_rows_wider_than_one_tile(backend, device, layout):
    """Hkv * D = 1280 elements: the kernels split each token row over two programs (the second partial)."""
    gen = torch.Generator().manual_seed(13)
    data, tables = make_cache_tensors(layout, 1, 2, 12, 5, 256, torch.float16, gen=gen)
    seq_lens = torch.tensor([1, 3], dtype=torch.int32)
    k, v = random_bits_(torch.empty(2, 7, 5, 256, dtype=torch.float16))
    offsets = torch.tensor([0, 4, 7], dtype=torch.int32)
    expected = data.clone()
    kv_append_reference(expected, 0, k, v, seq_lens, offsets, tables)
    paths = [[0, 2, 3], [0, 2]]
    expected, lens = compact_oracle(expected, tables, seq_lens, paths)
    dev = lambda t: None if t is None else t.to(device)
    got, got_lens = dev(data), dev(seq_lens)
    kv_append(got, 0, dev(k), dev(v), got_lens, dev(offsets), dev(tables))
    kv_compact(got, got_lens, dev(pad(paths, 3)), dev(tables))
    assert_same_bits(got.cpu(), expected, layout)
    assert got_lens.cpu().tolist() == lens.tolist() == [4, 5]


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_compact_llama_shape_on_gpu(layout):
    """The benchmark's shape compiled: 32 layers, 64 requests, 8 KV heads of 128, bf16, 64-node trees."""
    gen = torch.Generator().manual_seed(14)
    data, tables = make_cache_tensors(layout, 32, 64, 192, 8, 128, torch.bfloat16, page=16, gen=gen)
    seq_lens = torch.randint(0, 128, (64,), generator=gen, dtype=torch.int32)
    paths = [random_path(gen, 64)[:8] for _ in range(64)]
    expected, lens = data.clone(), seq_lens.clone()
    kv_compact_reference(expected, lens, pad(paths, 8), tables)
    got, got_lens = data.cuda(), seq_lens.cuda()
    kv_compact(got, got_lens, pad(paths, 8).cuda(), None if tables is None else tables.cuda())
    assert_same_bits(got.cpu(), expected, layout)
    assert torch.equal(got_lens.cpu(), lens)


def test_compact_reference_matches_oracle():
    gen = torch.Generator().manual_seed(4)
    for layout in ("contiguous", "paged"):
        data, tables = make_cache_tensors(layout, 2, 5, 40, 2, 3, torch.float32, gen=gen)
        seq_lens = torch.randint(0, 20, (5,), generator=gen, dtype=torch.int32)
        paths = [random_path(gen, 16) for _ in range(5)]
        expected, lens = compact_oracle(data, tables, seq_lens, paths)
        got, got_lens = data.clone(), seq_lens.clone()
        kv_compact_reference(got, got_lens, pad(paths, 16), tables)
        assert_same_bits(got, expected, layout)
        assert torch.equal(got_lens, lens)


def test_compact_repeated_calls_reuse_tickets(backend, device):
    """The Triton kernel's per-request tickets are left zero, so back-to-back calls keep working."""
    gen = torch.Generator().manual_seed(5)
    data, tables = make_cache_tensors("contiguous", 2, 3, 64, 1, 2, torch.float32, gen=gen)
    seq_lens = torch.zeros(3, dtype=torch.int32)
    tickets = torch.zeros(3, dtype=torch.int32, device=device)
    data_d, lens_d = data.to(device), seq_lens.to(device)
    for _ in range(4):
        paths = [random_path(gen, 6) for _ in range(3)]
        data, seq_lens = compact_oracle(data, None, seq_lens, paths)
        kv_compact(data_d, lens_d, pad(paths, 6).to(device), tickets=tickets)
        assert_same_bits(data_d.cpu(), data, "step")
        assert lens_d.cpu().tolist() == seq_lens.tolist()
    assert tickets.cpu().tolist() == [0, 0, 0]


# ---- the cache object ---------------------------------------------------------------------------


def logical(cache: KVCache, b: int) -> torch.Tensor:
    """``[L, 2, seq_len, Hkv, D]``: request b's committed K/V in order, whatever the layout."""
    n = int(cache.seq_lens[b])
    if n == 0:
        return cache.data.new_empty(cache.num_layers, 2, 0, cache.num_kv_heads, cache.head_dim)
    return torch.stack([row(cache.data, cache.block_tables, b, p) for p in range(n)], dim=2)


def write_step(cache, counts, gen):
    """Write random K/V of ``counts[b]`` tokens per request into every layer; returns them (CPU) [L, 2, T, Hkv, D]."""
    T = sum(counts)
    kv = random_bits_(torch.empty(cache.num_layers, 2, T, cache.num_kv_heads, cache.head_dim, dtype=cache.dtype))
    offsets = torch.tensor([0] + counts, dtype=torch.int32).cumsum(0).to(torch.int32).to(cache.device)
    cache.reserve(counts)
    on_device = kv.to(cache.device)
    for layer in range(cache.num_layers):
        cache.write(layer, on_device[layer, 0], on_device[layer, 1], offsets)
    return kv, offsets


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_cache_views_and_shapes(layout):
    cache = KVCache(3, 2, 4, 8, max_len=20, dtype=torch.float16, device="cpu", layout=layout, block_size=8)
    k, v = cache.layer(2)
    if layout == "contiguous":
        assert cache.data.shape == (3, 2, 2, 20, 4, 8) and k.shape == (2, 20, 4, 8) and cache.block_tables is None
    else:
        assert cache.data.shape == (3, 2, 6, 8, 4, 8) and k.shape == (6, 8, 4, 8)
        assert cache.block_tables.shape == (2, 3) and cache.block_tables.dtype == torch.int32
    assert k.data_ptr() == cache.data[2, 0].data_ptr() and v.data_ptr() == cache.data[2, 1].data_ptr()
    assert k.stride(-1) == 1 and cache.seq_lens.dtype == torch.int32
    assert repr(cache).startswith(f"KVCache({layout}, layers=3, batch=2")


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_partial_acceptance_lengths_and_next_positions(backend, device, layout):
    """Per-request lengths after partial acceptance, and the next step writes at each new length."""
    gen = torch.Generator().manual_seed(6)
    cache = KVCache(2, 4, 2, 4, max_len=40, dtype=torch.float32, device=device, layout=layout, block_size=4)
    prompt, _ = write_step(cache, [3, 6, 1, 9], gen)
    cache.advance([3, 6, 1, 9])
    tree, _ = write_step(cache, [7, 5, 1, 8], gen)
    paths = [[0, 2, 6], [0], [0], [0, 1, 3, 7]]
    cache.compact(pad(paths, 5).to(device))
    assert cache.seq_lens.cpu().tolist() == [6, 7, 2, 13]
    assert cache.length_bounds() == [8, 11, 2, 14]  # host bounds: prefix + min(tree, path width)
    decode, _ = write_step(cache, [1, 1, 1, 1], gen)
    cache.advance(torch.ones(4, dtype=torch.int32, device=device))
    assert cache.seq_lens.cpu().tolist() == [7, 8, 3, 14]
    starts = [0, 3, 9, 10]
    tree_starts = [0, 7, 12, 13]
    for b in range(4):
        got = logical(cache, b).cpu()
        n_prompt = [3, 6, 1, 9][b]
        want = torch.cat(
            [
                prompt[:, :, starts[b] : starts[b] + n_prompt],
                tree[:, :, [tree_starts[b] + node for node in paths[b]]],
                decode[:, :, b : b + 1],
            ],
            dim=2,
        )
        assert_same_bits(got, want, f"request {b}")


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_capacity_refused_before_writing(layout):
    gen = torch.Generator().manual_seed(7)
    cache = KVCache(2, 3, 1, 4, max_len=10, dtype=torch.float32, device="cpu", layout=layout, block_size=4)
    write_step(cache, [4, 10, 2], gen)
    cache.advance([4, 10, 2])
    before, lens = cache.data.clone(), cache.seq_lens.clone()
    k = torch.randn(9, 1, 4)
    with pytest.raises(ValueError, match=r"request 1 would pass its capacity of 10 tokens by 1 \(10 cached \+ 1 new\)"):
        cache.write(0, k, k, torch.tensor([0, 6, 7, 9], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"request 0 would pass its capacity of 10 tokens by 1 \(4 cached \+ 7 new\)"):
        cache.reserve([7, 0, 2])
    assert same_bits(cache.data, before) and torch.equal(cache.seq_lens, lens)
    # exactly up to capacity is fine
    write_step(cache, [6, 0, 8], gen)
    cache.advance([6, 0, 8])
    assert cache.seq_lens.tolist() == [10, 10, 10] and cache.room() == [0, 0, 0]


def test_loose_bounds_are_settled_by_one_sync(backend, device):
    """Partial acceptance leaves the host bound above the true length; a write that really fits is admitted."""
    gen = torch.Generator().manual_seed(8)
    cache = KVCache(1, 2, 1, 2, max_len=12, dtype=torch.float16, device=device, layout="paged", block_size=2)
    write_step(cache, [8, 8], gen)
    cache.compact(pad([[0, 3], [0]], 8).to(device))  # path width 8: bounds grow by up to 8
    assert cache.length_bounds() == [8, 8] and cache.room() == [4, 4]
    write_step(cache, [9, 10], gen)  # fits exactly: 2 + 9 <= 12, 1 + 10 <= 12
    assert cache.length_bounds() == [2, 1]
    with pytest.raises(ValueError, match="request 1 would pass its capacity of 12 tokens by 1"):
        cache.reserve([0, 12])


def test_known_lengths_tighten_bounds_and_free_pages_without_a_device_read():
    gen = torch.Generator().manual_seed(9)
    cache = KVCache(1, 2, 1, 2, max_len=12, dtype=torch.float16, device="cpu", layout="paged", block_size=2)
    write_step(cache, [8, 8], gen)
    cache.compact(pad([[0, 3], [0]], 8))
    held = cache.allocator.num_free
    cache.known_lengths([2, 1])  # what the caller's own read-back said
    assert cache.length_bounds() == [2, 1] and cache.room() == [10, 11]
    assert cache.allocator.num_free == held + 6  # 4 + 4 blocks held for the bounds, 1 + 1 needed now
    with pytest.raises(ValueError, match=r"lengths\[0\] = 3 must lie in \[0, 2\]"):
        cache.known_lengths([3, 1])


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_generation_up_to_capacity(backend, device, layout):
    """Trees shortened to the guaranteed room fill every request exactly to max_len, nothing spills."""
    gen = torch.Generator().manual_seed(11)
    B, max_len = 3, 21
    cache = KVCache(1, B, 1, 2, max_len=max_len, dtype=torch.float16, device=device, layout=layout, block_size=4)
    expected = [[] for _ in range(B)]  # the K/V rows each request should hold, in order
    for _ in range(60):
        room = cache.room()
        if max(room) == 0:
            room = [max_len - n for n in cache.sync_lengths()]
            if max(room) == 0:
                break
        sizes = [min(int(torch.randint(1, 7, (1,), generator=gen)), r) for r in room]
        kv, _ = write_step(cache, sizes, gen)
        paths = [random_path(gen, s)[:4] if s else [] for s in sizes]
        cache.compact(pad(paths, 4).to(device))
        start = 0
        for b in range(B):
            expected[b] += [kv[:, :, start + node] for node in paths[b]]
            start += sizes[b]
    assert cache.seq_lens.cpu().tolist() == [max_len] * B
    for b in range(B):
        assert_same_bits(logical(cache, b).cpu(), torch.stack(expected[b], dim=2), f"request {b}")
    with pytest.raises(ValueError, match=f"request 0 would pass its capacity of {max_len} tokens by 1"):
        cache.reserve([1, 0, 0])


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_uncommitted_forward_is_replaced_or_discarded(layout):
    """A second forward without a commit starts a new step; release() mid-step spares the others; discard()."""
    gen = torch.Generator().manual_seed(12)
    cache = KVCache(2, 2, 1, 2, max_len=12, dtype=torch.float32, device="cpu", layout=layout, block_size=2)
    write_step(cache, [9, 9], gen)  # never committed
    again = random_bits_(torch.empty(2, 2, 3, 1, 2))
    offsets = torch.tensor([0, 1, 3], dtype=torch.int32)
    for layer in range(2):  # no reserve: counts come from q_offsets, replacing the stale reservation
        cache.write(layer, again[layer, 0], again[layer, 1], offsets)
    cache.advance([1, 2])
    assert cache.length_bounds() == [1, 2]
    assert_same_bits(logical(cache, 1), again[:, :, 1:3], "request 1")
    if layout == "paged":
        assert [len(b) for b in cache._blocks] == [1, 1]
    tree, _ = write_step(cache, [5, 5], gen)
    cache.release(0)  # mid-step: request 1's uncommitted tree keeps its blocks
    cache.compact(pad([[], [0, 3, 4]], 3))
    assert cache.seq_lens.tolist() == [0, 5]
    assert_same_bits(logical(cache, 1)[:, :, 2:], tree[:, :, [5 + 0, 5 + 3, 5 + 4]], "request 1 after release(0)")
    write_step(cache, [5, 5], gen)
    cache.discard()
    assert cache.length_bounds() == [0, 5] and cache.seq_lens.tolist() == [0, 5]
    if layout == "paged":
        assert cache.allocator.num_free == cache.allocator.num_blocks - 3


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_truncate_rollback_release(layout):
    gen = torch.Generator().manual_seed(9)
    cache = KVCache(1, 3, 1, 2, max_len=16, dtype=torch.float32, device="cpu", layout=layout, block_size=4)
    write_step(cache, [10, 12, 5], gen)
    cache.advance([10, 12, 5])
    cache.truncate([6, 20, 0])
    assert cache.seq_lens.tolist() == [6, 12, 0] and cache.length_bounds() == [6, 12, 0]
    cache.rollback(3)
    assert cache.seq_lens.tolist() == [3, 9, 0]
    cache.rollback(torch.tensor([1, 9, 0], dtype=torch.int32))
    assert cache.seq_lens.tolist() == [2, 0, 0]
    if layout == "paged":
        assert [len(b) for b in cache._blocks] == [1, 0, 0]
    cache.release(0)
    assert cache.seq_lens.tolist() == [0, 0, 0]
    if layout == "paged":
        assert cache.allocator.num_free == cache.allocator.num_blocks


@pytest.mark.parametrize("steps", [40])
def test_paged_allocator_reuse_without_leaks(backend, device, steps):
    """Many decode steps of random trees on a small shared pool, checked against a contiguous twin."""
    gen = torch.Generator().manual_seed(10)
    B, L, page = 3, 2, 2
    paged = KVCache(
        L, B, 1, 2, max_len=24, dtype=torch.float32, device=device, layout="paged", block_size=page, num_blocks=20
    )  # fmt: skip  (36 would cover every request at max_len)
    twin = KVCache(L, B, 1, 2, max_len=24, dtype=torch.float32, device=device)
    seen_owners = {}
    for step in range(steps):
        bounds = paged.sync_lengths() if step % 7 == 0 else paged.length_bounds()
        sizes = [int(torch.randint(1, 6, (1,), generator=gen)) for _ in range(B)]
        ended = [b for b in range(B) if bounds[b] + sizes[b] > 24]
        if step % 11 == 10:
            ended.append(int(torch.randint(0, B, (1,), generator=gen)))
        while True:
            for cache in (paged, twin):
                cache.release(ended)
            try:
                paged.reserve(sizes)
                break
            except ValueError as exc:  # the pool is smaller than the requests' total: end the longest
                assert "out of blocks" in str(exc)
                ended = [max(range(B), key=lambda b: paged.length_bounds()[b])]
        twin.reserve(sizes)
        kv = random_bits_(torch.empty(L, 2, sum(sizes), 1, 2))
        offsets = torch.tensor([0] + sizes, dtype=torch.int32).cumsum(0).to(torch.int32).to(device)
        for cache in (paged, twin):
            for layer in range(L):
                cache.write(layer, kv[layer, 0].to(device), kv[layer, 1].to(device), offsets)
        if step % 5 == 3:
            paged.sync_lengths()  # mid-step: the blocks holding this step's tree must survive
        paths = pad([random_path(gen, s) for s in sizes], 5).to(device)
        paged.compact(paths)
        twin.compact(paths)
        for b in range(B):
            for block in paged._blocks[b]:
                seen_owners.setdefault(block, set()).add(b)
        assert torch.equal(paged.seq_lens, twin.seq_lens)
        owned = [blk for blocks in paged._blocks for blk in blocks]
        assert len(owned) == len(set(owned)), "a block is owned twice"
        assert paged.allocator.num_free + len(owned) == 20, "blocks leaked"
        for b in range(B):
            assert same_bits(logical(paged, b), logical(twin, b)), f"step {step}, request {b}"
    assert any(len(owners) > 1 for owners in seen_owners.values()), "no block was ever reused by another request"
    paged.release()
    assert paged.allocator.num_free == 20


def test_paged_pool_exhaustion_is_refused():
    cache = KVCache(1, 2, 1, 2, max_len=16, dtype=torch.float32, device="cpu", layout="paged", block_size=4,
                    num_blocks=5)  # fmt: skip
    cache.reserve([12, 8])
    cache.advance([12, 8])
    before = cache.data.clone()
    with pytest.raises(ValueError, match=r"out of blocks: this step needs 2 more but only 0 are free \(request 0"):
        cache.reserve([4, 4])
    assert same_bits(cache.data, before) and cache.seq_lens.tolist() == [12, 8]
    cache.release(1)
    cache.reserve([4, 0])  # blocks of the released request are reused


def test_block_allocator():
    alloc = BlockAllocator(4)
    ids = alloc.allocate(3)
    assert sorted(ids) == [0, 1, 2] and alloc.num_free == 1
    alloc.free([ids[1]])
    with pytest.raises(ValueError, match="block 1 is not allocated"):
        alloc.free([1])
    with pytest.raises(ValueError, match="block 9 is not allocated"):
        alloc.free([9])
    with pytest.raises(ValueError, match="cannot allocate 3 blocks: only 2 of 4"):
        alloc.allocate(3)


def test_docstring_examples():
    import doctest

    import specdec.kernels.kv_cache_ops
    import specdec.model.kv_cache

    for module in (specdec.kernels.kv_cache_ops, specdec.model.kv_cache):
        result = doctest.testmod(module, extraglobs={"torch": torch})
        assert result.attempted > 0 and result.failed == 0, module.__name__


# ---- bad input ----------------------------------------------------------------------------------


def test_bad_op_inputs():
    data = torch.zeros(2, 2, 3, 8, 1, 4)
    seq_lens = torch.zeros(3, dtype=torch.int32)
    offsets = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    k = torch.zeros(3, 1, 4)
    with pytest.raises(TypeError, match="data must have dtype"):
        kv_append(data.long(), 0, k, k, seq_lens, offsets)
    with pytest.raises(ValueError, match=r"data must have shape \[L, 2"):
        kv_append(torch.zeros(2, 3, 3, 8, 1, 4), 0, k, k, seq_lens, offsets)
    with pytest.raises(ValueError, match="layer must be an int in"):
        kv_append(data, 2, k, k, seq_lens, offsets)
    with pytest.raises(TypeError, match="k must have dtype float32"):
        kv_append(data, 0, k.half(), k, seq_lens, offsets)
    with pytest.raises(ValueError, match="v must have shape"):
        kv_append(data, 0, k, k[:, :, :3], seq_lens, offsets)
    with pytest.raises(ValueError, match="k must have a contiguous last dim"):
        kv_append(data, 0, torch.zeros(3, 1, 8)[:, :, ::2], k, seq_lens, offsets)
    with pytest.raises(TypeError, match="q_offsets must have dtype int32"):
        kv_append(data, 0, k, k, seq_lens, offsets.long())
    with pytest.raises(ValueError, match=r"q_offsets\[-1\] must equal the number of rows \(3\)"):
        kv_append(data, 0, k, k, seq_lens, torch.tensor([0, 1, 2, 2], dtype=torch.int32))
    with pytest.raises(TypeError, match="seq_lens must have dtype int32"):
        kv_append(data, 0, k, k, seq_lens.long(), offsets)
    with pytest.raises(ValueError, match="seq_lens is empty"):
        kv_compact(data, seq_lens[:0], torch.zeros(0, 1, dtype=torch.int32))
    with pytest.raises(TypeError, match="block_tables must have dtype int32"):
        kv_compact(data, seq_lens, torch.zeros(3, 1, dtype=torch.int32), torch.zeros(3, 2))
    with pytest.raises(ValueError, match="seq_lens has 3 requests but block_tables has 2 rows"):
        kv_compact(data, seq_lens, torch.zeros(3, 1, dtype=torch.int32), torch.zeros(2, 2, dtype=torch.int32))
    with pytest.raises(TypeError, match="accepted_path must have dtype int32"):
        kv_compact(data, seq_lens, torch.zeros(3, 1))
    with pytest.raises(ValueError, match=r"accepted_path must have shape \(3, '\*'\)"):
        kv_compact(data, seq_lens, torch.zeros(2, 1, dtype=torch.int32))
    bad_paths = {
        r"accepted_path\[1\] = \[0, 2, 2\] must be strictly increasing": [[0, 1, -1], [0, 2, 2], [-1, -1, -1]],
        r"accepted_path\[0\] = \[0, -1, 3\]: only -1 may follow": [[0, -1, 3], [0, 1, 2], [-1, -1, -1]],
        r"accepted_path\[2\] reaches position 8, past the capacity of 8": [[0, 1, -1], [0, 1, 2], [0, 8, -1]],
    }
    for message, rows in bad_paths.items():
        with pytest.raises(ValueError, match=message):
            kv_compact(data, seq_lens, torch.tensor(rows, dtype=torch.int32))


def test_bad_cache_inputs():
    with pytest.raises(ValueError, match="layout must be one of"):
        KVCache(1, 1, 1, 4, max_len=8, dtype=torch.float32, device="cpu", layout="ring")
    with pytest.raises(TypeError, match="dtype must be float16, bfloat16 or float32"):
        KVCache(1, 1, 1, 4, max_len=8, dtype=torch.int8, device="cpu")
    with pytest.raises(ValueError, match="max_len must be a positive int"):
        KVCache(1, 1, 1, 4, max_len=0, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="num_blocks must be a positive int"):
        KVCache(1, 1, 1, 4, max_len=8, dtype=torch.float32, device="cpu", layout="paged", num_blocks=0)
    cache = KVCache(2, 2, 1, 4, max_len=8, dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="layer must be an int in"):
        cache.layer(2)
    with pytest.raises(ValueError, match="counts must hold 2 ints"):
        cache.reserve([1])
    with pytest.raises(ValueError, match="counts must be host ints or a CPU tensor; reading meta"):
        cache.reserve(torch.ones(2, dtype=torch.int32, device="meta"))
    with pytest.raises(ValueError, match="counts must be >= 0"):
        cache.reserve([1, -1])
    with pytest.raises(ValueError, match=r"counts\[1\] = 9 must be in \[0, 8\]"):
        cache.advance([0, 9])
    cache.reserve([2, 1])
    k = torch.zeros(4, 1, 4)
    with pytest.raises(ValueError, match=r"k has 4 tokens but this step reserved 3 \(\[2, 1\] per request\)"):
        cache.write(0, k, k, torch.tensor([0, 2, 4], dtype=torch.int32))
    cache.write(0, k[:3], k[:3], torch.tensor([0, 2, 3], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"accepted_path\[1\] = \[0, 1\] names node 1 but only 1 nodes were written"):
        cache.compact(torch.tensor([[0, 1], [0, 1]], dtype=torch.int32))
    with pytest.raises(ValueError, match="lengths must be >= 0"):
        cache.truncate([-1, 0])
    with pytest.raises(ValueError, match="n must be >= 0"):
        cache.rollback(-1)
    with pytest.raises(ValueError, match=r"requests must hold ints in \[0, 2\)"):
        cache.release([2])


@pytest.mark.gpu
def test_compact_offsets_past_int32_on_gpu():
    """A paged cache of more than 2^31 elements: the last block of the last slab moves correctly."""
    L, page, Hkv, D = 2, 16, 8, 128
    num_blocks = (1 << 31) // (L * 2 * page * Hkv * D) + 8
    data = torch.empty(L, 2, num_blocks, page, Hkv, D, dtype=torch.float16, device="cuda")
    assert data.numel() > 1 << 31
    tables = torch.tensor([[num_blocks - 2, num_blocks - 1]], dtype=torch.int32, device="cuda")
    data[:, :, num_blocks - 2 :].view(torch.int16).random_()
    data[:, :, num_blocks - 1 :].view(torch.int16).random_()
    seq_lens = torch.tensor([10], dtype=torch.int32, device="cuda")
    path = torch.tensor([[0, 9, 21]], dtype=torch.int32, device="cuda")
    tail = data[:, :, num_blocks - 2 :].clone()
    kv_compact(data, seq_lens, path, tables)
    flat = tail.flatten(2, 3)  # positions 0..31 of the request
    expected = flat.clone()
    expected[:, :, 11] = flat[:, :, 19]
    expected[:, :, 12] = flat[:, :, 31]
    assert same_bits(data[:, :, num_blocks - 2 :].flatten(2, 3), expected)
    assert seq_lens.tolist() == [13]
