"""The fused draft chain (csrc/draft_forward_cpu.cpp) against the PyTorch forwards it replaces: the logits of every
draft position and the cache rows it writes, for both cache layouts, GQA and biases, several layers,
float32/float16/bfloat16, requests that are not running, ragged lengths and any number of first rows; its
argument checks; and a speculative decoder that drafts through it emitting exactly the target's greedy tokens
(sampled chains through it are covered by the statistical exactness tests of test_engine.py)."""

import pytest
import torch
from helpers import random_model, random_prompts, tiny_config

from specdec import _backend
from specdec.decoding import DraftModelStrategy, SpeculativeDecoder
from specdec.decoding.autoregressive import generate as autoregressive_generate
from specdec.decoding.proposal import tree_metadata_on
from specdec.model import AttentionMetadata, causal_positions, cpu_linear
from specdec.model.draft_forward_cpu import (
    DraftForward,
    _has_op,
    draft_chain_greedy,
    fused_available,
    fused_forward,
    model_arguments,
)

needs_op = pytest.mark.skipif(
    not _has_op(), reason=f"specdec._C without draft_chain_greedy_cpu: {_backend.extension_status()[1]}"
)
pytestmark = needs_op

LENGTHS = [7, 20, 13]  # committed tokens of the three slots


def prefilled(model, layout: str, max_len: int = 48):
    """A cache of three requests holding random prompts of ``LENGTHS`` tokens."""
    cache = model.new_cache(len(LENGTHS), max_len, layout=layout, block_size=4)
    prompts = random_prompts(LENGTHS, model.config.vocab_size, seed=3)
    tokens = torch.tensor([t for p in prompts for t in p])
    offsets = torch.tensor([0, *LENGTHS], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    cache.reserve(LENGTHS)
    positions = causal_positions(offsets, cache.seq_lens, tokens.numel())
    model(tokens, positions, AttentionMetadata(offsets), cache)
    cache.advance(LENGTHS)
    return cache


def python_chain(model, cache, first, slots, k):
    """The chain through ``LlamaModel.forward``, one forward per draft (what ``DraftModelStrategy`` does)."""
    batch, feed, logits, drafts = cache.batch_size, first.flatten(), [], []
    for j in range(k):
        n = 2 if j == 0 else 1
        counts = [0] * batch
        for s in slots.tolist():
            counts[s] = n
        offsets = torch.tensor([0, *counts], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        cache.reserve(counts)
        positions = causal_positions(offsets, cache.seq_lens, feed.numel())
        rows = torch.arange(n - 1, feed.numel(), n)
        out, _ = model(feed, positions, AttentionMetadata(offsets), cache, logits_rows=rows)
        cache.advance(counts)
        feed = out.float().argmax(-1)
        logits.append(out)
        drafts.append(feed)
    return torch.stack(drafts, 1), torch.stack(logits)


def written_rows(cache, slots, k):
    """K and V of the chain's K + 1 rows per running request, ``[L, 2, R, K + 1, Hkv, D]``."""
    out = []
    for s in slots.tolist():
        start = LENGTHS[s]
        if cache.block_tables is None:
            out.append(cache.data[:, :, s, start : start + k + 1])
        else:
            pos = torch.arange(start, start + k + 1)
            blocks = cache.block_tables[s].long()[pos // cache.block_size]
            out.append(cache.data[:, :, blocks, pos % cache.block_size])
    return torch.stack(out, 2)


CASES = [
    pytest.param(dict(), torch.float32, 1e-5, id="gqa-fp32"),
    pytest.param(
        dict(num_heads=4, num_kv_heads=2, qkv_bias=True, num_layers=3), torch.float32, 1e-5, id="bias-3layers"
    ),
    pytest.param(dict(num_heads=2, num_kv_heads=2), torch.float16, 2e-2, id="mha-fp16"),
    pytest.param(dict(), torch.bfloat16, 1e-1, id="gqa-bf16"),
]


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
@pytest.mark.parametrize("overrides,dtype,tol", CASES)
def test_fused_chain_matches_the_pytorch_forwards(layout, overrides, dtype, tol):
    model = random_model(tiny_config(**overrides), seed=11).to(dtype)
    assert fused_available(model)
    k = 5
    first = torch.tensor([[5, 9], [40, 41], [60, 2]])[[0, 2]]
    slots = torch.tensor([0, 2])  # slot 1 is not running: its rows must stay untouched
    fused_cache, torch_cache = prefilled(model, layout), prefilled(model, layout)
    untouched = fused_cache.data.clone()
    fused_cache.reserve([k + 1, 0, k + 1])
    drafts, logits = draft_chain_greedy(model, fused_cache, first, slots, k)
    with _backend.use_backend("torch"):
        ref_drafts, ref_logits = python_chain(model, torch_cache, first, slots, k)
    # the reference's first forward decides the later inputs; compare each position under the same inputs
    if not torch.equal(drafts, ref_drafts):  # a near-tie took another token: the first position still agrees
        pytest.fail(f"drafts differ: {drafts.tolist()} vs {ref_drafts.tolist()} (max logit diff "
                    f"{(logits.float() - ref_logits.float()).abs().max():.3g})")  # fmt: skip
    scale = ref_logits.float().abs().max()
    assert (logits.float() - ref_logits.float()).abs().max() <= tol * scale
    fused_rows, ref_rows = written_rows(fused_cache, slots, k), written_rows(torch_cache, slots, k)
    assert (fused_rows.float() - ref_rows.float()).abs().max() <= tol * ref_rows.float().abs().max()
    assert fused_cache.seq_lens.tolist() == LENGTHS, "the op commits nothing: the caller advances"
    if layout == "contiguous":
        assert torch.equal(fused_cache.data[:, :, 1], untouched[:, :, 1])


@pytest.mark.parametrize("first_rows", [1, 3])
def test_any_number_of_first_rows_and_one_fused_forward(first_rows):
    """The first forward takes n causal rows per request; with one draft the op is a single fused forward
    (``fused_forward``, what a sampled chain calls per draft)."""
    model = random_model(tiny_config(), seed=12)
    first = torch.tensor([[5, 9, 11], [60, 2, 7]])[:, :first_rows]
    slots = torch.tensor([1, 2])
    fused_cache, torch_cache = prefilled(model, "paged"), prefilled(model, "paged")
    fused_cache.reserve([0, first_rows + 1, first_rows + 1])
    drafts, logits = draft_chain_greedy(model, fused_cache, first, slots, 2)
    counts = [0, first_rows, first_rows]
    offsets = torch.tensor([0, *counts], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    with _backend.use_backend("torch"):
        torch_cache.reserve(counts)
        positions = causal_positions(offsets, torch_cache.seq_lens, 2 * first_rows)
        rows = torch.arange(first_rows - 1, 2 * first_rows, first_rows)
        ref, _ = model(first.flatten(), positions, AttentionMetadata(offsets), torch_cache, logits_rows=rows)
    assert (logits[0] - ref).abs().max() <= 1e-5 * ref.abs().max()
    assert torch.equal(drafts[:, 0], ref.argmax(-1))
    one_cache = prefilled(model, "paged")
    one_cache.reserve(counts)
    assert (fused_forward(model, one_cache, first, slots) - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_decoder_drafting_through_the_fused_chain_emits_the_targets_greedy_tokens():
    config = tiny_config(num_layers=2)
    target, draft = random_model(config, seed=1), random_model(config, seed=2)
    prompts = random_prompts([5, 9], config.vocab_size, seed=4)
    expected = autoregressive_generate(target, prompts, max_new_tokens=16, eos_token_id=None)
    for layout in ("contiguous", "paged"):
        decoder = SpeculativeDecoder(target, DraftModelStrategy(draft, (1,) * 4), cache_layout=layout, adaptive=False)
        result = decoder.generate(prompts, max_new_tokens=16, eos_token_id=None)
        assert result.tokens == expected
        assert all(s.drafted > 0 for s in result.stats)


def test_a_draft_equal_to_its_target_is_accepted_through_the_fused_chain():
    """Float rounding aside, the fused chain is the draft's forward: a draft equal to the target drafts the
    target's own greedy tokens (random weights keep near-ties rare: all but a few must be accepted)."""
    target = random_model(tiny_config(vocab_size=256, hidden_size=64, head_dim=32), seed=5)
    decoder = SpeculativeDecoder(target, DraftModelStrategy(target, (1,) * 4), adaptive=False)
    decoder.generate(random_prompts([6, 10], 256, seed=6), max_new_tokens=40, eos_token_id=None)
    drafted = sum(s.drafted for s in decoder.stats)
    assert sum(s.accepted for s in decoder.stats) >= drafted - 2 > 0


def test_the_strategy_uses_it_only_where_it_applies(monkeypatch):
    config = tiny_config()
    target, draft = random_model(config, seed=1), random_model(config, seed=2)
    calls = []
    chain, forward = draft_chain_greedy, fused_forward

    def counting_chain(*args):
        calls.append(("chain", args[2].shape[1], args[4]))  # (first rows, drafts)
        return chain(*args)

    def counting_forward(*args, **kwargs):
        calls.append(("forward", args[2].shape[1], kwargs.get("tree_mask") is not None))  # (rows, tree level)
        return forward(*args, **kwargs)

    import specdec.model.draft_forward_cpu as draft_forward_cpu

    monkeypatch.setattr(draft_forward_cpu, "draft_chain_greedy", counting_chain)
    monkeypatch.setattr(draft_forward_cpu, "fused_forward", counting_forward)
    prompts = random_prompts([5, 4], config.vocab_size, seed=7)

    def decode(branching, **options):
        calls.clear()
        strategy = DraftModelStrategy(draft, branching, fused=options.pop("fused", True))
        SpeculativeDecoder(target, strategy, adaptive=False).generate(prompts, max_new_tokens=6, **options)
        return set(calls)

    greedy = decode((1,) * 3)  # one call per step (shorter chains near the end)
    assert ("chain", 2, 3) in greedy and greedy <= {("chain", 2, k) for k in (1, 2, 3)}
    assert decode((1,) * 3, temperature=1.0, seed=0) == {("forward", 2, False), ("forward", 1, False)}  # sampled
    assert decode((2, 1)) == {("forward", 2, False), ("forward", 2, True)}  # a tree: per level
    assert decode((1,) * 3, fused=False) == set()
    with _backend.use_backend("torch"):  # the PyTorch path forced: every draft forward is LlamaModel.forward
        assert decode((1,) * 3) == set()
        assert decode((2, 1)) == set()
    with pytest.raises(TypeError, match="fused must be a bool"):
        DraftModelStrategy(draft, (1,) * 3, fused=1)


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_tree_levels_match_the_pytorch_forward(layout):
    """Two levels of token trees over a cached prefix: each row sees the prefix and its marked ancestors."""
    model = random_model(tiny_config(num_heads=4, num_kv_heads=2), seed=13)
    slots = torch.tensor([0, 2])
    fused_cache, torch_cache = prefilled(model, layout), prefilled(model, layout)
    tree_start = fused_cache.seq_lens.clone()
    _, masks = tree_metadata_on([[-1, -1, 0, 0, 2]], torch.device("cpu"))  # a forest of two trees, 5 nodes
    start = tree_start.index_select(0, slots).long()
    for level, nodes in enumerate(([0, 1, 2], [3, 4])):  # node 2 beside its parent: it sees it in the same forward
        width, counts = len(nodes), [0] * 3
        for s in slots.tolist():
            counts[s] = width
        tokens = torch.randint(0, 64, (2, width))
        positions = (start + level)[:, None].expand(2, width)
        mask = masks[nodes].repeat(2, 1)
        fused_cache.reserve(counts)
        fused = fused_forward(model, fused_cache, tokens, slots, positions=positions, tree_mask=mask,
                              tree_start=tree_start, kept=width)  # fmt: skip
        fused_cache.advance(counts)
        offsets = torch.tensor([0, *counts], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        with _backend.use_backend("torch"):
            torch_cache.reserve(counts)
            metadata = AttentionMetadata(offsets, mask, tree_start=tree_start)
            ref, _ = model(tokens.flatten(), positions.flatten(), metadata, torch_cache)
            torch_cache.advance(counts)
        assert (fused - ref).abs().max() <= 1e-5 * ref.abs().max(), level


def test_draft_forward_chooses_its_path_once_and_both_paths_agree():
    """``DraftForward`` picks the C++ ops or ``LlamaModel.forward`` when built; a chain step's causal rows and a tree
    level give the same logits either way, and a greedy chain is one call on the fused path only."""
    model = random_model(tiny_config(num_heads=4, num_kv_heads=2), seed=14)
    running, counts = [0, 2], [2, 0, 2]
    fused_cache, torch_cache = prefilled(model, "paged"), prefilled(model, "paged")
    fused, plain = DraftForward(model, fused_cache), DraftForward(model, torch_cache, fused=False)
    assert fused.fused and not plain.fused
    with _backend.use_backend("torch"):
        assert not DraftForward(model, fused_cache).fused
    for forward, cache in ((fused, fused_cache), (plain, torch_cache)):
        forward.start(running)
        cache.reserve(counts)
    first = torch.tensor([[5, 9], [60, 2]])
    causal = fused.causal(first, counts), plain.causal(first, counts)
    assert causal[0].shape == (2, model.config.vocab_size)
    assert (causal[0] - causal[1]).abs().max() <= 1e-5 * causal[1].abs().max()
    fused_cache.advance(counts)
    torch_cache.advance(counts)
    tree_start = fused_cache.seq_lens.clone()
    _, masks = tree_metadata_on([[-1, -1, 0]], torch.device("cpu"))  # a level of two roots: each sees itself
    tokens, mask = torch.tensor([[3, 4], [7, 8]]), masks[:2].repeat(2, 1)
    positions = tree_start[[0, 2]].long()[:, None].expand(2, 2)
    levels = []
    for forward, cache in ((fused, fused_cache), (plain, torch_cache)):
        cache.reserve(counts)
        levels.append(forward.tree_level(tokens, counts, positions, mask, tree_start))
    assert (levels[0] - levels[1]).abs().max() <= 1e-5 * levels[1].abs().max()
    with pytest.raises(RuntimeError, match="fused draft chain needs"):
        plain.chain_greedy(first, 2)


def test_a_decoder_drafting_trees_through_it_emits_the_targets_greedy_tokens():
    config = tiny_config()
    target, draft = random_model(config, seed=1), random_model(config, seed=2)
    prompts = random_prompts([6, 3], config.vocab_size, seed=8)
    expected = autoregressive_generate(target, prompts, max_new_tokens=12, eos_token_id=None)
    strategy = DraftModelStrategy(draft, (2, 2, 1), rule="deterministic")
    result = SpeculativeDecoder(target, strategy, adaptive=False).generate(
        prompts, max_new_tokens=12, eos_token_id=None
    )
    assert result.tokens == expected


def test_arguments_are_checked():
    model = random_model(tiny_config(), seed=1)
    cache = prefilled(model, "contiguous", max_len=32)
    first, slots = torch.tensor([[1, 2]]), torch.tensor([0])
    drafts, logits = torch.empty(1, 2, dtype=torch.int64), torch.empty(2, 1, 64)
    op = torch.ops.specdec.draft_chain_greedy_cpu

    def call(**change):
        args = dict(first_tokens=first, slots=slots, num_drafts=2, cache=cache.data, drafts=drafts, logits=logits)
        args.update(change)
        model_args = model_arguments(model, cache)
        at = CACHE_ARGUMENT
        op(args["first_tokens"], args["slots"], args["num_drafts"], *model_args[:at], args["cache"],
           *model_args[at + 1 :], args["drafts"], args["logits"])  # fmt: skip

    call()  # well-formed
    with pytest.raises(ValueError, match="num_drafts"):
        call(num_drafts=0)
    with pytest.raises(TypeError, match="int64"):
        call(first_tokens=first.int())
    with pytest.raises(ValueError, match="slots"):
        call(slots=torch.tensor([3]))
    with pytest.raises(ValueError, match="drafts must be"):
        call(drafts=torch.empty(1, 3, dtype=torch.int64))
    with pytest.raises(ValueError, match="past the cache"):
        call(num_drafts=30, drafts=torch.empty(1, 30, dtype=torch.int64), logits=torch.empty(30, 1, 64))
    with pytest.raises(ValueError, match="cache must be"):
        call(cache=cache.data[:1])


PACKS_ARGUMENT, CACHE_ARGUMENT = 5, 8  # positions in model_arguments' tuple


def chain_with_packs(model, packs, pack_rows, slots, first, k):
    """The fused chain's drafts and logits with the given skinny-kernel packs (``[]``: ATen's GEMMs throughout)."""
    cache = prefilled(model, "paged")
    counts = [0] * len(LENGTHS)
    for s in slots.tolist():
        counts[s] = first.shape[1] + k - 1
    cache.reserve(counts)
    args = list(model_arguments(model, cache))
    args[PACKS_ARGUMENT : PACKS_ARGUMENT + 2] = [packs, pack_rows]
    drafts, logits = torch.empty(len(slots), k, dtype=torch.int64), torch.empty(k, len(slots), model.config.vocab_size)
    torch.ops.specdec.draft_chain_greedy_cpu(first, slots, k, *args, drafts, logits)
    return drafts, logits


@pytest.mark.skipif(not cpu_linear.skinny_available(), reason="specdec._C without the skinny-GEMM ops")
@pytest.mark.parametrize("running", [1, 3])
def test_skinny_packs_give_atens_logits(running, monkeypatch):
    """A float32 draft's GEMMs through the skinny kernel (every layer at every row count here: 1 row, several, and
    more than one pass of 8) equal ATen's up to float rounding; the model's own packs and row ranges are passed by
    default (where the skinny kernel serves the model: not with Triton's interpreter standing in for a GPU), none
    for other dtypes."""
    config = tiny_config(num_heads=4, num_kv_heads=2, qkv_bias=True)
    model, half = random_model(config, seed=13), random_model(config, seed=13).half()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    packs = model_arguments(model, prefilled(model, "paged"))[PACKS_ARGUMENT]
    assert packs == [], "the interpreter's forwards keep ATen's GEMMs"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    args = model_arguments(model, prefilled(model, "paged"))
    packs, pack_rows = args[PACKS_ARGUMENT], args[PACKS_ARGUMENT + 1]
    assert len(packs) == 2 * 4 + 1 and all(p is not None for p in packs)
    assert pack_rows == [1, cpu_linear.SKINNY_MAX_ROWS] * len(packs)  # every layer, as linear_for runs it
    assert model_arguments(half, prefilled(half, "paged"))[PACKS_ARGUMENT] == []
    packs = [cpu_linear.skinny_pack(w) for w in linear_weights(model)]
    slots = torch.tensor([0, 1, 2][:running])
    first = torch.tensor([[5, 9, 3, 1, 7], [40, 41, 1, 2, 3], [60, 2, 8, 8, 8]])[:running]  # up to 15 rows: 2 passes
    drafts, logits = chain_with_packs(model, packs, [1, 64] * len(packs), slots, first, 3)
    ref_drafts, ref_logits = chain_with_packs(model, [], [], slots, first, 3)
    assert (logits - ref_logits).abs().max() <= 1e-5 * ref_logits.abs().max()
    assert torch.equal(drafts, ref_drafts)


def linear_weights(model):
    """The draft's linear layers in the packs' order: per layer qkv, o, gate_up, down, then the LM head."""
    layers = [[p.qkv["weight"], p.o["weight"], p.gate_up["weight"], p.down["weight"]] for p in model._layer_params]
    return [w for layer in layers for w in layer] + [model.lm_head_weight]


@pytest.mark.skipif(not cpu_linear.skinny_available(), reason="specdec._C without the skinny-GEMM ops")
def test_bad_packs_are_refused():
    model = random_model(tiny_config(), seed=1)
    packs = [cpu_linear.skinny_pack(w) for w in linear_weights(model)]
    rows = [1, 8] * len(packs)
    slots, first = torch.tensor([0]), torch.tensor([[1, 2]])
    with pytest.raises(ValueError, match="packs must be empty or hold 9 entries"):
        chain_with_packs(model, packs[:-1], rows[:-2], slots, first, 2)
    with pytest.raises(ValueError, match="pack_rows must hold"):
        chain_with_packs(model, packs, rows[:-1], slots, first, 2)
    with pytest.raises(ValueError, match=r"packs\[1\] must be skinny_linear_pack"):
        chain_with_packs(model, [packs[0], packs[0], *packs[2:]], rows, slots, first, 2)
    assert chain_with_packs(model, [None] * len(packs), rows, slots, first, 2)[0].shape == (1, 2)  # None: ATen's


def test_forward_arguments_are_checked():
    model = random_model(tiny_config(), seed=1)
    cache = prefilled(model, "contiguous", max_len=32)
    tokens, slots = torch.tensor([[1, 2]]), torch.tensor([0])
    positions = torch.tensor([[7, 7]])
    mask, start = torch.ones(2, 1, dtype=torch.int64), cache.seq_lens.clone()
    with pytest.raises(ValueError, match="kept must be in"):
        fused_forward(model, cache, tokens, slots, kept=3)
    with pytest.raises(ValueError, match="positions must be int64"):
        fused_forward(model, cache, tokens, slots, positions=positions.int())
    with pytest.raises(ValueError, match="tree_mask and tree_start come together"):
        fused_forward(model, cache, tokens, slots, positions=positions, tree_mask=mask)
    with pytest.raises(ValueError, match="tree_mask must be int64"):
        fused_forward(model, cache, tokens, slots, positions=positions, tree_mask=mask[:1], tree_start=start)
    with pytest.raises(ValueError, match="tree_start must be int32"):
        fused_forward(model, cache, tokens, slots, positions=positions, tree_mask=mask, tree_start=start.long())
    with pytest.raises(ValueError, match="outside the rotary table"):
        fused_forward(model, cache, tokens, slots, positions=positions + 100)
    with pytest.raises(ValueError, match="past the cache's capacity"):
        fused_forward(model, cache, torch.ones(1, 30, dtype=torch.int64), slots)


def test_refuses_models_it_cannot_run():
    model = random_model(tiny_config(), seed=1).double()
    assert not fused_available(model)
    with pytest.raises(RuntimeError, match="fused draft chain needs"):
        draft_chain_greedy(model, None, torch.tensor([[1, 2]]), torch.tensor([0]), 2)
    with _backend.use_backend("torch"):
        assert not fused_available(random_model(tiny_config(), seed=1))


def test_opcheck():
    model = random_model(tiny_config(), seed=1)
    cache = prefilled(model, "contiguous", max_len=32)
    args = (torch.tensor([[1, 2]]), torch.tensor([0]), 2, *model_arguments(model, cache),
            torch.empty(1, 2, dtype=torch.int64), torch.empty(2, 1, 64))  # fmt: skip
    torch.library.opcheck(torch.ops.specdec.draft_chain_greedy_cpu.default, args)
