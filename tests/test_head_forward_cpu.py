"""The fused EAGLE head forward (``head_forward_cpu`` in csrc/draft_forward_cpu.cpp, chosen by ``head_rows``) against
the PyTorch path it replaces: for EAGLE-1/2 heads (one layer with fc bias, two layers without) and EAGLE-3 heads, a
causal catch-up with each request's last logits and two token-tree levels over a cached prefix, batch 1 and a batch of
3 with a slot not running, contiguous and paged caches, float32 and bfloat16: the predicted features, the logits and
the K/V rows written into the head cache. Also: the forwards it must leave to PyTorch do (ragged rows, logits of other
rows or none, a whole tree without tree_start, Triton's interpreter) and give the same results, and so does autograd
over trainable weights (``head_rows``' decision); greedy speculative decoding through it (EAGLE-2 and EAGLE-1 trees,
EAGLE-1/2 and EAGLE-3 heads) emits the target's greedy tokens; the op's argument checks name the argument;
``torch.library.opcheck``."""

import math

import pytest
import torch
from helpers import random_eagle3_head, random_model, random_prompts, rel_err, tiny_config

import specdec.model.eagle as eagle_module
import specdec.model.eagle3 as eagle3_module
from specdec import _backend
from specdec.decoding import SpeculativeDecoder
from specdec.decoding.autoregressive import generate as autoregressive_generate
from specdec.decoding.eagle import EagleStrategy
from specdec.decoding.proposal import tree_metadata_on
from specdec.kernels import pack_mask_rows
from specdec.model import AttentionMetadata, EagleHead, causal_positions
from specdec.model.draft_forward_cpu import _has_head_op, _head_arguments, head_forward, head_rows

pytestmark = pytest.mark.skipif(
    not _has_head_op(), reason=f"specdec._C without head_forward_cpu: {_backend.extension_status()[1]}"
)

LENGTHS = [6, 11, 9]  # rows committed in the head cache's three slots
HIDDEN = tiny_config().hidden_size
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 5e-2}  # largest difference relative to the largest value


@pytest.fixture(autouse=True)
def cpu_path(monkeypatch):
    """The CPU's own path: conftest sets Triton's interpreter, which stands in for a GPU and turns the op off."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")


@pytest.fixture
def fused_calls(monkeypatch):
    """(n, kept) of every ``head_forward`` the heads make."""
    calls = []

    def spy(head, rows, *args, **kwargs):
        calls.append((rows.n, rows.kept))
        return head_forward(head, rows, *args, **kwargs)

    for module in (eagle_module, eagle3_module):
        monkeypatch.setattr(module, "head_forward", spy)
    return calls


def random_head(kind: str, dtype=torch.float32):
    """A head of ``kind`` over a random GQA target, every weight drawn at random, in ``dtype``."""
    target = random_model(tiny_config(num_heads=4, num_kv_heads=2), seed=1).to(dtype)
    if kind == "eagle3":
        return random_eagle3_head(target, seed=2, draft_vocab=20).to(dtype)
    layers = 2 if kind.endswith("2layers") else 1  # layer 1 has the input norm layer 0 lacks
    config = tiny_config(num_heads=4, num_kv_heads=2, num_layers=layers)
    head = EagleHead(config, target, fc_bias=kind == "eagle-bias").requires_grad_(False)
    gen = torch.Generator().manual_seed(2)
    for name, p in head.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        p.copy_(noise * 2 / math.sqrt(p.shape[1]) if p.dim() > 1 else noise * 0.1 + name.endswith("norm.weight"))
    return head.eval().to(dtype)


def filled_cache(head, layout: str, lengths=LENGTHS):
    """A head cache whose slots hold ``lengths`` committed rows of random K/V (every cache made so is the same)."""
    cache = head.new_cache(len(lengths), 32, layout=layout, block_size=4)
    cache.advance(lengths)
    cache.data.copy_(torch.randn(cache.data.shape, generator=torch.Generator().manual_seed(0)))
    return cache


def slot_rows(cache, slot: int, end: int) -> torch.Tensor:
    """K and V of positions 0 .. end - 1 of ``slot``, ``[L, 2, end, Hkv, D]``, for either layout."""
    if cache.block_tables is None:
        return cache.data[:, :, slot, :end]
    pos = torch.arange(end)
    return cache.data[:, :, cache.block_tables[slot].long()[pos // cache.block_size], pos % cache.block_size]


def offsets(counts) -> torch.Tensor:
    return torch.tensor([0, *counts], dtype=torch.int32).cumsum(0, dtype=torch.int32)


def step_inputs(head, rows: int, n: int = 3):
    """Random inputs of one drafting step over ``rows`` requests: a catch-up of ``n`` rows each, then two tree levels
    of 3 nodes each with their ancestor-or-self bits over the levels (level 2's parents: level 1's nodes 0, 0, 2)."""
    gen = torch.Generator().manual_seed(4)
    hidden, vocab = head.config.hidden_size, head.config.vocab_size

    def rows_of(count):
        features = torch.randn(count, hidden, generator=gen).to(head.dtype)
        return features, torch.randint(0, vocab, (count,), generator=gen)

    own = torch.eye(3, 6, dtype=torch.bool)  # level 1: each node its own bit
    second = own.roll(3, 1)  # level 2: its own bit after level 1's, and its parent's
    second[torch.arange(3), torch.tensor([0, 0, 2])] = True
    return [rows_of(rows * n), (*rows_of(rows * 3), own), (*rows_of(rows * 3), second)]


def drafting_step(head, cache, running, inputs):
    """The step's forwards as ``EagleStrategy`` runs them (catch-up with each request's last logits, then the tree
    levels from ``tree_start``), each committed; returns their (features, logits)."""
    (features, tokens), *levels = inputs
    rows, outputs = len(running), []
    n = tokens.numel() // rows
    counts = [n if b in running else 0 for b in range(cache.batch_size)]
    cache.reserve(counts)
    positions = causal_positions(offsets(counts), cache.seq_lens, rows * n)
    last = torch.arange(n - 1, rows * n, n)
    outputs.append(head(features, tokens, positions, AttentionMetadata(offsets(counts)), cache, last))
    cache.advance(counts)
    tree_start = cache.seq_lens.clone()
    start = tree_start[running].long()
    for level, (features, tokens, ancestors) in enumerate(levels, 1):
        width = ancestors.shape[0]
        counts = [width if b in running else 0 for b in range(cache.batch_size)]
        cache.reserve(counts)
        positions = (start + level - 1)[:, None].expand(rows, width).flatten()
        metadata = AttentionMetadata(offsets(counts), pack_mask_rows(ancestors).repeat(rows, 1), tree_start=tree_start)
        outputs.append(head(features, tokens, positions, metadata, cache))
        cache.advance(counts)
    return outputs


def assert_same(fused, reference, tol):
    """Each forward's (features, logits) within ``tol`` of the reference's, relative to its largest value."""
    for i, pair in enumerate(zip(fused, reference)):
        for what, got, expected in zip(("features", "logits"), *pair):
            assert got.shape == expected.shape, f"forward {i}: {what} {tuple(got.shape)} vs {tuple(expected.shape)}"
            err = rel_err(got.detach(), expected) if expected.numel() else 0.0
            assert err <= tol, f"forward {i}: {what} differ by {err:.3g} (tolerance {tol})"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", ["contiguous", "paged"])
@pytest.mark.parametrize("running", [[0], [0, 2]], ids=["batch1", "batch3"])
@pytest.mark.parametrize("kind", ["eagle-bias", "eagle-nobias-2layers", "eagle3"])
def test_fused_forwards_match_the_pytorch_path(kind, running, layout, dtype, fused_calls):
    head = random_head(kind, dtype)
    lengths = LENGTHS[: max(running) + 1]
    fused_cache, torch_cache = filled_cache(head, layout, lengths), filled_cache(head, layout, lengths)
    initial = filled_cache(head, layout, lengths)
    inputs = step_inputs(head, len(running))
    fused = drafting_step(head, fused_cache, running, inputs)
    assert fused_calls == [(3, 1), (3, 3), (3, 3)], "every forward of the step runs fused"
    with _backend.use_backend("torch"):
        reference = drafting_step(head, torch_cache, running, inputs)
    assert len(fused_calls) == 3, "the PyTorch path forced: no fused forward"
    assert_same(fused, reference, TOLERANCE[dtype])
    assert torch.equal(fused_cache.seq_lens, torch_cache.seq_lens)
    for b, length in enumerate(lengths):  # the rows written, and nothing else: the rest holds the same random K/V
        end = int(torch_cache.seq_lens[b])
        got, expected = slot_rows(fused_cache, b, end), slot_rows(torch_cache, b, end)
        assert rel_err(got, expected) <= TOLERANCE[dtype], f"slot {b}: written K/V differ"
        assert torch.equal(got[:, :, :length], slot_rows(initial, b, length)), f"slot {b}: its prefix was overwritten"
    assert rel_err(fused_cache.data, torch_cache.data) <= TOLERANCE[dtype], "K/V written outside the step's rows"


def catch_up(head, cache, counts, logits_rows, tree_mask=None):
    """A causal forward of ``counts`` rows per slot (or, with ``tree_mask``, a whole tree without tree_start)."""
    gen = torch.Generator().manual_seed(5)
    total = sum(counts)
    features = torch.randn(total, head.config.hidden_size, generator=gen)
    tokens = torch.randint(0, head.config.vocab_size, (total,), generator=gen)
    cache.reserve(counts)
    positions = causal_positions(offsets(counts), cache.seq_lens, total)
    return head(features, tokens, positions, AttentionMetadata(offsets(counts), tree_mask), cache, logits_rows)


CHAIN_MASK = tree_metadata_on([[-1, 0, 1]] * 2, torch.device("cpu"))[1]  # two causal chains of 3, as tree masks
FALLBACKS = {  # name: (counts per slot, logits_rows, tree mask)
    "ragged": ([3, 0, 2], torch.tensor([2, 4]), None),
    "not-the-last-rows": ([3, 0, 3], torch.tensor([1, 5]), None),
    "two-last-rows-out-of-order": ([3, 0, 3], torch.tensor([2, 1, 5, 4]), None),
    "no-logits-rows": ([3, 0, 3], torch.zeros(0, dtype=torch.int64), None),
    "tree-without-tree-start": ([3, 0, 3], None, CHAIN_MASK),
    "interpreter": ([3, 0, 3], torch.tensor([2, 5]), None),
}


@pytest.mark.parametrize("kind", ["eagle-bias", "eagle3"])
@pytest.mark.parametrize("case", list(FALLBACKS))
def test_forwards_it_cannot_run_fall_back_to_pytorch(kind, case, fused_calls, monkeypatch):
    head = random_head(kind)
    counts, logits_rows, mask = FALLBACKS[case]
    if case == "interpreter":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    fused_cache, torch_cache = filled_cache(head, "contiguous"), filled_cache(head, "contiguous")
    out = catch_up(head, fused_cache, counts, logits_rows, mask)
    assert fused_calls == [], case
    with _backend.use_backend("torch"):
        reference = catch_up(head, torch_cache, counts, logits_rows, mask)
    tol = 1e-4 if case == "interpreter" else 1e-5  # auto: the CPU attention op, or the interpreter's Triton kernels
    assert_same([out], [reference], tol)
    assert rel_err(fused_cache.data, torch_cache.data) <= tol


@pytest.mark.parametrize("kind", ["eagle-bias", "eagle3"])
def test_the_fused_path_where_it_applies(kind, fused_calls):
    """Equal counts with each request's last row (one or two), all rows, one running request of three, and trainable
    weights outside autograd: fused, and equal to the PyTorch path."""
    head = random_head(kind).requires_grad_(True)
    cases = [([3, 0, 3], torch.tensor([2, 5])), ([3, 0, 3], torch.tensor([1, 2, 4, 5])), ([2, 0, 2], None),
             ([0, 4, 0], torch.tensor([3]))]  # fmt: skip
    for counts, logits_rows in cases:
        fused_calls.clear()
        fused_cache, torch_cache = filled_cache(head, "paged"), filled_cache(head, "paged")
        with torch.no_grad():
            out = catch_up(head, fused_cache, counts, logits_rows)
            with _backend.use_backend("torch"):
                reference = catch_up(head, torch_cache, counts, logits_rows)
        n = max(counts)
        assert fused_calls == [(n, n if logits_rows is None else logits_rows.numel() // counts.count(n))], counts
        assert_same([out], [reference], 1e-5)
        assert rel_err(fused_cache.data, torch_cache.data) <= 1e-5


def test_autograd_over_trainable_weights_is_left_to_pytorch():
    """Only the PyTorch path records the graph (it refuses a forward over a KV cache under autograd today: its cache
    writes are in place, so ``head_rows``' decision is checked here, not a forward)."""
    head = random_head("eagle3").requires_grad_(True)
    cache = filled_cache(head, "contiguous")
    metadata, last = AttentionMetadata(offsets([3, 0, 3])), torch.tensor([2, 5])
    cache.reserve([3, 0, 3])
    assert head_rows(head, metadata, cache, 6, last) is None
    with torch.no_grad():
        rows = head_rows(head, metadata, cache, 6, last)
    assert rows is not None and rows.slots.tolist() == [0, 2] and (rows.n, rows.kept) == (3, 1)
    head.requires_grad_(False)
    assert head_rows(head, metadata, cache, 6, last) is not None  # frozen weights: fused under grad mode too


KINDS = {
    "eagle2": lambda head: EagleStrategy(head, tree_budget=10, depth=3, top_k=3),
    "eagle1": lambda head: EagleStrategy(head, static_tree="default", tree_budget=10, depth=3, top_k=3),
}


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
@pytest.mark.parametrize("head_kind", ["eagle-bias", "eagle3"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_greedy_decoding_through_it_emits_the_targets_tokens(kind, head_kind, layout, fused_calls):
    head = random_head(head_kind)
    prompts = random_prompts([7, 3, 5], head.config.vocab_size, seed=6)
    options = dict(max_new_tokens=[14, 6, 10], eos_token_id=None)
    expected = autoregressive_generate(head.target, prompts, **options)
    decoder = SpeculativeDecoder(head.target, KINDS[kind](head), cache_layout=layout, block_size=4, adaptive=False)
    result = decoder.generate(prompts, **options)
    assert result.tokens == expected
    assert sum(s.drafted for s in result.stats) > 0
    assert len(fused_calls) > 0 and any(kept > 1 for _, kept in fused_calls), "tree levels ran fused"


def head_op_arguments(**change):
    """A well-formed ``head_forward_cpu`` call of an EAGLE-3 head (2 rows of slot 0, logits of the last), with
    ``change`` replacing arguments by name."""
    head = random_head("eagle3")
    cache = filled_cache(head, "contiguous", [4])
    hidden = head.config.hidden_size
    args = dict(residual=torch.randn(2, hidden), first_input=torch.randn(2, 2 * hidden), first_norm=False,
                slots=torch.tensor([0]), positions=torch.tensor([[4, 5]]), tree_mask=None, tree_start=None,
                kept=1)  # fmt: skip
    args.update({k: v for k, v in change.items() if k in args})
    logits = change.get("logits", torch.empty(args["kept"], head.draft_vocab_size))
    return (*args.values(), *_head_arguments(head, cache, head.norm.weight, head.lm_head.weight), logits)


BAD_ARGUMENTS = {  # name: (changed arguments, error, message)
    "residual-rows": (dict(residual=torch.randn(3, HIDDEN)), ValueError, "residual must be"),
    "first-input-rows": (dict(first_input=torch.randn(3, 2 * HIDDEN)), ValueError, "first_input must be"),
    "first-input-dtype": (dict(first_input=torch.randn(2, 2 * HIDDEN).double()), ValueError, "first_input must be"),
    "first-input-width": (dict(first_input=torch.randn(2, 2 * HIDDEN + 1)), ValueError, r"layer_weights\[1\] must be"),
    "kept-above": (dict(kept=3), ValueError, r"kept must be in \[1, 2\]"),
    "kept-zero": (dict(kept=0), ValueError, r"kept must be in \[1, 2\]"),
    "positions-rows": (dict(positions=torch.tensor([[4], [5]])), ValueError, r"positions must be \[R, n >= 1\]"),
    "positions-dtype": (dict(positions=torch.tensor([[4, 5]], dtype=torch.int32)), TypeError, "positions and slots"),
    "tree-mask-alone": (dict(tree_mask=torch.ones(2, 1, dtype=torch.int64)), ValueError, "tree_mask and tree_start"),
    "position-past-table": (dict(positions=torch.tensor([[4, 100]])), ValueError, "outside the rotary table"),
    "slot": (dict(slots=torch.tensor([1])), ValueError, r"slots\[0\] = 1 is not a request slot"),
    "logits": (dict(logits=torch.empty(2, 20)), ValueError, "logits must be"),
    "positions-1d": (dict(positions=torch.tensor([4, 5])), ValueError, r"positions must be int64 \[R, n\]"),
    "slot-twice": (
        dict(
            slots=torch.tensor([0, 0]),
            positions=torch.tensor([[4, 5], [4, 5]]),
            residual=torch.randn(4, HIDDEN),
            first_input=torch.randn(4, 2 * HIDDEN),
        ),
        ValueError,
        r"slots\[1\] = 0 appears twice",
    ),  # fmt: skip
}


@pytest.mark.parametrize("change, error, match", BAD_ARGUMENTS.values(), ids=BAD_ARGUMENTS)
def test_arguments_are_checked_by_name(change, error, match):
    torch.ops.specdec.head_forward_cpu(*head_op_arguments())  # well-formed
    with pytest.raises(error, match=match):
        torch.ops.specdec.head_forward_cpu(*head_op_arguments(**change))


def test_opcheck():
    torch.library.opcheck(torch.ops.specdec.head_forward_cpu.default, head_op_arguments())
