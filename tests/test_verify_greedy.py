"""The greedy fast path (verify_chain_greedy / verify_tree_greedy): the same results as the general ops at
temperature 0, an argmax comparison only, and a refusal instead of a wrong answer for sampled requests."""

import os

import pytest
import torch
from sampling_helpers import params

from specdec import _backend
from specdec.kernels import (
    ChainVerifyResult,
    TreeVerifyResult,
    verify_chain,
    verify_chain_greedy,
    verify_tree,
    verify_tree_greedy,
)
from specdec.kernels.verify_greedy import verify_chain_greedy_reference, verify_tree_greedy_reference


def greedy_chains(vocab=37):
    """Ragged chains whose drafts follow the target's argmax for a while: [4, 0, 3, 2, 5] drafts."""
    ks = [4, 0, 3, 2, 5]
    offsets = torch.tensor([0, *ks]).cumsum(0).to(torch.int32)
    logits = torch.randn(sum(ks) + len(ks), vocab) * 3
    tokens = torch.randint(0, vocab, (sum(ks),), dtype=torch.int32)
    for b, k in enumerate(ks):
        lo = int(offsets[b])
        argmax = logits[torch.arange(k) + lo + b].argmax(-1).to(torch.int32)  # rows scoring request b's drafts
        tokens[lo : lo + k] = torch.where(torch.rand(k) < 0.75, argmax, tokens[lo : lo + k])
    tokens[-1] = vocab  # an id outside the vocabulary is never accepted
    logits[5, 3] = float("nan")  # request 1 (its only row) cannot be sampled
    return logits, tokens, offsets, ks


def greedy_trees(vocab=29):
    """Trees whose children often carry their parent's argmax, duplicates and out-of-vocabulary ids included."""
    shapes = [[-1, 0, 0, 1, 1, 2], [-1], [-1, 0, 1, 2], [-1, 0, 0, 0, 3]]
    parents = torch.tensor([p for s in shapes for p in s], dtype=torch.int32)
    offsets = torch.tensor([0, *map(len, shapes)]).cumsum(0).to(torch.int32)
    logits = torch.randn(parents.numel(), vocab) * 3
    tokens = torch.randint(0, vocab, (parents.numel(),), dtype=torch.int32)
    for b, shape in enumerate(shapes):
        start = int(offsets[b])
        for i in range(1, len(shape)):
            if torch.rand(()) < 0.6:
                tokens[start + i] = logits[start + shape[i]].argmax()
    tokens[4] = tokens[3]  # duplicate siblings
    tokens[14] = -1
    logits[9, 0] = float("inf")  # request 2 (rows 7..10) cannot be sampled
    return logits, tokens, parents, offsets


def assert_same(a, b):
    for name, x, y in zip(type(a)._fields, a, b):
        assert torch.equal(x.cpu(), y.cpu()), f"{name} differs:\n{x}\n{y}"


def test_greedy_chains_equal_the_general_op_at_temperature_0(backend, device):
    logits, tokens, offsets, ks = greedy_chains()
    args = [t.to(device) for t in (logits, tokens, offsets)]
    q = torch.softmax(torch.randn(tokens.numel(), logits.shape[1]), -1).to(device)
    p = params(len(ks), 0.0, 5, 0.8, device=device)  # top-k / top-p do not matter to greedy requests
    for width in (None, 3):
        poison = ChainVerifyResult(torch.full((5, (width or 5) + 1), -7, dtype=torch.int32, device=device),
                                   torch.full((5,), -7, dtype=torch.int32, device=device),
                                   torch.ones(5, dtype=torch.bool, device=device))  # fmt: skip
        fast = verify_chain_greedy(*args, p, max_draft_len=width, out=poison)
        assert fast is poison
        assert_same(fast, verify_chain(*args, p, rule="deterministic", max_draft_len=width))
        assert_same(fast, verify_chain(*args, p, rule="stochastic", draft_probs=q, max_draft_len=width))
    assert fast.invalid.tolist() == [False, True, False, False, False]


def test_greedy_trees_equal_the_general_op_at_temperature_0(backend, device):
    logits, tokens, parents, offsets = greedy_trees()
    args = [t.to(device) for t in (logits, tokens, parents, offsets)]
    q = torch.softmax(torch.randn(tokens.numel(), logits.shape[1]), -1).to(device)
    p = params(4, 0.0, device=device)
    for depth in (None, 2):
        fast = verify_tree_greedy(*args, p, max_depth=depth)
        assert_same(fast, verify_tree(*args, p, rule="deterministic", max_depth=depth))
        assert_same(fast, verify_tree(*args, p, rule="stochastic", draft_probs=q, max_depth=depth))
    assert fast.invalid.tolist() == [False, False, True, False]


def test_the_references_follow_the_argmax():
    logits = torch.randn(4, 11)
    chain = logits[:3].argmax(-1).to(torch.int32)  # the target's own choices: all accepted
    r = verify_chain_greedy_reference(logits, chain, torch.tensor([0, 3], dtype=torch.int32), max_draft_len=3)
    assert r.num_accepted.tolist() == [3] and r.output_tokens[0].tolist() == logits.argmax(-1).tolist()
    top = int(logits[0].argmax())
    tree = torch.tensor([0, (top + 1) % 11, top, 0], dtype=torch.int32)  # the second child is the argmax
    parents = torch.tensor([-1, 0, 0, 1], dtype=torch.int32)
    t = verify_tree_greedy_reference(logits, tree, parents, torch.tensor([0, 4], dtype=torch.int32), max_depth=2)
    assert t.accepted_path[0].tolist() == [0, 2, -1]
    assert t.output_tokens[0].tolist() == [top, int(logits[2].argmax()), -1]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="counts the interpreter's launches")
def test_the_triton_fast_path_launches_argmax_statistics_and_the_walk_only(monkeypatch):
    import triton.runtime.interpreter as interpreter

    launched = []
    original = interpreter.GridExecutor.__call__

    def record(self, *args, **kwargs):
        launched.append(self.fn.__name__)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(interpreter.GridExecutor, "__call__", record)
    logits, tokens, offsets, ks = greedy_chains()
    with _backend.use_backend("triton"):
        verify_chain_greedy(logits, tokens, offsets, params(len(ks), 0.0))
        assert launched == ["_row_stats_kernel", "_tree_walk_kernel"]  # no filter, uniforms or tile sampling
        launched.clear()
        verify_chain(logits, tokens, offsets, params(len(ks), 0.0), rule="deterministic")
    assert launched == ["_threshold_kernel", "_row_stats_kernel", "_tree_walk_kernel"]  # the general op's pipeline


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="checks the interpreter's accesses")
@pytest.mark.parametrize("chain", [True, False])
def test_the_greedy_walk_reads_no_logits_softmax_statistics_or_parameters(chain):
    """The walk's greedy rule reads the argmax statistics, the drafts and the offsets only: the statistics' sum,
    which stands in for every other input, is an empty tensor here, and any access to it (masked lanes
    included) fails the launch."""
    from triton_bounds import check_bounds

    from specdec.kernels.target_stats import row_stats_triton
    from specdec.kernels.top_k_top_p import vocab_block
    from specdec.kernels.tree_walk import greedy_walk_triton

    if chain:
        logits, tokens, offsets, ks = greedy_chains()
        parents, reference = tokens, verify_chain_greedy_reference(logits, tokens, offsets, max_draft_len=max(ks))
    else:
        logits, tokens, parents, offsets = greedy_trees()
        reference = verify_tree_greedy_reference(logits, tokens, parents, offsets, max_depth=3)
    vocab, block = logits.shape[1], vocab_block(logits.shape[1])
    width, batch = reference.output_tokens.shape[1], offsets.numel() - 1
    stats = row_stats_triton(logits, None, None, block, argmax_only=True)._replace(sum=torch.empty(0))
    out = (torch.full((batch, width), -7, dtype=torch.int32), torch.full((batch,), -7, dtype=torch.int32),
           torch.full((batch, width), -7, dtype=torch.int32), torch.ones(batch, dtype=torch.bool))  # fmt: skip
    with check_bounds():
        greedy_walk_triton(tokens, parents, offsets, stats, out, chain=chain, vocab=vocab, block=block,
                           n_tiles=stats.max.shape[1], width=width)  # fmt: skip
    assert torch.equal(out[0], reference.output_tokens) and torch.equal(out[1], reference.num_accepted)
    assert torch.equal(out[3], reference.invalid)
    if not chain:
        assert torch.equal(out[2], reference.accepted_path)


def test_a_sampled_request_is_refused_not_answered_greedily():
    logits, tokens, offsets, ks = greedy_chains()
    p = params(len(ks), 0.0)
    for bad in (0.7, float("nan")):
        sampled = p._replace(temperature=torch.tensor([0.0, 0.0, bad, 0.0, 0.0]))
        with pytest.raises(ValueError, match="params.temperature must be <= 0 for every request of verify_chain_gr"):
            verify_chain_greedy(logits, tokens, offsets, sampled)
    tree_logits, tree_tokens, parents, node_offsets = greedy_trees()
    with pytest.raises(ValueError, match="params.temperature must be <= 0 for every request of verify_tree_greedy"):
        verify_tree_greedy(tree_logits, tree_tokens, parents, node_offsets, params(4, 1.0))


def test_greedy_bad_inputs():
    logits, tokens, offsets, ks = greedy_chains()
    p = params(len(ks), 0.0)
    with pytest.raises(TypeError, match="draft_tokens"):
        verify_chain_greedy(logits, tokens.long(), offsets, p)
    with pytest.raises(ValueError, match="target_logits must have T \\+ B"):
        verify_chain_greedy(logits[1:], tokens, offsets, p)
    with pytest.raises(TypeError, match="out must be a ChainVerifyResult"):
        verify_chain_greedy(logits, tokens, offsets, p, out=tuple(verify_chain_greedy(logits, tokens, offsets, p)))
    tree_logits, tree_tokens, parents, node_offsets = greedy_trees()
    later_parent = parents.clone()
    later_parent[1] = 2
    with pytest.raises(ValueError, match="parents come first"):
        verify_tree_greedy(tree_logits, tree_tokens, later_parent, node_offsets, params(4, 0.0))
    with pytest.raises(ValueError, match="params.seed must have shape"):
        verify_tree_greedy(tree_logits, tree_tokens, parents, node_offsets,
                           params(4, 0.0)._replace(seed=torch.zeros(3, dtype=torch.int64)))  # fmt: skip
    narrow = torch.empty(4, 2, dtype=torch.int32)  # the trees are 3 deep: 4 columns
    bad_out = TreeVerifyResult(narrow, torch.empty(4, dtype=torch.int32), narrow, torch.empty(4, dtype=torch.bool))
    with pytest.raises(ValueError, match="out.output_tokens must have shape"):
        verify_tree_greedy(tree_logits, tree_tokens, parents, node_offsets, params(4, 0.0), out=bad_out)
