"""CUDA-graph replay of the planned forward: bit-for-bit equal to eager, bucketed, one replay per forward.

The replay tests need a GPU (gpu-marked); on the CPU only the refusals run.
"""

import pytest
import torch
from helpers import i32, noisy_copy, random_model, tiny_config

from specdec.decoding import DraftModelStrategy, NgramStrategy, SpeculativeDecoder
from specdec.kernels import build_tree_metadata
from specdec.model import AttentionMetadata, LlamaModel, causal_positions, tree_positions
from specdec.model.cuda_graphs import CudaGraphs
from specdec.model.forward_plan import build_plan

CONFIG = tiny_config(vocab_size=80, num_heads=4, num_kv_heads=2)


def test_graphs_are_refused_off_cuda():
    model = random_model(CONFIG, seed=0)
    with pytest.raises(ValueError, match="CUDA graphs need the model on a CUDA device"):
        model.use_cuda_graphs()
    with pytest.raises(ValueError, match="CUDA graphs need the model on a CUDA device"):
        SpeculativeDecoder(model, graphs=True)
    cache = model.new_cache(1, 8)
    assert CudaGraphs(model).forward(torch.tensor([1]), torch.tensor([0]), AttentionMetadata(i32(0, 1)), cache) is None
    with pytest.raises(ValueError, match="buckets must be positive ints"):
        CudaGraphs(model, buckets=(0, 4))


def prefilled(model, batch, prompt_len):
    cache = model.new_cache(batch, 64, layout="paged", block_size=8)
    counts = [prompt_len - b for b in range(batch)]
    q_offsets = torch.tensor([0, *counts], dtype=torch.int32).cumsum(0, dtype=torch.int32).cuda()
    tokens = torch.randint(0, 80, (sum(counts),), device="cuda")
    cache.reserve(counts)
    model(tokens, causal_positions(q_offsets, cache.seq_lens, len(tokens)), AttentionMetadata(q_offsets), cache)
    cache.advance(counts)
    return cache


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["decode", "chain", "tree"])
def test_replay_equals_eager_bit_for_bit(kind):
    model = random_model(CONFIG, seed=0).cuda()
    graphs = CudaGraphs(model)
    caches = [prefilled(model, 3, 9) for _ in range(2)]
    caches[1].data.copy_(caches[0].data)
    n = {"decode": 1, "chain": 4, "tree": 5}[kind]
    offsets = i32(0, n, 2 * n, 3 * n, device="cuda")
    tokens = torch.randint(0, 80, (3 * n,), device="cuda")
    mask = None
    if kind == "tree":
        meta = build_tree_metadata(i32(*[-1, 0, 0, 1, 2] * 3, device="cuda"), offsets)
        mask, depth = meta.ancestor_mask, meta.depth
    for step in range(3):  # the first forward captures, the later ones replay
        for cache in caches:
            cache.reserve([n] * 3)
        metadata = AttentionMetadata(offsets, mask)
        positions = (
            causal_positions(offsets, caches[0].seq_lens, 3 * n)
            if mask is None
            else tree_positions(offsets, caches[0].seq_lens, depth)
        )
        replayed = graphs.forward(tokens, positions, metadata, caches[0])
        # eager: the same padded inputs under the same bounds, on the twin cache
        captured = next(iter(graphs._graphs[caches[0]].values()))
        caches[1].begin_forward(offsets, 3 * n)
        plan = build_plan(
            model, captured.positions, captured.metadata, caches[1], captured.tokens.shape[0], 64, None
        )
        eager = model.run(captured.tokens, plan)
        assert torch.equal(replayed[0], eager[0][: 3 * n]) and torch.equal(replayed[1], eager[1][: 3 * n])
        assert torch.equal(caches[0].data, caches[1].data), f"step {step}: the K/V writes differ"
        for cache in caches:
            cache.advance([1, 1, 1])
        tokens = replayed[0].argmax(-1)
    assert graphs.replays == 3 and len(graphs._graphs[caches[0]]) == 1


@pytest.mark.gpu
def test_row_counts_share_buckets():
    model = random_model(CONFIG, seed=0).cuda()
    graphs = CudaGraphs(model)
    cache = prefilled(model, 2, 6)
    for counts in ([2, 1], [2, 2], [1, 1], [3, 2]):  # 3 and 4 rows: bucket 4; 2 rows: bucket 2; 5 rows: 8
        offsets = i32(0, counts[0], sum(counts), device="cuda")
        cache.reserve(counts)
        out = graphs.forward(
            torch.randint(0, 80, (sum(counts),), device="cuda"),
            causal_positions(offsets, cache.seq_lens, sum(counts)), AttentionMetadata(offsets), cache,
        )  # fmt: skip
        assert out[0].shape == (sum(counts), 80)
        cache.discard()
    assert sorted(key[0] for key in graphs._graphs[cache]) == [2, 4, 8]


@pytest.mark.gpu
def test_a_new_cache_captures_after_the_old_one_is_gone():
    """Each cache's graphs own their memory pool: once a cache and its graphs are freed, PyTorch refuses
    their pool to a new capture (the 8B step benchmark hit that assert on an H200 when it made a second cache)."""
    import gc

    model = random_model(CONFIG, seed=0).cuda()
    graphs = CudaGraphs(model)
    for _ in range(3):
        cache = prefilled(model, 2, 6)
        offsets = i32(0, 1, 2, device="cuda")
        cache.reserve([1, 1])
        positions = causal_positions(offsets, cache.seq_lens, 2)
        out = graphs.forward(torch.randint(0, 80, (2,), device="cuda"), positions, AttentionMetadata(offsets), cache)
        assert out is not None and out[0].shape == (2, 80) and torch.isfinite(out[0]).all()
        del cache, out
        gc.collect()
        assert len(graphs._graphs) == 0, "a freed cache kept its graphs"
    assert graphs.replays == 3


STRATEGIES = [lambda d: None, lambda d: DraftModelStrategy(d, (1, 1, 1)), lambda d: NgramStrategy(3)]


@pytest.mark.gpu
@pytest.mark.parametrize("make", STRATEGIES, ids=["autoregressive", "chain", "ngram"])
def test_one_graph_replay_per_forward_and_the_eager_tokens(make, monkeypatch):
    target = random_model(CONFIG, seed=0).cuda()
    draft = noisy_copy(target, 1, 0.3).cuda()
    prompts = [[3, 9, 4, 3, 9, 4], [7, 1], [5, 5, 2]]
    expected = SpeculativeDecoder(target, make(draft)).generate(prompts, max_new_tokens=10, eos_token_id=None).tokens
    counts = {"forwards": 0, "replays": 0}

    def counted(name, method):
        def call(*args, **kwargs):
            counts[name] += 1
            return method(*args, **kwargs)

        return call

    monkeypatch.setattr(LlamaModel, "forward", counted("forwards", LlamaModel.forward))  # target and draft
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", counted("replays", torch.cuda.CUDAGraph.replay))
    decoder = SpeculativeDecoder(target, make(draft), graphs=True)
    assert decoder.generate(prompts, max_new_tokens=10, eos_token_id=None).tokens == expected
    assert counts["replays"] == counts["forwards"] > 0, counts


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_a_padded_plan_under_static_bounds_equals_the_exact_forward(tree):
    """What a graph replays, checked on the CPU through Triton's interpreter: rows padded to a bucket and the
    context bounded by the capacity give the exact forward's rows and K/V writes (the padding belongs to no
    request)."""
    from specdec import use_backend

    model = random_model(CONFIG, seed=0)
    caches = [model.new_cache(2, 16, layout="paged", block_size=4) for _ in range(2)]
    n, padded = 3, 8
    offsets = i32(0, n, 2 * n)
    tokens = torch.randint(0, 80, (2 * n,))
    meta = build_tree_metadata(i32(-1, 0, 0, -1, 0, 1), offsets)
    with use_backend("triton"):
        for cache in caches:
            prompts = torch.randint(0, 80, (9,))
            cache.reserve([5, 4])
            model(prompts, causal_positions(i32(0, 5, 9), cache.seq_lens, 9), AttentionMetadata(i32(0, 5, 9)), cache)
            cache.advance([5, 4])
        caches[1].data.copy_(caches[0].data)
        positions = tree_positions(offsets, caches[0].seq_lens, meta.depth)
        metadata = AttentionMetadata(offsets, meta.ancestor_mask if tree else None)
        caches[0].reserve([n, n])
        exact = model(tokens, positions, metadata, caches[0])
        pad = torch.zeros(padded - 2 * n, dtype=torch.int64)
        mask = None if not tree else torch.cat((meta.ancestor_mask, torch.zeros(padded - 2 * n, 1, dtype=torch.int64)))
        caches[1].reserve([n, n])
        caches[1].begin_forward(offsets, 2 * n)
        padded_positions = torch.cat((positions, pad))
        plan = build_plan(model, padded_positions, AttentionMetadata(offsets, mask), caches[1], padded, 16, None)
        static = model.run(torch.cat((tokens, pad)), plan)
    for a, b in zip(exact, static):
        assert (a - b[: 2 * n]).abs().max() < 1e-5
    assert torch.equal(caches[0].data, caches[1].data), "the padding rows wrote into the cache"


@pytest.mark.gpu
@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_requests_joining_a_running_engine_under_graphs_get_their_eager_tokens(tree):
    """Prompts joining a chain step ride in its replayed forward; beside a tree step they run a forward of their own
    whose features the strategy reads after the tree's forward replayed (a copy: graphs share their output memory)."""
    target = random_model(CONFIG, seed=0).cuda()
    draft = noisy_copy(target, 1, 0.3).cuda()
    arrivals = [(0, [3, 9, 4, 3, 9, 4], 12), (1, [7, 1], 6), (2, [5, 5, 2], 9), (4, [8, 2, 8, 2, 8], 7)]

    def serve(graphs):
        strategy = DraftModelStrategy(draft, (2, 1, 1) if tree else (1, 1, 1), rule="deterministic")
        engine = SpeculativeDecoder(target, strategy, adaptive=False, graphs=graphs).engine(max_batch=2, max_len=48)
        tokens, step = {}, 0
        while step <= 4 or engine.has_unfinished():
            for i, (at, prompt, limit) in enumerate(arrivals):
                if at == step:
                    engine.add_request(prompt, request_id=i, max_new_tokens=limit, eos_token_id=None)
            out = engine.step()
            for request, new in zip(out.requests, out.tokens):
                tokens.setdefault(request, []).extend(new)
            step += 1
        return tokens

    assert serve(graphs=True) == serve(graphs=False)
