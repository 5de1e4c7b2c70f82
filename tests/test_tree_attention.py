"""Tree attention against a float64 oracle (testing.md items 12-16), both backends.

The oracle walks each node's parent pointers to build its root-to-node path and
runs a plain softmax over the prefix keys plus the path keys: it never looks at a
bit mask or a causal flag, so it checks the op's mask handling independently.
"""

import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch
from helpers import assert_close
from triton_bounds import check_bounds as watch_bounds

from specdec import _backend
from specdec.kernels import build_tree_metadata, plan_attention, tree_attention, tuning
from specdec.kernels import tree_attention_torch as torch_path
from specdec.kernels.attention_plan import partial_dtype
from specdec.kernels.tree_attention_kernels import triton_launches
from specdec.kernels.tree_attention_tiles import attention_space, ctas_per_sm, default_splits, tile_config
from specdec.kernels.tree_attention_torch import tree_attention_reference

TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (3e-3, 3e-3), torch.bfloat16: (2e-2, 2e-2)}


def random_tree(n: int) -> list[int]:
    return [-1] + [int(torch.randint(0, i, (1,))) for i in range(1, n)]


def chain(n: int) -> list[int]:
    return list(range(-1, n - 1))


def level_tree(widths: list[int]) -> list[int]:
    """A random tree listed level by level (breadth first): ``widths[l]`` nodes at depth l."""
    parents, first = [-1], 0
    for depth in range(1, len(widths)):
        prev = widths[depth - 1]
        parents += [first + int(torch.randint(0, prev, (1,))) for _ in range(widths[depth])]
        first += prev
    return parents


def ancestor_mask(tree: list[int], width: int) -> torch.Tensor:
    return build_tree_metadata(torch.tensor(tree, dtype=torch.int32), torch.tensor([0, len(tree)], dtype=torch.int32),
                               width).ancestor_mask  # fmt: skip


class Batch:
    """Random queries, a random KV cache (contiguous or paged) and the trees' masks."""

    def __init__(self, prefixes, trees, hq, hkv, d, dtype, device, paged=False, block_size=16, spare=7):
        self.prefixes, self.trees, self.hq, self.hkv, self.d = prefixes, trees, hq, hkv, d
        self.paged, self.block_size = paged, block_size
        sizes = [len(t) for t in trees]
        self.offsets = torch.tensor([0] + sizes, dtype=torch.int32).cumsum(0).to(torch.int32).to(device)
        self.prefix_lens = torch.tensor(prefixes, dtype=torch.int32, device=device)
        self.tree_start = None
        tokens = sum(sizes)
        self.q = torch.randn(tokens, hq, d, dtype=torch.float32).to(dtype).to(device)
        self.lengths = [p + n for p, n in zip(prefixes, sizes)]
        if paged:
            blocks = [max(1, -(-length // block_size)) for length in self.lengths]
            max_blocks = max(blocks) + 2
            num_blocks = sum(blocks) + spare
            order = torch.randperm(num_blocks).tolist()  # shuffled: a contiguous reading cannot pass
            table = torch.randint(0, num_blocks, (len(trees), max_blocks), dtype=torch.int32)
            for b, count in enumerate(blocks):
                table[b, :count] = torch.tensor([order.pop() for _ in range(count)], dtype=torch.int32)
            self.block_table = table.to(device)
            shape = (num_blocks, block_size, hkv, d)
        else:
            self.block_table = None
            shape = (len(trees), max(self.lengths) + spare, hkv, d)
        self.k = torch.randn(shape, dtype=torch.float32).to(dtype).to(device)
        self.v = torch.randn(shape, dtype=torch.float32).to(dtype).to(device)
        width = max(max(sizes), 1)
        self.tree_mask = torch.cat([ancestor_mask(tree, width) for tree in trees if tree]).to(device)

    def kv_at(self, b: int, positions: list[int]):
        """K and V rows [m, Hkv, D] of request b at cache positions."""
        pos = torch.tensor(positions, dtype=torch.long, device=self.k.device)
        if self.block_table is None:
            return self.k[b, pos], self.v[b, pos]
        blocks = self.block_table[b, pos // self.block_size].long()
        return self.k[blocks, pos % self.block_size], self.v[blocks, pos % self.block_size]

    def poison_unused_cache(self):
        """NaN in every cache slot outside the requests' contexts: a read past a context shows up."""
        used = torch.zeros(self.k.shape[:2], dtype=torch.bool)
        for b, length in enumerate(self.lengths):
            for p in range(length):
                if self.block_table is None:
                    used[b, p] = True
                else:
                    used[int(self.block_table[b, p // self.block_size]), p % self.block_size] = True
        used = used.to(self.k.device)
        self.k[~used] = math.nan
        self.v[~used] = math.nan

    def oracle(self, scale=None):
        """float64 (out [Tq, Hq, D], lse [Tq, Hq]) node by node."""
        scale = self.d**-0.5 if scale is None else scale
        group = self.hq // self.hkv
        outs, lses = [], []
        q = self.q.double().cpu()
        row = 0
        for b, tree in enumerate(self.trees):
            p = self.prefixes[b]
            for i in range(len(tree)):
                path, node = [], i
                while node >= 0:
                    path.append(node)
                    node = tree[node]
                positions = list(range(p)) + [p + j for j in sorted(path)]
                k, v = (t.double().cpu().repeat_interleave(group, dim=1) for t in self.kv_at(b, positions))
                s = torch.einsum("hd,mhd->hm", q[row], k) * scale
                lses.append(torch.logsumexp(s, -1))
                outs.append(torch.einsum("hm,mhd->hd", torch.softmax(s, -1), v))
                row += 1
        return torch.stack(outs), torch.stack(lses)

    def run(self, causal=False, return_lse=True, **kwargs):
        out = torch.full_like(self.q, math.nan)  # poisoned: an unwritten row fails
        mask = None if causal else self.tree_mask
        return tree_attention(
            self.q, self.k, self.v, self.offsets, self.prefix_lens, tree_mask=mask, causal=causal,
            block_table=self.block_table, out=out, return_lse=return_lse, **kwargs,
        )  # fmt: skip


def check(batch: Batch, causal=False, what="", **kwargs):
    """Out and lse against the oracle; on the PyTorch backend also the fused path that skips lse."""
    out, lse = batch.run(causal=causal, **kwargs)
    ref_out, ref_lse = batch.oracle(kwargs.get("softmax_scale"))
    atol, rtol = TOL[batch.q.dtype]
    assert out.dtype == batch.q.dtype and lse.dtype == torch.float32
    assert_close(out, ref_out, atol, rtol, f"{what} out")
    assert_close(lse, ref_lse, atol, rtol, f"{what} lse")
    if _backend.forced_backend() == "torch":
        assert_close(batch.run(causal=causal, return_lse=False, **kwargs), ref_out, atol, rtol, f"{what} out (SDPA)")


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_trees_match_oracle(backend, device, paged, dtype):
    # ragged prefixes (0, crossing blocks of 16) and ragged trees, one request with no queries
    trees = [random_tree(13), [-1], [], [-1] + [0] * 8, random_tree(20)]
    batch = Batch([0, 37, 5, 16, 70], trees, hq=4, hkv=2, d=64, dtype=dtype, device=device, paged=paged)
    check(batch, what=f"{backend} {dtype}")


@pytest.mark.parametrize("causal", [False, True], ids=["tree", "causal"])
def test_lse_path_in_query_chunks(monkeypatch, causal):
    # a small score budget makes the PyTorch lse path split the padded queries into chunks of 2
    monkeypatch.setattr(torch_path, "LSE_SCORE_BUDGET", 2 * 4 * 4 * 90)
    trees = [chain(13), [-1], [], chain(20)] if causal else [random_tree(13), [-1], [], random_tree(20)]
    batch = Batch([0, 37, 5, 70], trees, hq=4, hkv=2, d=64, dtype=torch.float32, device="cpu", paged=True)
    with _backend.use_backend("torch"):
        check(batch, causal=causal, what="query chunks")


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_chain_mask_and_causal_flag_equal_causal_attention(backend, device, paged):
    trees = [chain(9), chain(1), chain(24)]
    batch = Batch([3, 0, 41], trees, hq=4, hkv=1, d=64, dtype=torch.float32, device=device, paged=paged)
    check(batch, what="chain mask")
    check(batch, causal=True, what="causal flag")


def test_single_node_is_decode(backend, device):
    batch = Batch([1, 50, 0, 17], [[-1]] * 4, hq=8, hkv=2, d=64, dtype=torch.float32, device=device, paged=True)
    check(batch, what="decode via mask")
    check(batch, causal=True, what="decode via causal")


@pytest.mark.parametrize(
    "d,hq,hkv",
    [(2, 2, 1), (12, 4, 2), (72, 6, 3), (80, 6, 2), (96, 8, 1), (112, 5, 1), (128, 3, 3), (64, 14, 2)],
    ids=lambda x: str(x),
)
def test_head_dims_and_gqa_ratios(backend, device, d, hq, hkv):
    # head dims that are no power of two (12 is no multiple of 16): the Triton path pads them to a tile
    trees = [random_tree(6), chain(3)]
    batch = Batch([9, 20], trees, hq=hq, hkv=hkv, d=d, dtype=torch.float16, device=device, paged=True, block_size=8)
    check(batch, what=f"d={d} hq={hq} hkv={hkv}")


def test_tree_over_256_nodes(backend, device):
    # five 64-bit words per mask row
    batch = Batch([11], [random_tree(300)], hq=2, hkv=1, d=64, dtype=torch.float32, device=device)
    check(batch, what="300-node tree")


def test_64_node_trees_in_two_tiles(backend, device):
    # 64 nodes x 4 heads per request: two 128-row tiles per request (32 nodes each), 64-wide KV steps
    trees = [random_tree(64), random_tree(50)]
    batch = Batch([40, 3], trees, hq=8, hkv=2, d=64, dtype=torch.float16, device=device, paged=True)
    check(batch, what="128-row tiles")


def test_long_prefill_chunk_causal(backend, device):
    batch = Batch([30, 0], [chain(150), chain(70)], hq=2, hkv=1, d=64, dtype=torch.float32, device=device, paged=True)
    check(batch, causal=True, what="prefill chunk")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("splits", [2, 5])
def test_split_context(backend, device, splits, dtype):
    # on the Triton path the context is split over programs and merged by log-sum-exp (fp16: fp16 partials)
    trees = [random_tree(5), [-1], chain(4)]
    batch = Batch([200, 0, 129], trees, hq=4, hkv=2, d=64, dtype=dtype, device=device, paged=True)
    check(batch, what=f"{splits} splits", num_splits=splits)


@pytest.mark.skipif(not _backend.triton_status()[0], reason="triton is not installed")
def test_fp16_split_partials_add_little_error():
    # fp16 queries store their split partials in fp16 (partial_dtype, half the merge's bytes): against the
    # float64 oracle that adds at most half of the float32 partials' mean error, where bf16 storage (3 fewer
    # mantissa bits) adds several times it; bench/bench_split_partials.py measures it at Llama's shapes
    device = "cuda" if torch.cuda.is_available() else "cpu"
    batch = Batch([300, 190], [random_tree(24), chain(8)], hq=4, hkv=2, d=64, dtype=torch.float16, device=device,
                  paged=True)  # fmt: skip
    ref = batch.oracle()[0]
    errors = {}
    with _backend.use_backend("triton"):
        plan = plan_attention(batch.offsets, batch.prefix_lens, num_tokens=32, num_heads=4, cache_shape=batch.k.shape,
                              dtype=torch.float16, tree_mask=batch.tree_mask, block_table=batch.block_table,
                              num_splits=4)  # fmt: skip
        assert plan.part_out.dtype == torch.float16 and plan.part_lse.dtype == torch.float32
        for part_dtype in (torch.float32, torch.float16, torch.bfloat16):
            stored = dataclasses.replace(plan, part_out=torch.empty_like(plan.part_out, dtype=part_dtype))
            out = tree_attention(batch.q, batch.k, batch.v, plan=stored, check=False)
            errors[part_dtype] = (out.double().cpu() - ref).abs().mean().item()
    assert errors[torch.float16] <= 1.5 * errors[torch.float32], errors
    assert errors[torch.bfloat16] > 3 * errors[torch.float32], errors  # the measure tells storage dtypes apart


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_split_partials_dtype(dtype):
    # split outputs are stored in fp16 for fp16 queries only: float32 otherwise (bf16's storage error is
    # larger; fp16 cannot hold every bf16 value); the log-sum-exps always in float32
    assert partial_dtype(dtype) == (torch.float16 if dtype == torch.float16 else torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("block_size", [4, 16, 128], ids=lambda b: f"block{b}")
def test_paged_contexts_across_blocks(backend, device, dtype, block_size):
    # shuffled tables; contexts of 0, 1 block, many blocks and no multiple of the KV step (16 in fp32, 64 in
    # fp16): the block ids of the next step are read one step ahead and must be the right ones; NaN outside
    for causal, trees in ((False, [[-1], random_tree(5), chain(3), [-1], random_tree(9)]), (True, [[-1]] * 5)):
        batch = Batch([0, 16, 61, 200, 130], trees, hq=4, hkv=2, d=32, dtype=dtype, device=device, paged=True,
                      block_size=block_size)  # fmt: skip
        batch.poison_unused_cache()
        check(batch, causal=causal, what=f"blocks of {block_size} causal={causal}", num_splits=3 if causal else None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_tree_start_inside_the_prefix(backend, device, dtype):
    # the last level of each tree is queried with the earlier levels cached: the unmasked prefix ends at
    # tree_start (no multiple of the KV step or the block), the masked tail covers the cached levels
    widths = [[1, 3, 4], [1, 2], [1, 5, 9]]
    batch = Batch([70, 0, 133], [level_tree(w) for w in widths], hq=4, hkv=2, d=32, dtype=dtype, device=device,
                  paged=True, block_size=8)  # fmt: skip
    ref_out, ref_lse = batch.oracle()
    rows, counts, prefixes, offsets = [], [], [], batch.offsets.tolist()
    for b, w in enumerate(widths):
        rows += range(offsets[b] + sum(w[:-1]), offsets[b + 1])
        counts.append(w[-1])
        prefixes.append(batch.prefixes[b] + sum(w[:-1]))
    rows = torch.tensor(rows, device=device)
    for splits in (1, 2):
        out, lse = tree_attention(
            batch.q[rows], batch.k, batch.v, torch.tensor([0] + counts, dtype=torch.int32).cumsum(0).to(torch.int32)
            .to(device), torch.tensor(prefixes, dtype=torch.int32, device=device), tree_mask=batch.tree_mask[rows],
            tree_start=batch.prefix_lens, block_table=batch.block_table, return_lse=True, num_splits=splits,
        )  # fmt: skip
        assert_close(out, ref_out[rows.cpu()], *TOL[dtype], f"{splits} splits out")
        assert_close(lse, ref_lse[rows.cpu()], *TOL[dtype], f"{splits} splits lse")


@pytest.mark.parametrize("uniform", [True, False], ids=["uniform", "ragged"])
def test_uniform_queries_launch_no_idle_tiles(backend, device, uniform):
    # fp32 tiles hold 8 queries of a group of 2: 20 nodes take 3 tiles per request. Uniform queries launch
    # exactly those; ragged ones keep the searched grid with room for every request
    sizes = [20, 20, 20] if uniform else [20, 3, 9]
    batch = Batch([5, 33, 0], [random_tree(n) for n in sizes], hq=4, hkv=2, d=32, dtype=torch.float32,
                  device=device, paged=True, block_size=8)  # fmt: skip
    check(batch, what="uniform" if uniform else "ragged")
    if backend == "triton":
        with tuning.capture_launches() as launches:
            batch.run()
        tiles = launches[0].grid[0]
        assert launches[0].meta["TILES_PER_REQUEST"] == (3 if uniform else 0)
        assert tiles == (3 * 3 if uniform else sum(sizes) // 8 + 3)


HOPPER_TREE = attention_space(128, 32, False, True)
SM80_TREE = attention_space(128, 32, False, False)


@pytest.mark.parametrize(
    "config", HOPPER_TREE.configs[:1] + SM80_TREE.configs, ids=lambda c: tuning.describe(c)
)  # fmt: skip
def test_128_row_tree_tiles(config):
    # a 48-node tree x group 4 fills two 128-row tiles; Hopper's default and every sm_80 candidate (pinned:
    # the interpreter plans Hopper's tile) against the oracle, fp16 with a prefix that is no multiple of 64
    batch = Batch([75, 2], [random_tree(48), random_tree(40)], hq=8, hkv=2, d=32, dtype=torch.float16,
                  device="cuda" if torch.cuda.is_available() else "cpu", paged=True)  # fmt: skip
    with _backend.use_backend("triton"), tuning.use_config("tree_attention_kernel", config):
        tuning.clear_chosen()
        check(batch, what=tuning.describe(config))
        assert tuning.chosen_configs()["tree_attention_kernel"] == config


def test_softmax_scale(backend, device):
    batch = Batch([20], [random_tree(7)], hq=2, hkv=2, d=64, dtype=torch.float32, device=device)
    check(batch, what="scale", softmax_scale=0.3)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_strided_views(backend, device, paged):
    batch = Batch([25, 4], [random_tree(70), chain(2)], 4, 2, 64, torch.float32, device, paged=paged, block_size=8)
    # K and V interleaved per token ([B, max_len, 2, Hkv, D]) inside one layer of a stacked all-layer cache
    stacked = torch.randn(3, batch.k.shape[0], batch.k.shape[1], 2, batch.hkv, batch.d, device=device)
    stacked[1, :, :, 0], stacked[1, :, :, 1] = batch.k, batch.v
    batch.k, batch.v = stacked[1, :, :, 0], stacked[1, :, :, 1]
    wide = torch.randn(batch.q.shape[0], batch.hq * 2, batch.d, device=device)
    wide[:, 1::2] = batch.q
    batch.q = wide[:, 1::2]
    # index tensors as views too: every other column / entry of wider tensors
    for name in ("tree_mask", "block_table", "offsets", "prefix_lens"):
        t = getattr(batch, name)
        if t is not None:
            wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=device)
            wide[..., ::2] = t
            setattr(batch, name, wide[..., ::2])
    assert not batch.k.is_contiguous() and not batch.q.is_contiguous() and not batch.tree_mask.is_contiguous()
    check(batch, what="stacked views")


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_cache_slots_outside_the_contexts_are_never_read(backend, device, paged):
    # NaN everywhere outside each request's prefix + queries: the padded PyTorch path pads with the
    # request's own last position, the kernel masks its loads; either way no NaN reaches the output
    trees = [random_tree(5), [-1], chain(3), [-1]]
    batch = Batch([3, 40, 0, 17], trees, hq=4, hkv=2, d=16, dtype=torch.float32, device=device, paged=paged,
                  block_size=8)  # fmt: skip
    batch.poison_unused_cache()
    check(batch, what="NaN outside the contexts")


def test_out_and_default_allocation_agree(backend, device):
    batch = Batch([8, 3], [random_tree(5), random_tree(4)], hq=2, hkv=1, d=64, dtype=torch.float32, device=device)
    out, lse = batch.run()
    plain = tree_attention(batch.q, batch.k, batch.v, batch.offsets, batch.prefix_lens, tree_mask=batch.tree_mask)
    assert_close(out, plain, 1e-6, 1e-6, "out= and allocated")


def test_no_query_tokens(backend, device):
    kv = torch.randn(2, 8, 2, 64, device=device)
    offsets = torch.zeros(3, dtype=torch.int32, device=device)
    prefixes = torch.tensor([3, 0], dtype=torch.int32, device=device)
    out, lse = tree_attention(torch.randn(0, 4, 64, device=device), kv, kv, offsets, prefixes, causal=True,
                              return_lse=True)  # fmt: skip
    assert out.shape == (0, 4, 64) and lse.shape == (0, 4)


def test_a_row_that_sees_nothing_gets_zero_and_minus_infinity(backend, device):
    # tree_start 0 and an all-zero mask row: no visible position at all
    k = torch.randn(1, 8, 1, 16, device=device)
    q = torch.randn(2, 2, 16, device=device)
    mask = torch.tensor([[0], [3]], dtype=torch.int64, device=device)
    one = torch.tensor([0, 2], dtype=torch.int32, device=device)
    zero = torch.zeros(1, dtype=torch.int32, device=device)
    for return_lse in (True, False):
        got = tree_attention(q, k, k, one, zero, tree_mask=mask, tree_start=zero, return_lse=return_lse)
        out, lse = got if return_lse else (got, None)
        assert torch.equal(out[0], torch.zeros_like(out[0]))
        assert lse is None or (lse[0] == -math.inf).all()
        ref, _ = tree_attention_reference(q, k, k, one, zero, mask, None, 0.25, zero)
        assert_close(out[1], ref[1], 1e-5, 1e-5, "row 1")


@pytest.mark.interpreter  # the bounds checker watches the interpreter's loads
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("block_size", [4, 16], ids=lambda b: f"block{b}")
def test_unchecked_negative_starts_stay_inside_the_buffers(paged, block_size):
    # values a GPU call does not check (check_bounds=False) may give wrong numbers but no lane may address
    # outside a buffer: a negative tree_start or prefix once put the tail's first step (and the block ids
    # read one step ahead) before position 0
    q, k = torch.randn(3, 4, 32), torch.randn(8, block_size, 2, 32)
    table = torch.randperm(8)[:4].to(torch.int32)[None] if paged else None
    k = k if paged else k.reshape(1, -1, 2, 32)
    offsets = torch.tensor([0, 3], dtype=torch.int32)
    tree = dict(tree_mask=torch.full((3, 1), -1, dtype=torch.int64), tree_start=torch.tensor([-20], dtype=torch.int32))
    for prefix, kwargs in ((5, tree), (-5, dict(causal=True)), (-2, dict(causal=True))):
        for splits in (1, 2):
            with _backend.use_backend("triton"), watch_bounds():
                tree_attention(q, k, k, offsets, torch.tensor([prefix], dtype=torch.int32), block_table=table,
                               check_bounds=False, num_splits=splits, **kwargs)  # fmt: skip


# ---------------------------------------------------------------- incremental trees (tree_start)


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_tree_built_level_by_level_equals_the_whole_tree(backend, device, paged):
    # Each request's tree sits after its prefix; call k sends only level k's nodes, with the earlier
    # levels already in the cache (prefix_lens = prefix + nodes before the level, tree_start = prefix).
    widths = [[1, 3, 4, 5], [1, 2, 2], [1, 4, 9, 2]]
    trees = [level_tree(w) for w in widths]
    batch = Batch([5, 0, 21], trees, hq=4, hkv=2, d=32, dtype=torch.float32, device=device, paged=paged, block_size=8)
    whole, whole_lse = batch.run()
    ref_out, ref_lse = batch.oracle()
    assert_close(whole, ref_out, 1e-4, 1e-4, "whole tree")
    tree_start = batch.prefix_lens
    tree_offsets = batch.offsets.tolist()
    for level in range(max(len(w) for w in widths)):
        rows, counts, prefixes = [], [], []
        for b, w in enumerate(widths):
            first = sum(w[:level])
            n = w[level] if level < len(w) else 0
            rows += range(tree_offsets[b] + first, tree_offsets[b] + first + n)
            counts.append(n)
            prefixes.append(batch.prefixes[b] + first)
        rows = torch.tensor(rows, device=device)
        offsets = torch.tensor([0] + counts, dtype=torch.int32).cumsum(0).to(torch.int32).to(device)
        out, lse = tree_attention(
            batch.q[rows], batch.k, batch.v, offsets, torch.tensor(prefixes, dtype=torch.int32, device=device),
            tree_mask=batch.tree_mask[rows], tree_start=tree_start, block_table=batch.block_table, return_lse=True,
        )  # fmt: skip
        assert_close(out, whole[rows], 1e-5, 1e-5, f"level {level} against the whole tree")
        assert_close(lse, whole_lse[rows], 1e-5, 1e-5, f"level {level} lse against the whole tree")
        assert_close(out, ref_out[rows.cpu()], 1e-4, 1e-4, f"level {level} against the oracle")


def test_reference_with_tree_start_matches_the_oracle():
    # the reference's visibility rule, written from the tree_start contract, against the parent-walking oracle
    trees = [level_tree([1, 2, 3]), level_tree([1, 1, 4])]
    batch = Batch([7, 2], trees, hq=2, hkv=1, d=16, dtype=torch.float32, device="cpu", paged=True, block_size=4)
    ref_out, ref_lse = batch.oracle()
    # queries: level 2 of each tree (nodes 3.. of request 0, nodes 2.. of request 1); earlier levels are cached
    rows = torch.tensor([3, 4, 5, 6 + 2, 6 + 3, 6 + 4, 6 + 5])
    offsets = torch.tensor([0, 3, 7], dtype=torch.int32)
    prefixes = torch.tensor([7 + 3, 2 + 2], dtype=torch.int32)
    out, lse = tree_attention_reference(
        batch.q[rows], batch.k, batch.v, offsets, prefixes, batch.tree_mask[rows], batch.block_table, 16**-0.5,
        batch.prefix_lens,
    )  # fmt: skip
    assert out.dtype == torch.float64
    assert_close(out, ref_out[rows], 1e-6, 1e-6, "reference out")
    assert_close(lse, ref_lse[rows], 1e-6, 1e-6, "reference lse")


# ---------------------------------------------------------------- plans


@pytest.mark.parametrize("causal", [False, True], ids=["tree", "causal"])
def test_one_plan_serves_every_layer(backend, device, causal):
    trees = [chain(4), [-1], chain(6)] if causal else [random_tree(4), [-1], random_tree(6)]
    batch = Batch([6, 30, 0], trees, hq=4, hkv=2, d=32, dtype=torch.float32, device=device, paged=True, block_size=8)
    plan = plan_attention(
        batch.offsets, batch.prefix_lens, num_tokens=batch.q.shape[0], num_heads=4, cache_shape=batch.k.shape,
        dtype=torch.float32, tree_mask=None if causal else batch.tree_mask, causal=causal,
        block_table=batch.block_table,
    )  # fmt: skip
    assert plan.backend == backend
    for layer in range(3):  # new K/V and queries per layer, the same plan
        batch.q, batch.k, batch.v = torch.randn_like(batch.q), torch.randn_like(batch.k), torch.randn_like(batch.v)
        out, lse = torch.full_like(batch.q, math.nan), torch.full(batch.q.shape[:2], math.nan, device=device)
        assert tree_attention(batch.q, batch.k, batch.v, plan=plan, out=out, lse=lse, check=False)[0] is out
        ref_out, ref_lse = batch.oracle()
        assert_close(out, ref_out, 1e-4, 1e-4, f"layer {layer} out")
        assert_close(lse, ref_lse, 1e-4, 1e-4, f"layer {layer} lse")


@pytest.mark.interpreter  # meta tensors on the Triton path
@pytest.mark.parametrize("tree", [False, True], ids=["causal", "tree"])
@pytest.mark.parametrize("backend_name", ["torch", "triton"])
def test_a_plan_with_host_bounds_reads_no_device_value(backend_name, tree):
    # meta tensors have no values: any read (tolist, item, a data-dependent shape) would raise
    batch, tokens, width = 3, 7, 2
    meta = dict(device="meta", dtype=torch.int32)
    with _backend.use_backend(backend_name):
        plan = plan_attention(
            torch.empty(batch + 1, **meta), torch.empty(batch, **meta), num_tokens=tokens, num_heads=8,
            cache_shape=(40, 16, 2, 64), dtype=torch.float16, causal=not tree,
            tree_mask=torch.empty(tokens, width, dtype=torch.int64, device="meta") if tree else None,
            tree_start=torch.empty(batch, **meta) if tree else None, block_table=torch.empty(batch, 5, **meta),
            max_queries=4, max_context=70,
        )  # fmt: skip
    assert plan.backend == backend_name and plan.max_queries == 4 and plan.max_context == 70
    if backend_name == "torch":
        assert plan.query_rows.shape == (batch, 4) and plan.token_slots.shape == (tokens,)
        assert plan.kv_rows.shape == (batch * 70,) and plan.attn_bias.shape == (batch, 1, 4, 70)
        assert plan.attn_bias.dtype == torch.float16 and plan.tile is None
    else:
        assert plan.tile is not None and plan.query_rows is None and plan.attn_bias is None


def test_bounds_default_to_the_values_on_the_cpu_and_are_checked():
    offsets, prefixes = torch.tensor([0, 2, 7], dtype=torch.int32), torch.tensor([4, 30], dtype=torch.int32)
    common = dict(num_tokens=7, num_heads=2, cache_shape=(2, 64, 1, 8), dtype=torch.float32, causal=True)
    with _backend.use_backend("torch"):
        plan = plan_attention(offsets, prefixes, **common)
        assert (plan.max_queries, plan.max_context) == (5, 35)
        assert plan.attn_bias.shape == (2, 1, 5, 35)
        with pytest.raises(ValueError, match="max_queries=4 is below request 1's 5 queries"):
            plan_attention(offsets, prefixes, max_queries=4, **common)
        with pytest.raises(ValueError, match="max_context=34 is below request 1's context of 35 positions"):
            plan_attention(offsets, prefixes, max_context=34, **common)
        with pytest.raises(ValueError, match="max_queries must be an int >= 1, got 0"):
            plan_attention(offsets, prefixes, max_queries=0, check_bounds=False, **common)


def test_sdpa_without_enable_gqa_repeats_the_kv_heads(monkeypatch):
    monkeypatch.setattr(torch_path, "SDPA_HAS_GQA", False)
    batch = Batch([5, 12], [random_tree(6), [-1]], hq=6, hkv=2, d=32, dtype=torch.float32, device="cpu", paged=True)
    with _backend.use_backend("torch"):
        check(batch, what="repeated KV heads")


@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_registered_op_passes_opcheck(backend, device, paged, dtype):
    # the custom op behind tree_attention (torch.compile / CUDA graphs see this one); a split plan on Triton
    # (fp16: its partials in fp16)
    batch = Batch([5, 0], [random_tree(4), chain(2)], 4, 2, 64, dtype, device, paged=paged)
    plan = plan_attention(
        batch.offsets, batch.prefix_lens, num_tokens=6, num_heads=4, cache_shape=batch.k.shape, dtype=dtype,
        tree_mask=batch.tree_mask, block_table=batch.block_table, softmax_scale=0.2, num_splits=2,
    )  # fmt: skip
    out = torch.full_like(batch.q, math.nan)
    lse = torch.full(batch.q.shape[:2], math.nan, device=device)
    args = (batch.q, batch.k, batch.v, *plan.op_args(), out, lse)
    torch.library.opcheck(torch.ops.specdec.tree_attention.default, args)  # works on copies of args
    torch.ops.specdec.tree_attention(*args)
    ref_out, ref_lse = batch.oracle(0.2)
    assert_close(out, ref_out, *TOL[dtype], "op out")
    assert_close(lse, ref_lse, *TOL[dtype], "op lse")


# ---------------------------------------------------------------- launches (bench/compile_matrix.py compiles them)


@pytest.mark.skipif(not _backend.triton_status()[0], reason="triton is not installed")
@pytest.mark.parametrize("splits", [1, 3])
def test_launches_follow_the_plan(splits):
    # what the launcher plans (captured, nothing runs): the main kernel with the plan's tile, then the merge
    # of the split contexts; the grid covers every query tile of every request
    q = torch.empty(64 * 3, 32, 128, dtype=torch.float16)
    cache = torch.empty(64, 16, 8, 128, dtype=torch.float16)
    offsets = torch.arange(0, 64 * 3 + 1, 64, dtype=torch.int32)
    prefix = torch.zeros(3, dtype=torch.int32)
    tile = tile_config(64 * 3, 3, 4, 128, splits)
    part_out = torch.empty(splits, 64 * 3, 32, 128, dtype=torch.float16) if splits > 1 else None
    part_lse = torch.empty(splits, 64 * 3, 32) if splits > 1 else None
    planned = triton_launches(q, cache, cache, offsets, prefix, prefix, torch.zeros(64 * 3, 1, dtype=torch.int64),
                              torch.zeros(3, 8, dtype=torch.int32), part_out, part_lse, 0.1, tile, torch.empty_like(q),
                              torch.empty(64 * 3, 32) if splits > 1 else None)  # fmt: skip
    assert [p[0].__name__ for p in planned] == ["tree_attention_kernel"] + ["merge_splits_kernel"] * (splits > 1)
    kernel, grid, _args, meta, config, space = planned[0]
    assert (tile.block_m, tile.block_q, tile.block_n) == (128, 32, 64)  # a 64-node tree x 4 heads: two tiles
    assert grid == (3 * 64 // tile.block_q + 3, 8, splits)  # ragged (not told uniform): room for every request
    assert meta["BLOCK_M"] == 128 and meta["TREE"] and meta["PAGED"] and meta["TILES_PER_REQUEST"] == 0
    assert config == {"BLOCK_N": 64, "num_warps": 8, "num_stages": 3}
    assert config in space.configs  # the default is one of the tuning candidates
    uniform = tile_config(64 * 3, 3, 4, 128, splits, uniform=True)
    assert uniform.tiles_per_request == 2
    planned = triton_launches(q, cache, cache, offsets, prefix, prefix, torch.zeros(64 * 3, 1, dtype=torch.int64),
                              torch.zeros(3, 8, dtype=torch.int32), part_out, part_lse, 0.1, uniform,
                              torch.empty_like(q), torch.empty(64 * 3, 32) if splits > 1 else None)  # fmt: skip
    assert planned[0][1] == (3 * 2, 8, splits) and planned[0][3]["TILES_PER_REQUEST"] == 2  # no idle tiles


def test_tile_choice_by_architecture_and_dtype():
    # trees over 128 rows per request: 128-row tiles, 64-wide KV steps on Hopper, 16-wide on sm_80 (wider
    # ones spill there); fp32 tiles hold one query token's group (16 rows), as wider fp32 tiles spill; the default is
    # always the first candidate of its architecture's tuning space
    assert tile_config(64 * 3, 3, 4, 128, 1)[:5] == (128, 32, 64, 128, 8)
    assert tile_config(64 * 3, 3, 4, 128, 1, hopper=False)[:4] == (128, 32, 16, 128)
    assert tile_config(64 * 3, 3, 4, 128, 1, fp32=True)[:5] == (16, 4, 16, 128, 8)
    shapes = [(8, 8, 4, 128, False, True), (4096, 1, 8, 128, False, False), (64, 1, 8, 256, False, True),
              (1, 1, 4, 64, True, True), (256, 4, 4, 128, False, True), (256, 4, 4, 128, False, False)]  # fmt: skip
    for tokens, batch, group, d, fp32, hopper in shapes:
        tile = tile_config(tokens, batch, group, d, 1, fp32=fp32, hopper=hopper)
        space = attention_space(tile.block_m, tile.block_d, fp32, hopper)
        assert space.configs[0] == {"BLOCK_N": tile.block_n, "num_warps": tile.num_warps, "num_stages": tile.num_stages}
    assert attention_space(128, 128, False, True) != attention_space(128, 128, False, False)


def fake_gpu(monkeypatch, sms=132, shared=233472):
    """torch.cuda.get_device_properties answering for a GPU that is not here (an H200-like one by default)."""
    props = SimpleNamespace(multi_processor_count=sms, max_threads_per_multi_processor=2048,
                            regs_per_multiprocessor=65536, shared_memory_per_multiprocessor=shared)  # fmt: skip
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    return props


def test_split_counts_fill_whole_waves(monkeypatch):
    props = fake_gpu(monkeypatch)
    cuda = torch.device("cuda")
    decode = tile_config(8, 8, 4, 128, 1, uniform=True)  # 16 rows, 64-wide steps, 4 warps, 3 stages
    assert ctas_per_sm(decode, props, 2) == 3  # 3 x 70 KB of shared memory, 3 x 128 threads x 168 registers
    slots = 132 * 3
    # batch 8 x 8 KV heads = 64 programs: 6 splits fill one wave of 396 (384 programs)
    assert default_splits(cuda, 8, 8, 8, decode, 16384) == slots // 64 == 6
    # (more splits in whole extra waves, e.g. 37 in 6 waves, are under 10% faster: not worth the merge)
    # batch 1: 8 programs; 49 splits fill one wave (392 of 396); the fewest within 10% of that: 45
    assert default_splits(cuda, 1, 1, 8, decode, 16384) == 45
    # the minimum work per split: 1000 positions hold 3 splits of 4 x 64
    assert default_splits(cuda, 1, 1, 8, decode, 1000) == 3
    # a full GPU is not split; nor is anything off the GPU
    assert default_splits(cuda, 64, 64, 8, tile_config(64, 64, 4, 128, 1, uniform=True), 16384) == 1
    assert default_splits(torch.device("cpu"), 8, 8, 8, decode, 16384) == 1
    # working tiles only: uniform 64-node trees at batch 8 are 16 tiles, a ragged plan counts the grid's 24
    tree = tile_config(512, 8, 4, 128, 1, uniform=True)
    ragged = tree._replace(tiles_per_request=0)
    assert ctas_per_sm(tree, props, 2) == 1  # 8 warps at up to 255 registers
    assert default_splits(cuda, 512, 8, 8, tree, 4096) == 132 // (16 * 8) == 1
    assert default_splits(cuda, 512, 4, 2, tree, 4096) == 132 // (8 * 2)
    assert default_splits(cuda, 512, 4, 2, ragged, 4096) == 132 // (20 * 2)
    # a smaller SM count (sm_80-like shared memory: 2 decode programs per SM)
    props = fake_gpu(monkeypatch, sms=108, shared=167936)
    assert ctas_per_sm(decode, props, 2) == 2
    # 3 splits fill 192 of 216 slots in one wave; 10 fill three waves to 640 of 648, more than 10% sooner
    assert default_splits(cuda, 8, 8, 8, decode, 16384) == 10


# ---------------------------------------------------------------- GPU only (compiled Triton, bf16, big caches)


@pytest.mark.gpu
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_bf16(backend, device, paged):
    # bf16 tl.dot is wrong in Triton 3.9's interpreter, so bf16 is checked on a GPU only
    batch = Batch([40, 0, 77], [random_tree(17), [-1], chain(8)], 8, 2, 128, torch.bfloat16, device, paged=paged)
    check(batch, what="bf16")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_llama_shapes(backend, device, dtype):
    # Llama-3-8B heads, long ragged contexts, 64-node trees next to decode and a chain; default splits
    trees = [random_tree(64), [-1], chain(8), random_tree(64)]
    batch = Batch([4000, 1000, 0, 2500], trees, hq=32, hkv=8, d=128, dtype=dtype, device=device, paged=True)
    check(batch, what=f"llama {dtype}")


@pytest.mark.gpu
def test_decode_long_context_default_splits(backend, device):
    batch = Batch([16000], [[-1]], hq=32, hkv=8, d=128, dtype=torch.float16, device=device, paged=True, block_size=64)
    check(batch, what="batch-1 decode at 16k")


@pytest.mark.gpu
def test_long_prefill_chunks(backend, device):
    # thousands of tokens causally from the flag, next to a chunk with no prefix; a dense float64
    # causal attention per request is the oracle (a node-by-node walk would take minutes here)
    prefixes, sizes = [1000, 0], [3000, 1200]
    batch = Batch(prefixes, [chain(n) for n in sizes], 32, 8, 128, torch.float16, device, paged=True)
    out, lse = batch.run(causal=True)
    for b, (p, n) in enumerate(zip(prefixes, sizes)):
        k, v = (t.double().repeat_interleave(4, dim=1) for t in batch.kv_at(b, list(range(p + n))))
        rows = slice(int(batch.offsets[b]), int(batch.offsets[b]) + n)
        q = batch.q[rows].double()
        s = torch.einsum("nhd,lhd->hnl", q, k) / math.sqrt(128)
        s.masked_fill_(torch.arange(p + n, device=device) > p + torch.arange(n, device=device)[:, None], -math.inf)
        ref_lse = torch.logsumexp(s, -1).T
        ref = torch.einsum("hnl,lhd->nhd", torch.softmax(s, -1), v)
        assert_close(out[rows], ref, *TOL[torch.float16], f"prefill {b} out")
        assert_close(lse[rows], ref_lse, *TOL[torch.float16], f"prefill {b} lse")


@pytest.mark.gpu
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
def test_offsets_past_2_31_elements(backend, device, paged):
    # the requests' K/V sit more than 2^31 elements into caches of ~2.3G elements: int32 offsets would wrap
    batch = Batch([50, 9], [random_tree(12), chain(5)], 16, 8, 128, torch.float16, device, paged=paged)
    if paged:
        big_blocks = (1 << 31) // (batch.block_size * 8 * 128) + 8192
        shift = big_blocks - batch.k.shape[0]
        batch.block_table = batch.block_table + shift
        big_shape = (big_blocks, *batch.k.shape[1:])
        rows = slice(shift, None)
    else:
        big_len = (1 << 31) // (8 * 128) + 4096  # row 1 starts past 2^31 elements
        big_shape = (2, big_len, 8, 128)
        rows = (slice(None), slice(0, batch.k.shape[1]))
    for name in ("k", "v"):
        big = torch.empty(big_shape, dtype=torch.float16, device=device)
        big[rows] = getattr(batch, name)
        setattr(batch, name, big)
    check(batch, what="2^31 offsets")
    del batch
    torch.cuda.empty_cache()


# ---------------------------------------------------------------- bad input


def small(**over):
    args = dict(
        q=torch.randn(3, 4, 64),
        k_cache=torch.randn(2, 16, 2, 64),
        v_cache=torch.randn(2, 16, 2, 64),
        q_offsets=torch.tensor([0, 2, 3], dtype=torch.int32),
        prefix_lens=torch.tensor([4, 0], dtype=torch.int32),
        tree_mask=torch.tensor([[1], [3], [1]], dtype=torch.int64),
    )
    args.update(over)
    pos = [args.pop(n) for n in ("q", "k_cache", "v_cache", "q_offsets", "prefix_lens")]
    return tree_attention(*pos, **args)


@pytest.mark.parametrize(
    "over,exc,match",
    [
        (dict(q=torch.randn(3, 3, 64)), ValueError, "q has 3 heads, not a multiple"),
        (dict(q=torch.randn(3, 4, 72)), ValueError, "k_cache head dim"),
        (dict(q=torch.randn(3, 4, 64, dtype=torch.float16)), TypeError, "k_cache must have dtype float16"),
        (dict(v_cache=torch.randn(2, 16, 2, 64, dtype=torch.float16)), TypeError, "v_cache must have dtype"),
        (dict(q=torch.randn(3, 4, 64).long()), TypeError, "q must have dtype"),
        (dict(v_cache=torch.randn(2, 15, 2, 64)), ValueError, "v_cache must have shape"),
        (dict(q_offsets=torch.tensor([0, 2, 3])), TypeError, "q_offsets must have dtype int32"),
        (dict(q_offsets=[0, 2, 3]), TypeError, "q_offsets must be a torch.Tensor, got list"),
        (dict(prefix_lens=[4, 0]), TypeError, "prefix_lens must be a torch.Tensor, got list"),
        (dict(q_offsets=torch.tensor([0, 3, 2], dtype=torch.int32)), ValueError, "q_offsets must be non-decreasing"),
        (dict(q_offsets=torch.tensor([0, 1, 2], dtype=torch.int32)), ValueError, r"q_offsets\[-1\] must equal"),
        (dict(prefix_lens=torch.tensor([4], dtype=torch.int32)), ValueError, "prefix_lens must have shape"),
        (dict(prefix_lens=torch.tensor([4, -1], dtype=torch.int32)), ValueError, r"prefix_lens\[1\] must be >= 0"),
        (dict(prefix_lens=torch.tensor([15, 0], dtype=torch.int32)), ValueError, "k_cache holds max_len=16"),
        (dict(tree_mask=None), ValueError, "exactly one of tree_mask"),
        (dict(causal=True), ValueError, "exactly one of tree_mask"),
        (dict(tree_mask=torch.ones(3, 1, dtype=torch.int32)), TypeError, "tree_mask must have dtype int64"),
        (dict(tree_mask=torch.ones(2, 1, dtype=torch.int64)), ValueError, "tree_mask must have shape"),
        (dict(k_cache=torch.randn(1, 16, 2, 64), v_cache=torch.randn(1, 16, 2, 64)), ValueError, "k_cache has 1 rows"),
        (dict(k_cache=torch.randn(2, 16, 2, 128)[..., ::2]), ValueError, "k_cache must be contiguous in its last"),
        (dict(out=torch.empty(3, 4, 64, dtype=torch.float16)), TypeError, "out must have dtype float32"),
        (dict(out=torch.empty(3, 4, 32)), ValueError, "out must have shape"),
        (dict(softmax_scale=-1.0), ValueError, "softmax_scale must be a positive"),
        (dict(num_splits=0), ValueError, "num_splits must be a positive int"),
        (dict(tree_start=torch.tensor([4, 1], dtype=torch.int32)), ValueError, r"tree_start\[1\] = 1 must lie in"),
        (dict(tree_start=torch.tensor([-1, 0], dtype=torch.int32)), ValueError, r"tree_start\[0\] = -1 must lie in"),
        (dict(tree_start=torch.tensor([0, 0])), TypeError, "tree_start must have dtype int32"),
        (dict(tree_start=torch.tensor([0], dtype=torch.int32)), ValueError, "tree_start must have shape"),
        (
            dict(tree_start=torch.tensor([0, 0], dtype=torch.int32), tree_mask=None, causal=True),
            ValueError,
            "tree_start applies to tree masks only",
        ),
    ],
)
def test_bad_input(over, exc, match):
    with pytest.raises(exc, match=match):
        small(**over)


@pytest.mark.parametrize("check_bounds", [None, False])
def test_mask_too_short_for_tree(check_bounds):
    # one request: the tree size is Tq, known from shapes, so the check needs no values
    q, kv = torch.randn(70, 2, 64), torch.randn(1, 80, 1, 64)
    with pytest.raises(ValueError, match="tree_mask has 1 words per row .* too short for request 0's tree of 70"):
        tree_attention(
            q, kv, kv, torch.tensor([0, 70], dtype=torch.int32), torch.tensor([0], dtype=torch.int32),
            tree_mask=torch.ones(70, 1, dtype=torch.int64), check_bounds=check_bounds,
        )  # fmt: skip
    # several requests: found from the offsets' values
    kv = torch.randn(2, 80, 1, 64)
    with pytest.raises(ValueError, match="too short for request 1's tree of 66 nodes"):
        tree_attention(
            q, kv, kv, torch.tensor([0, 4, 70], dtype=torch.int32), torch.tensor([0, 0], dtype=torch.int32),
            tree_mask=torch.ones(70, 1, dtype=torch.int64),
        )  # fmt: skip


def test_block_table_errors():
    paged = dict(k_cache=torch.randn(6, 4, 2, 64), v_cache=torch.randn(6, 4, 2, 64))
    with pytest.raises(ValueError, match="block_table is too small: request 0 needs 2 blocks"):
        small(**paged, block_table=torch.tensor([[0], [1]], dtype=torch.int32))
    with pytest.raises(ValueError, match="block_table row 1 holds block ids outside"):
        small(**paged, block_table=torch.tensor([[0, 1], [6, 2]], dtype=torch.int32))
    with pytest.raises(ValueError, match="block_table must have 2 rows"):
        small(**paged, block_table=torch.tensor([[0, 1]], dtype=torch.int32))
    with pytest.raises(TypeError, match="block_table must have dtype int32"):
        small(**paged, block_table=torch.tensor([[0, 1], [2, 3]]))


def test_device_mix():
    # a meta tensor stands in for a second device on machines without one
    with pytest.raises(ValueError, match="k_cache is on cpu but q is on meta"):
        small(q=torch.randn(3, 4, 64, device="meta"))
    with pytest.raises(ValueError, match="tree_mask is on meta but q is on cpu"):
        small(tree_mask=torch.ones(3, 1, dtype=torch.int64, device="meta"))


def test_mask_too_short_for_a_tree_that_starts_in_the_cache():
    # 60 queries after 10 cached tree nodes need 70 mask bits: one word is too short
    q, kv = torch.randn(60, 2, 16), torch.randn(1, 80, 1, 16)
    args = (q, kv, kv, torch.tensor([0, 60], dtype=torch.int32), torch.tensor([15], dtype=torch.int32))
    mask = torch.ones(60, 1, dtype=torch.int64)
    with pytest.raises(ValueError, match="too short for request 0's tree of 70 nodes"):
        tree_attention(*args, tree_mask=mask, tree_start=torch.tensor([5], dtype=torch.int32))
    tree_attention(*args, tree_mask=mask, tree_start=torch.tensor([11], dtype=torch.int32))  # 64 bits: enough


def test_head_dims_past_the_triton_tile_are_for_the_torch_path_only():
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the Triton path: compiled on a GPU, interpreted elsewhere
    q, kv = torch.randn(2, 2, 272, device=device), torch.randn(1, 8, 1, 272, device=device)
    offsets, prefixes = torch.tensor([0, 2], dtype=torch.int32), torch.tensor([3], dtype=torch.int32)
    args = (q, kv, kv, offsets.to(device), prefixes.to(device))
    with _backend.use_backend("triton"), pytest.raises(ValueError, match="head dim 272 is above the Triton"):
        tree_attention(*args, causal=True)
    with _backend.use_backend("torch"):
        out = tree_attention(*args, causal=True)
    ref, _ = tree_attention_reference(q, kv, kv, args[3], args[4], None, None, 272**-0.5)
    assert_close(out, ref, 1e-5, 1e-5, "head dim 272")


def test_docstring_examples():
    import doctest
    import importlib

    for name in ("specdec.kernels.tree_attention", "specdec.kernels.attention_plan"):
        module = importlib.import_module(name)  # (the package re-exports tree_attention under the module's name)
        result = doctest.testmod(module, extraglobs={"torch": torch})
        assert result.attempted > 0 and result.failed == 0, name


def graph_ops(fn, *args):
    """Run ``fn`` under torch.compile(fullgraph=True) (no graph break allowed); returns its result and the
    custom ops the traced graph calls."""
    seen = []

    def backend(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    result = torch.compile(fn, backend=backend, fullgraph=True)(*args)
    return result, [name for name in seen if name.startswith("specdec.")]


def test_unchecked_attention_compiles_to_the_registered_op(backend, device):
    batch = Batch([4, 7], [chain(2), [-1]], hq=4, hkv=2, d=16, dtype=torch.float32, device=device)
    plan = plan_attention(
        batch.offsets, batch.prefix_lens, num_tokens=3, num_heads=4, cache_shape=batch.k.shape, dtype=torch.float32,
        causal=True,
    )  # fmt: skip
    out, ops = graph_ops(lambda q, k, v, o: tree_attention(q, k, v, plan=plan, out=o, check=False), batch.q, batch.k,
                         batch.v, torch.full_like(batch.q, math.nan))  # fmt: skip
    assert ops == ["specdec.tree_attention.default"]
    assert_close(out, batch.oracle()[0], 1e-4, 1e-4, "compiled")
