"""The model forward planned once and run many layers: plan/run split, what the plan reads, incremental
trees (``tree_start``), torch.compile of the planned forward, and the hot path's helpers against their oracles."""

import pytest
import torch
from helpers import i32, random_model, rel_err, tiny_config

from specdec import use_backend
from specdec.decoding import DraftModelStrategy, NgramStrategy, SpeculativeDecoder
from specdec.decoding.autoregressive import generate
from specdec.kernels import build_tree_metadata, plan_attention, tree_attention
from specdec.kernels.kv_append import append_rows, kv_append_reference
from specdec.kernels.kv_compact import compact_rows, kv_compact_reference
from specdec.kernels.tree_attention import tree_attention_reference
from specdec.kernels.verify_greedy import (
    verify_chain_greedy,
    verify_chain_greedy_reference,
    verify_tree_greedy,
    verify_tree_greedy_reference,
)
from specdec.model import AttentionMetadata, LlamaModel, causal_positions, tree_positions
from specdec.model.kv_cache import KVCache

pytestmark = pytest.mark.interpreter  # CPU tensors (models, batches) on the Triton path

CONFIG = tiny_config(vocab_size=80, num_layers=2, num_heads=4, num_kv_heads=2)


@pytest.fixture(scope="module")
def model():
    return random_model(CONFIG, seed=0)


def prefill(model, cache, prompts):
    counts = [len(p) for p in prompts]
    q_offsets = torch.tensor([0, *counts], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    cache.reserve(counts)
    tokens = torch.cat(prompts)
    model(tokens, causal_positions(q_offsets, cache.seq_lens, len(tokens)), AttentionMetadata(q_offsets), cache)
    cache.advance(counts)


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_plan_then_run_equals_forward(model, backend, layout):
    caches = [model.new_cache(2, 24, layout=layout, block_size=4) for _ in range(2)]
    prompts = [torch.randint(0, 80, (n,)) for n in (5, 3)]
    for cache in caches:
        prefill(model, cache, prompts)
    meta = build_tree_metadata(i32(-1, 0, 0, 1, -1, 0), i32(0, 4, 6))
    tokens = torch.randint(0, 80, (6,))
    outputs = []
    for cache, planned in zip(caches, (False, True)):
        cache.reserve([4, 2])
        positions = tree_positions(meta_offsets := i32(0, 4, 6), cache.seq_lens, meta.depth)
        metadata = AttentionMetadata(meta_offsets, meta.ancestor_mask)
        if planned:
            plan = model.plan(tokens, positions, metadata, cache)
            assert plan.backend == backend and plan.attention.max_queries == 4
            assert plan.attention.max_context == 9  # host bounds: 5 cached + 4 nodes
            outputs.append(model.run(tokens, plan))
        else:
            outputs.append(model(tokens, positions, metadata, cache))
    for a, b in zip(*outputs):
        assert torch.equal(a, b)
    assert torch.equal(caches[0].data, caches[1].data)


@pytest.mark.parametrize("backend_name", ["torch", "triton"])
def test_a_reserved_forward_plans_without_reading_a_device_value(backend_name):
    # meta tensors hold no values: a read (tolist, item, a data-dependent shape) would raise
    with torch.device("meta"):
        model = LlamaModel(CONFIG).requires_grad_(False)
    cache = KVCache(2, 3, 2, 16, max_len=40, dtype=torch.float32, device="meta", layout="paged", block_size=4)
    cache.reserve([2, 0, 3])
    tokens = torch.empty(5, dtype=torch.int64, device="meta")
    offsets = torch.empty(4, dtype=torch.int32, device="meta")
    metadata = AttentionMetadata(offsets, torch.empty(5, 1, dtype=torch.int64, device="meta"))
    with use_backend(backend_name):
        plan = model.plan(tokens, torch.empty(5, dtype=torch.int64, device="meta"), metadata, cache)
    assert plan.backend == backend_name and plan.num_tokens == 5
    assert (plan.attention.max_queries, plan.attention.max_context) == (3, 3)
    assert (plan.kv_rows is None) == (backend_name == "triton")


def test_forward_refuses_a_cache_of_another_shape(model):
    other = KVCache(2, 1, 1, 16, max_len=8, dtype=torch.float32, device="cpu")  # 1 KV head, the model has 2
    other.reserve([1])
    with pytest.raises(ValueError, match=r"cache has \(layers, kv heads, head dim, dtype, device\)"):
        model(torch.tensor([1]), torch.tensor([0]), AttentionMetadata(i32(0, 1)), other)
    with pytest.raises(TypeError, match="cache must be a KVCache"):
        model(torch.tensor([1]), torch.tensor([0]), AttentionMetadata(i32(0, 1)), object())


def test_a_tree_drafted_level_by_level_with_tree_start_equals_the_whole_tree(model, backend):
    """EAGLE/Medusa-style drafting: each level's forward attends to the earlier levels already in the cache."""
    parents = [-1, 0, 0, 1, 2, 2]  # levels: [0], [1, 2], [3, 4, 5]
    levels = [[0], [1, 2], [3, 4, 5]]
    tokens = torch.randint(0, 80, (6,))
    prompts = [torch.randint(0, 80, (7,))]
    whole, steps = (model.new_cache(1, 32) for _ in range(2))
    for cache in (whole, steps):
        prefill(model, cache, prompts)
    meta = build_tree_metadata(torch.tensor(parents, dtype=torch.int32), i32(0, 6))
    whole.reserve([6])
    positions = tree_positions(i32(0, 6), whole.seq_lens, meta.depth)
    expected, _ = model(tokens, positions, AttentionMetadata(i32(0, 6), meta.ancestor_mask), whole)

    start = steps.seq_lens.clone()  # where the tree begins: its earlier levels are committed as they go
    for nodes in levels:
        steps.reserve([len(nodes)])
        rows = torch.tensor(nodes)
        metadata = AttentionMetadata(i32(0, len(nodes)), meta.ancestor_mask[rows], tree_start=start)
        logits, _ = model(tokens[rows], start.long() + meta.depth[rows].long(), metadata, steps)
        steps.advance([len(nodes)])
        err = rel_err(logits, expected[rows])
        assert err <= 1e-5, f"level {nodes}: relative error {err:.2e}"
    with pytest.raises(ValueError, match="tree_start applies to tree masks only"):
        AttentionMetadata(i32(0, 1), tree_start=start)


def test_the_forward_compiles_fullgraph(model):
    cache, eager_cache = model.new_cache(2, 24), model.new_cache(2, 24)
    prompts = [torch.randint(0, 80, (n,)) for n in (5, 3)]
    run = torch.compile(model.run, fullgraph=True, dynamic=True, backend="aot_eager")
    with use_backend("torch"):
        for c in (cache, eager_cache):
            prefill(model, c, prompts)
        meta = build_tree_metadata(i32(-1, 0, 0, -1, 0), i32(0, 3, 5))
        tokens = torch.randint(0, 80, (5,))
        results = []
        for c, fn in ((eager_cache, model.run), (cache, run)):
            c.reserve([3, 2])
            positions = tree_positions(i32(0, 3, 5), c.seq_lens, meta.depth)
            plan = model.plan(tokens, positions, AttentionMetadata(i32(0, 3, 5), meta.ancestor_mask), c)
            results.append(fn(tokens, plan))
    for a, b in zip(*results):
        assert torch.equal(a, b)
    assert torch.equal(cache.data, eager_cache.data)


@pytest.mark.parametrize("make", [lambda d: NgramStrategy(3), lambda d: DraftModelStrategy(d, (1, 1, 1))])
def test_a_compiled_decoder_gives_the_eager_greedy_tokens(make):
    target, draft = random_model(CONFIG, seed=1), random_model(tiny_config(vocab_size=80, num_layers=1), seed=2)
    prompts = [[3, 9, 4, 3, 9, 4], [7, 1]]
    with use_backend("torch"):
        expected = generate(target, prompts, max_new_tokens=12, eos_token_id=None)
        for m in (target, draft):
            m.compile_run(backend="aot_eager")  # the decoder's compile=True keeps an existing compilation
        decoder = SpeculativeDecoder(target, make(draft), compile=True)
        assert decoder.generate(prompts, max_new_tokens=12, eos_token_id=None).tokens == expected


# ---------------------------------------------------------------- the hot path's helpers against their oracles


@pytest.mark.parametrize("uniform", [False, True])
@pytest.mark.parametrize("tree", [False, True])
def test_attention_plan_without_gathers_equals_the_reference(uniform, tree):
    batch, n, heads, kv_heads, dim = 3, 4, 4, 2, 16
    counts = [n] * batch if uniform else [4, 1, 3]
    offsets = torch.tensor([0, *counts]).cumsum(0).to(torch.int32)
    prefixes = i32(5, 0, 9)
    k_cache, v_cache = torch.randn(batch + 1, 20, kv_heads, dim), torch.randn(batch + 1, 20, kv_heads, dim)
    k_cache[:, 17:] = 1e4  # stale but finite positions past every context: the mask must hide them
    q = torch.randn(sum(counts), heads, dim)
    if tree:
        parents = [p for c in counts for p in [-1, *range(c - 1)][:c]]
        mask = build_tree_metadata(torch.tensor(parents, dtype=torch.int32), offsets).ancestor_mask
    else:
        mask = None
    expected, _ = tree_attention_reference(q, k_cache, v_cache, offsets, prefixes, mask, None, dim**-0.5)
    with use_backend("torch"):
        plan = plan_attention(
            offsets, prefixes, num_tokens=q.shape[0], num_heads=heads, cache_shape=k_cache.shape, dtype=q.dtype,
            tree_mask=mask, causal=mask is None, max_queries=n, max_context=16, check_bounds=False,
            uniform_queries=uniform, finite_cache=True,
        )  # fmt: skip
    assert plan.kv_rows is None and (plan.query_rows is None) == uniform
    out = tree_attention(q, k_cache, v_cache, plan=plan, out=torch.full_like(q, float("nan")), check=False)
    assert (out.double() - expected).abs().max() < 1e-5
    with pytest.raises(ValueError, match=r"uniform_queries was given but the requests have \[4, 1, 3\] queries"):
        plan_attention(i32(0, 4, 5, 8), prefixes, num_tokens=8, num_heads=heads, cache_shape=k_cache.shape,
                       dtype=q.dtype, causal=True, uniform_queries=True)  # fmt: skip


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("counts", [[2, 0, 3], [2, 2, 2]])
def test_append_rows_are_the_positions_kv_append_writes(paged, counts):
    offsets = torch.tensor([0, *counts]).cumsum(0).to(torch.int32)
    seq_lens = i32(5, 9, 2)
    data = torch.zeros(2, 2, 12 if paged else 3, 4 if paged else 16, 2, 3)
    tables = torch.randperm(12).view(3, 4).to(torch.int32) if paged else None
    k, v = torch.randn(sum(counts), 2, 3), torch.randn(sum(counts), 2, 3)
    expected = data.clone()
    kv_append_reference(expected, 1, k, v, seq_lens, offsets, tables)
    uniform = counts[0] if len(set(counts)) == 1 else None
    rows = append_rows(data, seq_lens, offsets, tables, sum(counts), uniform)
    data[1, 0].view(-1, 2, 3).index_copy_(0, rows, k)
    data[1, 1].view(-1, 2, 3).index_copy_(0, rows, v)
    assert torch.equal(data, expected)


@pytest.mark.parametrize("paged", [False, True])
def test_compact_rows_move_what_the_reference_moves(paged):
    data = torch.randn(2, 2, 12 if paged else 3, 4 if paged else 16, 1, 2)
    tables = torch.randperm(12).view(3, 4).to(torch.int32) if paged else None
    paths = i32(0, 2, 3, 5, 0, -1, -1, -1, -1, -1, -1, -1).view(3, 4)  # a tree, a root alone, no path
    seq_lens = i32(3, 7, 16 if not paged else 16)
    expected, expected_lens = data.clone(), seq_lens.clone()
    kv_compact_reference(expected, expected_lens, paths, tables)
    compact_rows(data, seq_lens, paths, tables)
    assert torch.equal(data, expected) and torch.equal(seq_lens, expected_lens)


def test_greedy_tree_body_equals_the_reference_on_random_trees():
    gen = torch.Generator().manual_seed(5)
    for trial in range(40):
        sizes = torch.randint(1, 9, (torch.randint(1, 5, (1,), generator=gen).item(),), generator=gen).tolist()
        pick = lambda i: int(torch.randint(0, i, (1,), generator=gen))  # noqa: E731 (a parent before node i)
        parents = [p for n in sizes for p in [-1, *(pick(i) for i in range(1, n))]]
        offsets = torch.tensor([0, *sizes]).cumsum(0).to(torch.int32)
        logits = torch.randint(0, 4, (sum(sizes), 6), generator=gen).float()  # ties: the first maximum wins
        tokens = torch.where(
            torch.rand(sum(sizes), generator=gen) < 0.7, logits.argmax(-1), torch.randint(-1, 7, (sum(sizes),))
        ).to(torch.int32)
        if trial % 7 == 0:
            logits[int(torch.randint(0, sum(sizes), (1,), generator=gen)), 2] = float("nan")
        parents_t = torch.tensor(parents, dtype=torch.int32)
        for depth in (0, 2, 8):
            expected = verify_tree_greedy_reference(logits, tokens, parents_t, offsets, max_depth=depth)
            got = verify_tree_greedy(logits, tokens, parents_t, offsets, None, max_depth=depth, check=False)
            for name, a, b in zip(type(got)._fields, got, expected):
                assert torch.equal(a, b), f"trial {trial}, depth {depth}: {name}\n{a}\n{b}"


def test_greedy_chain_body_equals_the_reference_on_random_chains():
    gen = torch.Generator().manual_seed(6)
    for trial in range(40):
        ks = torch.randint(0, 6, (int(torch.randint(1, 5, (1,), generator=gen)),), generator=gen).tolist()
        offsets = torch.tensor([0, *ks]).cumsum(0).to(torch.int32)
        logits = torch.randint(0, 4, (sum(ks) + len(ks), 6), generator=gen).float()  # ties: the first maximum wins
        rows = torch.tensor([start + b + i for b, (start, k) in enumerate(zip(offsets.tolist(), ks)) for i in range(k)])
        best = logits.argmax(-1)[rows] if len(rows) else torch.zeros(0, dtype=torch.long)
        drafts = torch.where(torch.rand(len(rows), generator=gen) < 0.75, best, torch.randint(-1, 7, (len(rows),)))
        if trial % 6 == 0:
            logits[int(torch.randint(0, logits.shape[0], (1,), generator=gen)), 1] = float("inf")
        drafts = drafts.to(torch.int32)
        for width in (0, 2, 5):
            expected = verify_chain_greedy_reference(logits, drafts, offsets, max_draft_len=width)
            got = verify_chain_greedy(logits, drafts, offsets, None, max_draft_len=width, check=False)
            for name, a, b in zip(type(got)._fields, got, expected):
                assert torch.equal(a, b), f"trial {trial}, width {width}: {name}\n{a}\n{b}"
