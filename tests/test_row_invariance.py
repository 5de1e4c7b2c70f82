"""The row-invariant CPU float32 forward (``SPECDEC_ROW_INVARIANT=1``, ``specdec.set_row_invariant``).

In the mode a position's logits have the same bits whatever the forward computes them in: a 1-row decode step, a
ragged prefill, a batch decode, a chain's verification of 2 to 16 rows, a token tree of ~40 rows, a batch mixing
chains and trees; on random models of several head layouts, contiguous and paged caches. So seeded speculative
decoding emits seeded plain decoding's tokens whatever the drafter (the embedded pair and its shipped heads). The
mode off keeps the default choice of paths.
"""

import itertools
import json

import pytest
import torch
import torch.nn.functional as F
from helpers import random_model, run_bench, tiny_config
from seeded_rows import path_tree

import specdec
from specdec import _backend, use_backend
from specdec.cli.demo import eagle_row, medusa_row
from specdec.decoding import DraftModelStrategy, NgramStrategy, NoDraft, SpeculativeDecoder
from specdec.decoding.proposal import tree_metadata_on
from specdec.kernels import cpu_attention
from specdec.model import AttentionMetadata, causal_positions, cpu_linear
from specdec.model.attention_metadata import tree_positions
from specdec.testing import heldout_token_ids, load_pair

pytestmark = pytest.mark.skipif(
    not (cpu_linear.skinny_available() and cpu_attention.available()), reason="needs the extension's CPU kernels"
)


@pytest.fixture
def invariant():
    """The mode on for the test, the PyTorch bodies forced (the CPU's own path under the tests' interpreter)."""
    specdec.set_row_invariant(True)
    try:
        with use_backend("torch"):
            yield
    finally:
        specdec.set_row_invariant(None)


def same_bits(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    differ = (a.view(torch.int32) != b.view(torch.int32)).any(-1)
    assert not differ.any(), f"{what}: rows {differ.nonzero().flatten().tolist()} differ (max {(a - b).abs().max()})"


# ---- the switch and the default ---------------------------------------------------------------------------------


def test_the_switch_follows_the_variable_unless_set(monkeypatch):
    try:
        for value, on in (("1", True), ("0", False), ("", False)):
            monkeypatch.setenv(_backend.ROW_INVARIANT_ENV, value)
            specdec.set_row_invariant(None)
            assert specdec.row_invariant() is on
        specdec.set_row_invariant(False)
        monkeypatch.setenv(_backend.ROW_INVARIANT_ENV, "1")
        assert specdec.row_invariant() is False
        monkeypatch.setenv(_backend.ROW_INVARIANT_ENV, "yes")
        specdec.set_row_invariant(None)
        with pytest.raises(ValueError, match="SPECDEC_ROW_INVARIANT"):
            specdec.row_invariant()
    finally:
        monkeypatch.delenv(_backend.ROW_INVARIANT_ENV)
        specdec.set_row_invariant(None)


def test_the_mode_off_keeps_the_default_paths(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the CPU's own path
    assert not specdec.row_invariant()
    most = cpu_linear.SKINNY_MAX_ROWS
    expected = {1: cpu_linear.skinny_linear, 2: cpu_linear.skinny_linear, most: cpu_linear.skinny_linear}
    expected[most + 1] = cpu_linear.packed_linear if cpu_linear.AVAILABLE else F.linear
    with torch.no_grad():
        for rows, linear in expected.items():
            assert cpu_linear.linear_for(torch.zeros(rows, 8)) is linear, rows
        with use_backend("torch"):
            assert cpu_attention.applies(torch.zeros(1, 2, 8)) is False
        specdec.set_row_invariant(True)
        try:
            for rows in expected:
                assert cpu_linear.linear_for(torch.zeros(rows, 8)) is cpu_linear.row_invariant_linear
            with use_backend("torch"):
                assert cpu_attention.applies(torch.zeros(1, 2, 8)) is True
        finally:
            specdec.set_row_invariant(None)


# ---- the kernels ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("in_features, out_features", [(5, 3), (37, 13), (256, 72)])
def test_row_invariant_linear_sums_each_row_as_alone(in_features, out_features):
    gen = torch.Generator().manual_seed(in_features)
    weight = torch.randn(out_features, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen)
    x = torch.randn(40, in_features, generator=gen)
    with torch.no_grad():
        alone = torch.cat([cpu_linear.row_invariant_linear(x[r : r + 1], weight, bias) for r in range(40)])
        expected = F.linear(x.double(), weight.double(), bias.double())
        assert (alone.double() - expected).abs().max() < 1e-4
        for rows in [*range(2, 18), 24, 40]:
            same_bits(cpu_linear.row_invariant_linear(x[:rows], weight, bias), alone[:rows], f"{rows} rows")
        same_bits(cpu_linear.row_invariant_linear(x.view(4, 10, -1), weight, bias).view(40, -1), alone, "[4, 10, K]")
        assert cpu_linear.row_invariant_linear(x[:0], weight, bias).shape == (0, out_features)


# ---- the forward ------------------------------------------------------------------------------------------------

MODELS = {
    "gqa": tiny_config(num_layers=3),
    "mha, head dim 12": tiny_config(num_heads=3, num_kv_heads=3, head_dim=12, hidden_size=36, vocab_size=70),
    "3 per group, biases": tiny_config(num_heads=6, num_kv_heads=2, head_dim=8, qkv_bias=True, mlp_bias=True),
}
LAYOUTS = {"contiguous": {}, "paged": dict(layout="paged", block_size=4)}


def forward(model, cache, rows: list[list[int]], parents: list[list[int]] | None = None, commit: bool = False):
    """Logits of one forward of ``rows[b]`` after each request's prefix: causal, or one tree per request
    (``parents[b]``); committed with ``commit``, else discarded."""
    counts = [len(r) for r in rows]
    cache.reserve(counts)
    tokens = torch.tensor([t for r in rows for t in r])
    q_offsets = torch.tensor([0, *itertools.accumulate(counts)], dtype=torch.int32)
    if parents is None:
        positions, metadata = causal_positions(q_offsets, cache.seq_lens, tokens.numel()), AttentionMetadata(q_offsets)
    else:
        depth, mask = tree_metadata_on(parents, model.device)
        positions, metadata = tree_positions(q_offsets, cache.seq_lens, depth), AttentionMetadata(q_offsets, mask)
    logits, _ = model(tokens, positions, metadata, cache)
    cache.advance(counts) if commit else cache.discard()
    return logits


def decoded_alone(model, text: list[int], **layout) -> torch.Tensor:
    """Every position's logits from 1-row forwards: the text decoded one token at a time from an empty cache."""
    cache = model.new_cache(1, len(text), **layout)
    return torch.cat([forward(model, cache, [[t]], commit=True) for t in text])


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", list(MODELS))
def test_a_positions_logits_are_the_same_bits_in_every_forward(invariant, name, layout):
    config = MODELS[name]
    model, vocab, n = random_model(config, seed=len(name)), config.vocab_size, 48
    texts = [torch.randint(0, vocab, (n,)).tolist() for _ in range(3)]
    with torch.inference_mode():
        alone = [decoded_alone(model, text, **LAYOUTS[layout]) for text in texts]
        same_bits(alone[0], decoded_alone(model, texts[0]), "1-row decode, paged vs contiguous")
        # one request: chains of 2 to 16 rows and a tree of 36 rows (a path of 8, 4 siblings before each node)
        cache = model.new_cache(1, n + 40, **LAYOUTS[layout])
        forward(model, cache, [texts[0][:8]], commit=True)
        for k in range(1, 16):
            t = int(cache.seq_lens[0])
            same_bits(forward(model, cache, [texts[0][t : t + k + 1]]), alone[0][t : t + k + 1], f"chain of {k + 1}")
            tokens, parents, path = path_tree(texts[0][t : t + 8], 4, vocab)
            same_bits(forward(model, cache, [tokens], [parents])[path], alone[0][t : t + 8], f"tree {len(tokens)}")
            forward(model, cache, [texts[0][t : t + 2]], commit=True)
        # three requests: a ragged prefill (39 rows), then batch decodes and mixed verifications (chains, trees)
        cache = model.new_cache(3, n + 40, **LAYOUTS[layout])
        starts = [9, 17, 13]
        logits = forward(model, cache, [text[:s] for text, s in zip(texts, starts)], commit=True)
        same_bits(logits, torch.cat([a[:s] for a, s in zip(alone, starts)]), "ragged prefill")
        for step in range(6):
            t = cache.seq_lens.tolist()
            depth = [1 + (step + b) % 5 for b in range(3)]
            trees = [path_tree(text[s : s + d + 1], b, vocab) for b, (text, s, d) in enumerate(zip(texts, t, depth))]
            logits = forward(model, cache, [tree[0] for tree in trees], [tree[1] for tree in trees])
            offsets = [0, *itertools.accumulate(len(tree[0]) for tree in trees)]
            rows = torch.tensor([o + node for o, tree in zip(offsets, trees) for node in tree[2]])
            expected = torch.cat([a[s : s + d + 1] for a, s, d in zip(alone, t, depth)])
            same_bits(logits[rows], expected, f"mixed batch, step {step}")
            chains = [text[s : s + d + 1] for text, s, d in zip(texts, t, depth)]
            same_bits(forward(model, cache, chains), expected, f"batch of chains, step {step}")
            logits = forward(model, cache, [[text[s]] for text, s in zip(texts, t)], commit=True)
            same_bits(logits, torch.stack([a[s] for a, s in zip(alone, t)]), f"batch decode, step {step}")


# ---- end to end -------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair():
    target, draft, tokenizer = load_pair()
    return target, draft, heldout_token_ids(tokenizer)[:3]


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_seeded_speculation_emits_seeded_plain_decodings_tokens(invariant, pair, layout):
    target, draft, prompts = pair
    seeds, new_tokens = [3, 2**40 + 5, 9], 120
    options = dict(cache_layout="paged", block_size=4) if layout == "paged" else {}

    def generate(strategy, prompts, seeds):
        decoder = SpeculativeDecoder(target, strategy, **options)
        result = decoder.generate(prompts, max_new_tokens=new_tokens, seed=seeds, eos_token_id=None, temperature=1.0)
        return result.tokens

    plain = [generate(NoDraft(), [p], [s])[0] for p, s in zip(prompts, seeds)]  # each request alone
    strategies = {
        "NoDraft, batched": NoDraft,
        "chain coupled": lambda: DraftModelStrategy(draft, (1,) * 5),
        "tree top-k": lambda: DraftModelStrategy(draft, (2, 2, 1), rule="deterministic"),
        "n-gram": lambda: NgramStrategy(num_draft=4, max_ngram=3),
        "Medusa": lambda: medusa_row(target)[1],
        "EAGLE-1, static tree": lambda: eagle_row(target, static_tree="default")[1],
    }
    for name, make in strategies.items():
        assert generate(make(), prompts, seeds) == plain, name


def test_the_cost_benchmark_runs_both_modes(tmp_path):
    done = run_bench("bench_row_invariant.py", "--quick", "--out", str(tmp_path), cpu_path=True, timeout=300)
    assert done.returncode == 0, done.stderr
    rows = json.loads((tmp_path / "row_invariant_cost.json").read_text())["rows"]
    assert [(r["method"], r["batch"]) for r in rows] == [(m, b) for b in ("1", "2") for m in ("NoDraft", "chain K=5")]
    assert all(float(r["off tok/s"]) > 0 and float(r["on tok/s"]) > 0 for r in rows)
