"""No lane of any sampling / verification kernel addresses memory outside the tensor it reads or writes,
masked lanes included (tests/triton_bounds.py), on the edge cases where that goes wrong: empty batches,
requests without drafts, every draft accepted, rejections at the last draft, vocabularies at tile edges."""

import os

import pytest
import torch
from sampling_helpers import exact_probs, params
from triton_bounds import check_bounds

from specdec import _backend
from specdec.kernels import (
    counter_uniform,
    filtered_probs,
    sample,
    sample_probs,
    verify_chain,
    verify_chain_greedy,
    verify_tree,
    verify_tree_greedy,
)
from specdec.kernels.top_k_top_p import vocab_block

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="checks the interpreter's accesses")

VOCABS = [vocab_block(40) - 1, vocab_block(40), vocab_block(40) + 1]  # 31, 32, 33: tile edges


@pytest.fixture(autouse=True)
def _triton_checked():
    with _backend.use_backend("triton"), check_bounds():
        yield


def chain_batch(ks, vocab, accept_all_last: bool):
    """Chains whose last request accepts every draft (drafts certain under the target) or rejects its last."""
    offsets = torch.tensor([0, *ks]).cumsum(0).to(torch.int32)
    logits = torch.randn(sum(ks) + len(ks), vocab)
    tokens = torch.randint(0, vocab, (sum(ks),), dtype=torch.int32)
    b, lo = len(ks) - 1, int(offsets[-2])
    rows = torch.arange(ks[-1]) + lo + b
    logits[rows, tokens[lo:].long()] += 40.0  # p(draft) = 1 up to rounding
    if not accept_all_last:
        logits[rows[-1], tokens[-1]] = float("-inf")  # p = 0: the last draft is rejected
    return logits, tokens, offsets


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("rule", ["stochastic", "deterministic"])
@pytest.mark.parametrize("accept_all_last", [True, False])
def test_chains_stay_inside_their_buffers(vocab, rule, accept_all_last):
    ks = [2, 0, 3]
    logits, tokens, offsets = chain_batch(ks, vocab, accept_all_last)
    q = exact_probs(logits[torch.tensor([0, 1, 3, 4, 5])]) if rule == "stochastic" else None
    p = params(3, 0.9, 5, 0.9)._replace(temperature=torch.tensor([0.9, 0.0, 1.1]))
    r = verify_chain(logits, tokens, offsets, p, rule=rule, draft_probs=q)
    assert int(r.num_accepted[2]) == (3 if accept_all_last else 2)
    g = verify_chain_greedy(logits, tokens, offsets, params(3, 0.0))
    assert g.output_tokens.shape == (3, 4)


@pytest.mark.parametrize("rule", ["stochastic", "deterministic"])
def test_a_batch_without_drafts_stays_inside_its_buffers(rule):
    vocab = 33
    q = torch.empty(0, vocab) if rule == "stochastic" else None
    no_drafts, offsets = torch.empty(0, dtype=torch.int32), torch.zeros(3, dtype=torch.int32)
    r = verify_chain(torch.randn(2, vocab), no_drafts, offsets, params(2), rule=rule, draft_probs=q)
    assert r.num_accepted.tolist() == [0, 0] and ((r.output_tokens >= 0) & (r.output_tokens < vocab)).all()
    assert verify_chain_greedy(torch.randn(2, vocab), no_drafts, offsets, params(2, 0.0)).output_tokens.shape == (2, 1)


def test_empty_batches_launch_nothing_and_return_empty_results():
    vocab = 17
    empty_logits, none = torch.empty(0, vocab), torch.empty(0, dtype=torch.int32)
    one_offset = torch.zeros(1, dtype=torch.int32)
    assert verify_chain(empty_logits, none, one_offset, params(0), rule="deterministic").output_tokens.shape == (0, 1)
    tree = verify_tree(empty_logits, none, none, one_offset, params(0), rule="deterministic")
    assert tree.accepted_path.shape == (0, 1)
    assert verify_tree_greedy(empty_logits, none, none, one_offset, params(0, 0.0)).num_accepted.shape == (0,)
    assert sample(empty_logits, params(0)).tokens.shape == (0,)
    assert filtered_probs(empty_logits, params(0)).probs.shape == (0, vocab)
    assert sample_probs(empty_logits, params(0), counter=1).shape == (0,)


@pytest.mark.parametrize("vocab", VOCABS)
@pytest.mark.parametrize("rule", ["stochastic", "deterministic"])
def test_trees_stay_inside_their_buffers(vocab, rule):
    shapes = [[-1, 0, 0, 1], [-1], [-1, 0, 1, 2]]  # the last tree is a chain its drafts fully pass
    parents = torch.tensor([p for s in shapes for p in s], dtype=torch.int32)
    offsets = torch.tensor([0, 4, 5, 9], dtype=torch.int32)
    logits = torch.randn(9, vocab)
    tokens = torch.randint(0, vocab, (9,), dtype=torch.int32)
    logits[torch.tensor([5, 6, 7]), tokens[6:].long()] += 40.0
    q = exact_probs(logits) if rule == "stochastic" else None
    r = verify_tree(logits, tokens, parents, offsets, params(3, 1.0, 4, 0.9), rule=rule, draft_probs=q)
    assert int(r.num_accepted[2]) == 3
    assert verify_tree_greedy(logits, tokens, parents, offsets, params(3, 0.0)).accepted_path.shape == (3, 4)


@pytest.mark.parametrize("vocab", VOCABS)
def test_samplers_stay_inside_their_buffers(vocab):
    logits = torch.randn(3, vocab)
    logits[1, -1] += 30.0  # mass in the last, partial tile
    p = params(3, 0.8, 3, 0.9)._replace(temperature=torch.tensor([0.8, 1.0, 0.0]))
    assert ((sample(logits, p).tokens >= 0) & (sample(logits, p).tokens < vocab)).all()
    probs = filtered_probs(logits, p).probs
    probs[0] = 0.0  # a row without mass
    assert sample_probs(probs, p, counter=2).tolist()[0] == -1
    assert counter_uniform(torch.arange(vocab), torch.zeros(vocab, dtype=torch.int64), 1).shape == (vocab,)
