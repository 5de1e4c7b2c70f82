"""The embedded model pair (specdec/assets/pair) and the demo built on it.

Both checkpoints must load with specdec's loader and with transformers and compute the
same logits; speculative decoding with the pair must reproduce the target's greedy
tokens (the demo's claim), and those must equal transformers' greedy ``generate``.
"""

import io
import json

import pytest
import torch
from helpers import assert_close

from specdec import testing
from specdec._backend import use_backend
from specdec.cli import demo
from specdec.model.attention_metadata import AttentionMetadata, causal_positions

transformers = pytest.importorskip("transformers")

NEW_TOKENS = 24


# The demo's CPU path: PyTorch ops (the Triton kernels are covered on tiny models elsewhere).
pytestmark = pytest.mark.usefixtures("torch_backend")


@pytest.fixture(scope="module")
def pair():
    return testing.load_pair("cpu")


@pytest.fixture(scope="module")
def prompt_ids(pair):
    tokenizer = pair[2]
    return testing.heldout_token_ids(tokenizer)[:2]


@pytest.fixture(scope="module")
def greedy(pair, prompt_ids):
    """The target's own greedy tokens (specdec, no speculation) for the two prompts."""
    with use_backend("torch"):
        return demo.decode_all(pair[0], None, "autoregressive", prompt_ids, NEW_TOKENS).tokens


def test_asset_files_and_sizes():
    target_dir, draft_dir = testing.pair_dirs()
    total = sum(f.stat().st_size for d in (target_dir, draft_dir) for f in d.iterdir())
    assert total <= 40 * 2**20, f"the pair is {total / 2**20:.1f} MiB, over 40 MiB"
    assert (target_dir / "tokenizer.json").read_bytes() == (draft_dir / "tokenizer.json").read_bytes()
    report = json.loads((testing.ASSETS / "eval" / "training_report.json").read_text())
    assert report["python"].count(".") == 2  # the corpus is that Python version's standard library
    assert report["target"]["heldout_loss"] < report["draft"]["heldout_loss"]
    assert len(testing.heldout_prompts()) >= 3


def test_sizes_and_draft_cost(pair):
    target, draft, tokenizer = pair
    assert sum(p.numel() for p in target.parameters()) >= 8_000_000
    assert target.config.vocab_size == draft.config.vocab_size == tokenizer.get_vocab_size()

    def multiply_adds_per_token(c):  # the layers' projections and the LM head
        q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        layer = 2 * c.hidden_size * q + 2 * c.hidden_size * kv + 3 * c.hidden_size * c.intermediate_size
        return c.num_layers * layer + c.hidden_size * c.vocab_size

    ratio = multiply_adds_per_token(draft.config) / multiply_adds_per_token(target.config)
    assert ratio <= 1 / 8, f"the draft costs {ratio:.3f} of the target per token"


@pytest.mark.parametrize("which", [0, 1], ids=["target", "draft"])
def test_specdec_and_transformers_load_the_same_model(pair, prompt_ids, which):
    ours = pair[which]
    directory = testing.pair_dirs()[which]
    hf = transformers.LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    ids = torch.tensor(prompt_ids[0])
    with torch.no_grad():
        expected = hf(input_ids=ids[None]).logits[0]
        cache = ours.new_cache(1, len(ids))
        q_offsets = torch.tensor([0, len(ids)], dtype=torch.int32)
        positions = causal_positions(q_offsets, cache.seq_lens, len(ids))
        got, _ = ours(ids, positions, AttentionMetadata(q_offsets), cache)
    assert_close(got, expected, atol=1e-3, rtol=1e-3, what=f"{directory.name} logits, specdec vs transformers")


def test_target_greedy_matches_transformers_generate(prompt_ids, greedy):
    hf = transformers.LlamaForCausalLM.from_pretrained(testing.pair_dirs()[0], dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # the demo does not stop at EOS either
    for ids, ours in zip(prompt_ids, greedy):
        x = torch.tensor([ids])
        out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS, do_sample=False)
        assert out[0, len(ids) :].tolist() == ours


def test_every_demo_strategy_reproduces_target_greedy(pair, prompt_ids, greedy):
    target, draft, _ = pair
    for label, strategy in [*demo.strategies(draft)[1:], demo.medusa_row(target)]:
        run = demo.decode_all(target, strategy, label, prompt_ids, NEW_TOKENS)
        for b, (got, expected) in enumerate(zip(run.tokens, greedy)):
            assert got == expected, f"{label}, prompt {b}: first difference at {demo.first_difference(got, expected)}"
        assert run.generated == len(prompt_ids) * NEW_TOKENS
        if label.startswith(("draft", "Medusa")):
            assert run.forwards < run.generated, f"{label}: no draft token accepted (tau {run.tau:.2f})"


def test_the_demo_reports_equality_and_table(pair):
    out = io.StringIO()
    assert demo.main("cpu", num_prompts=1, max_new_tokens=12, show=1, out=out) == 0
    text = out.getvalue()
    target, draft = pair[0], pair[1]
    rows = [*demo.strategies(draft)[1:], demo.medusa_row(target), demo.eagle_row(target), *demo.parallel_rows(target)]
    for label, _ in rows:
        assert f"{label}: all 1 outputs identical to target-only greedy decoding" in text
        assert f"| {label} |" in text
    assert "| autoregressive |" in text and "baseline" in text


def test_first_difference():
    assert demo.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert demo.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert demo.first_difference([1, 2], [1, 2, 3]) == 2


def test_missing_assets_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="target/config.json is missing"):
        testing.pair_dirs(tmp_path)


def test_demo_refuses_cuda_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    assert demo.main("cuda", out=io.StringIO()) == 2


def test_greedy_tree_children_are_the_drafts_top_k(pair, prompt_ids):
    """A greedy tree's first level is the draft's 4 most likely tokens after the prompt (not one of them)."""
    from specdec.decoding import DraftModelStrategy, Prefill, StepContext
    from specdec.decoding.requests import make_requests

    target, draft, _ = pair
    ids = prompt_ids[0]
    strategy = DraftModelStrategy(draft, (4, 2, 2, 1), rule="deterministic")
    no_features = torch.zeros(0, draft.config.hidden_size)
    cache_options = {"layout": "contiguous", "block_size": 16}
    strategy.prefill(Prefill([ids], len(ids) + 64, cache_options, no_features, torch.tensor([0, 0], dtype=torch.int32)))
    req = make_requests([ids], vocab_size=draft.config.vocab_size, config_eos=(), temperature=0.0)
    step = StepContext(
        running=[0], batch_size=1, roots=[ids[-1]], previous=[ids[-2]], histories=[ids], max_depth=[10],
        max_nodes=[strategy.max_nodes], params=req.sampling_params(draft.device), greedy=True, device=draft.device,
    )  # fmt: skip
    with torch.inference_mode():
        proposal = strategy.propose(step)
    hf = transformers.LlamaForCausalLM.from_pretrained(testing.pair_dirs()[1], dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf(input_ids=torch.tensor([ids])).logits[0, -1].topk(4).indices.tolist()
    assert proposal.parents[0][:5] == [-1, 0, 0, 0, 0]
    assert sorted(proposal.tokens[1:5].tolist()) == sorted(expected)  # the order of near-ties may differ


def test_tree_drafting_of_a_chain_template_matches_the_chain(pair, prompt_ids):
    """The tree path must keep the draft's context: run on a one-child-per-level template it accepts
    exactly what the chain path does (it once lost the previous steps' accepted tokens)."""
    from specdec.decoding import DraftModelStrategy

    target, draft, _ = pair
    chain = demo.decode_all(target, DraftModelStrategy(draft, (1,) * 5), "chain", prompt_ids, NEW_TOKENS)
    as_tree = DraftModelStrategy(draft, (1,) * 5, rule="deterministic")
    as_tree.is_chain = False  # force the level-by-level tree drafting on the same template
    tree = demo.decode_all(target, as_tree, "tree", prompt_ids, NEW_TOKENS)
    assert tree.tokens == chain.tokens
    assert (tree.forwards, tree.accepted) == (chain.forwards, chain.accepted)
