"""KV cache object: lengths after partial acceptance, capacity, host bounds, the paged allocator.

Every check is bitwise: caches are filled with random bit patterns (NaN payloads
included), so a move that goes through a float conversion, misses a row or writes a
wrong one cannot pass. The ops underneath (kv_append, kv_compact) are tested in
test_kv_ops.py.
"""

import pytest
import torch
from kv_helpers import assert_same_bits, pad, random_bits_, random_path, row, same_bits

from specdec.model import BlockAllocator, KVCache, PagedBlocks

# ---- the cache object ---------------------------------------------------------------------------


def logical(cache: KVCache, b: int) -> torch.Tensor:
    """``[L, 2, seq_len, Hkv, D]``: request b's committed K/V in order, whatever the layout."""
    n = int(cache.seq_lens[b])
    if n == 0:
        return cache.data.new_empty(cache.num_layers, 2, 0, cache.num_kv_heads, cache.head_dim)
    return torch.stack([row(cache.data, cache.block_tables, b, p) for p in range(n)], dim=2)


def named(device: torch.device) -> str:
    """``device`` spelled as a caller names it, which is not how its tensors report it ("cuda" vs cuda:0,
    "cpu:0" vs cpu): every device test builds its cache this way (the device checks compare like with like)."""
    return "cuda" if device.type == "cuda" else "cpu:0"


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
    cache = KVCache(2, 4, 2, 4, max_len=40, dtype=torch.float32, device=named(device), layout=layout, block_size=4)
    assert cache.device == cache.seq_lens.device == cache.data.device  # as its tensors report it
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
    cache = KVCache(1, 2, 1, 2, max_len=12, dtype=torch.float16, device=named(device), layout="paged", block_size=2)
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
    held = cache.pages.num_free
    cache.known_lengths([2, 1])  # what the caller's own read-back said
    assert cache.length_bounds() == [2, 1] and cache.room() == [10, 11]
    assert cache.pages.num_free == held + 6  # 4 + 4 blocks held for the bounds, 1 + 1 needed now
    with pytest.raises(ValueError, match=r"lengths\[0\] = 3 must lie in \[0, 2\]"):
        cache.known_lengths([3, 1])


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_generation_up_to_capacity(backend, device, layout):
    """Trees shortened to the guaranteed room fill every request exactly to max_len, nothing spills."""
    gen = torch.Generator().manual_seed(11)
    B, max_len = 3, 21
    cache = KVCache(1, B, 1, 2, max_len=max_len, dtype=torch.float16, device=named(device), layout=layout, block_size=4)
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
        assert [len(b) for b in cache.pages.blocks] == [1, 1]
    tree, _ = write_step(cache, [5, 5], gen)
    cache.release(0)  # mid-step: request 1's uncommitted tree keeps its blocks
    cache.compact(pad([[], [0, 3, 4]], 3))
    assert cache.seq_lens.tolist() == [0, 5]
    assert_same_bits(logical(cache, 1)[:, :, 2:], tree[:, :, [5 + 0, 5 + 3, 5 + 4]], "request 1 after release(0)")
    write_step(cache, [5, 5], gen)
    cache.discard()
    assert cache.length_bounds() == [0, 5] and cache.seq_lens.tolist() == [0, 5]
    if layout == "paged":
        assert cache.pages.num_free == cache.pages.num_blocks - 3


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
        assert [len(b) for b in cache.pages.blocks] == [1, 0, 0]
    cache.release(0)
    assert cache.seq_lens.tolist() == [0, 0, 0]
    if layout == "paged":
        assert cache.pages.num_free == cache.pages.num_blocks


@pytest.mark.parametrize("steps", [40])
def test_paged_allocator_reuse_without_leaks(backend, device, steps):
    """Many decode steps of random trees on a small shared pool, checked against a contiguous twin."""
    gen = torch.Generator().manual_seed(10)
    B, L, page, where = 3, 2, 2, named(device)
    paged = KVCache(
        L, B, 1, 2, max_len=24, dtype=torch.float32, device=where, layout="paged", block_size=page, num_blocks=20
    )  # fmt: skip  (36 would cover every request at max_len)
    twin = KVCache(L, B, 1, 2, max_len=24, dtype=torch.float32, device=where)
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
            for block in paged.pages.blocks[b]:
                seen_owners.setdefault(block, set()).add(b)
        assert torch.equal(paged.seq_lens, twin.seq_lens)
        owned = [blk for blocks in paged.pages.blocks for blk in blocks]
        assert len(owned) == len(set(owned)), "a block is owned twice"
        assert paged.pages.num_free + len(owned) == 20, "blocks leaked"
        for b in range(B):
            assert same_bits(logical(paged, b), logical(twin, b)), f"step {step}, request {b}"
    assert any(len(owners) > 1 for owners in seen_owners.values()), "no block was ever reused by another request"
    paged.release()
    assert paged.pages.num_free == 20


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


def test_paged_blocks_grow_trim_and_refuse():
    pages = PagedBlocks(batch_size=3, max_len=40, block_size=8, num_blocks=6, device="cpu")
    pages.grow([9, 1, 0])
    assert [len(b) for b in pages.blocks] == [2, 1, 0] and pages.num_free == 3
    assert pages.tables[0, :2].tolist() == pages.blocks[0] and pages.tables[1, 0].item() == pages.blocks[1][0]
    assert [pages.short(0, 24), pages.short(1, 8), pages.short(2, 17)] == [1, 0, 3]
    with pytest.raises(ValueError, match=r"out of blocks: this step needs 4 more but only 3 are free \(request 2 "):
        pages.grow([9, 1, 25])
    assert [len(b) for b in pages.blocks] == [2, 1, 0] and pages.num_free == 3  # nothing taken
    pages.trim([0, 1, 0])
    assert [len(b) for b in pages.blocks] == [0, 1, 0] and pages.num_free == 5
    pages.grow([0, 1, 40])  # the freed blocks serve another request
    assert len(pages.blocks[2]) == 5 and pages.num_free == 0


@pytest.mark.parametrize("module", ["kv_cache", "paged_blocks", "block_allocator"])
def test_docstring_examples(module):
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(f"specdec.model.{module}"), extraglobs={"torch": torch})
    assert result.attempted > 0 and result.failed == 0


# ---- bad input ----------------------------------------------------------------------------------


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
