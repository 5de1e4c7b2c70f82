"""An EAGLE-1/2 head drafting over a draft vocabulary (``EagleHead.set_draft_vocabulary``): greedy output equal to the
target's and every draft inside the vocabulary, for EAGLE-2's tree, EAGLE-1's static tree and the top-1 chain (the
C++ op and the level-by-level path drafting the same), contiguous and paged caches; the LM head's rows following the
target's; refusals by name; the shipped head over the target's frequent tokens. Sampling exact at T=1 with a token
outside the vocabulary: ``test_eagle_strategy.py``'s TVD test, over a draft vocabulary too."""

import pytest
import torch
from helpers import random_eagle_head, random_model, tiny_config

import specdec.decoding.eagle as eagle_strategy
from specdec import use_backend
from specdec.decoding import SpeculativeDecoder
from specdec.decoding.autoregressive import generate as autoregressive_generate
from specdec.decoding.eagle import EagleStrategy
from specdec.model.draft_forward_cpu import _has_head_chain_op

VOCAB = 48
KINDS = {
    "eagle2": lambda head: EagleStrategy(head, tree_budget=12, depth=4, top_k=3),
    "eagle1": lambda head: EagleStrategy(head, static_tree="default", tree_budget=12, depth=4, top_k=3),
    "top-1 chain": lambda head: EagleStrategy(head, tree_budget=6, depth=5, top_k=1),
}


@pytest.fixture(scope="module")
def tiny():
    target = random_model(tiny_config(vocab_size=VOCAB, num_layers=3), seed=0)
    head = random_eagle_head(target, seed=1)
    vocabulary = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(2))[:20]
    return target, head.set_draft_vocabulary(vocabulary)


def recorded_drafts(strategy) -> list[int]:
    """The tokens ``strategy`` drafts from now on (each tree's nodes after its root)."""
    propose, drafted = strategy.propose, []

    def recorded(step):
        proposal = propose(step)
        tokens, start = proposal.tokens.tolist(), 0
        for count in proposal.counts:
            drafted.extend(tokens[start + 1 : start + count])
            start += count
        return proposal

    strategy.propose = recorded
    return drafted


@pytest.mark.parametrize("path", ["torch", "cpu"])
@pytest.mark.parametrize("layout", ["contiguous", "paged"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_greedy_equals_target_greedy_and_drafts_stay_in_the_vocabulary(tiny, kind, layout, path, monkeypatch):
    """``cpu``: the CPU's own path (the top-1 chain in one C++ call where the extension has the op); ``torch``: every op
    in PyTorch (the chain level by level)."""
    target, head = tiny
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    prompts = [[3, 9, 4, 3, 9, 4, 3], [7], [5, 5, 2, 8], [1, 2]]
    options = dict(max_new_tokens=[20, 9, 14, 1], eos_token_id=None)
    with use_backend("torch" if path == "torch" else "auto"):
        expected = autoregressive_generate(target, prompts, **options)
        strategy = KINDS[kind](head)
        drafted = recorded_drafts(strategy)
        decoder = SpeculativeDecoder(target, strategy, adaptive=False, cache_layout=layout, block_size=4)
        assert decoder.generate(prompts, **options).tokens == expected
    vocabulary = set(head.draft_ids.tolist())
    assert len(drafted) > 30 and set(drafted) <= vocabulary, sorted(set(drafted) - vocabulary)
    assert any(t not in vocabulary for toks in expected for t in toks), "the target should emit tokens never drafted"


@pytest.mark.skipif(not _has_head_chain_op(), reason="specdec._C without head_chain_greedy_cpu")
def test_the_chain_op_drafts_what_the_level_by_level_path_drafts(tiny, monkeypatch):
    target, head = tiny
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    prompts = [[3, 9, 4, 3, 9, 4, 3], [5, 5, 2, 8]]
    drafts, calls = {}, []
    chain = eagle_strategy.EagleStrategy._draft_chain
    monkeypatch.setattr(eagle_strategy.EagleStrategy, "_draft_chain", lambda *a: calls.append(1) or chain(*a))
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(eagle_strategy, "head_chain_available", lambda head, cache: False)
        strategy = KINDS["top-1 chain"](head)
        drafts[fused] = recorded_drafts(strategy)
        SpeculativeDecoder(target, strategy, adaptive=False).generate(prompts, max_new_tokens=16, eos_token_id=None)
    assert calls and drafts[True] == drafts[False] and len(drafts[True]) > 20


def test_the_lm_head_rows_follow_the_target_and_none_restores_the_vocabulary():
    target = random_model(tiny_config(vocab_size=VOCAB), seed=0)
    head = random_eagle_head(target, seed=1).set_draft_vocabulary(torch.tensor([30, 2, 17]))
    assert head.draft_ids.tolist() == [2, 17, 30] and head.draft_vocab_size == 3
    assert torch.equal(head.target_ids(torch.tensor([[2, 0], [1, 1]])), torch.tensor([[30, 2], [17, 17]]))
    assert torch.equal(head.lm_head_weight, target.lm_head_weight[[2, 17, 30]])
    with torch.no_grad():
        target.lm_head_weight[17] += 1.0  # changed in place: the copy of its rows is made again
    assert torch.equal(head.lm_head_weight, target.lm_head_weight[[2, 17, 30]])
    with pytest.raises(ValueError, match="top_k must be at most the vocabulary \\(3\\)"):
        EagleStrategy(head, tree_budget=8, depth=2, top_k=4)
    head.set_draft_vocabulary(None)
    assert head.lm_head_weight is target.lm_head_weight and head.draft_vocab_size == VOCAB


@pytest.mark.parametrize(
    "token_ids, match",
    [
        ([], "non-empty 1-D"),
        ([[1, 2]], "non-empty 1-D"),
        ([0.5, 1.0], "integer target ids"),
        ([True, False], "a bool mask"),
        ([-1, 3], r"in \[0, 48\), got -1 .. 3"),
        ([3, VOCAB], r"in \[0, 48\), got 3 .. 48"),
        ([4, 9, 4], "distinct, got 4 more than once"),
        ({"a": 1}, r"integer target ids, got \{'a': 1\}"),
        (7, "integer target ids, got 7"),
    ],
)
def test_bad_vocabularies_are_refused_by_name(token_ids, match):
    head = random_eagle_head(random_model(tiny_config(vocab_size=VOCAB), seed=0), seed=1)
    with pytest.raises(ValueError, match="token_ids must be") as error:
        head.set_draft_vocabulary(token_ids)
    assert error.match(match) and head.draft_ids is None


def test_the_shipped_head_over_the_frequent_tokens(monkeypatch):
    """The shipped EAGLE head over the embedded target's 1024 most frequent tokens: greedy output equal to the
    target's on held-out prompts, every draft among those tokens."""
    from specdec.cli.demo import eagle_row
    from specdec.testing import frequent_token_ids, heldout_token_ids, load_pair

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    target, _, tokenizer = load_pair()
    prompts = heldout_token_ids(tokenizer)[:2]
    label, strategy = eagle_row(target, frequent=True, top_k=1, tree_budget=7, depth=6)
    assert "1024-token draft vocabulary" in label
    drafted = recorded_drafts(strategy)
    options = dict(max_new_tokens=32, eos_token_id=None)
    expected = autoregressive_generate(target, prompts, **options)
    assert SpeculativeDecoder(target, strategy, adaptive=False).generate(prompts, **options).tokens == expected
    frequent = frequent_token_ids()
    assert frequent.numel() == 1024 and torch.equal(frequent, frequent.unique())
    assert len(drafted) > 20 and set(drafted) <= set(frequent.tolist())
