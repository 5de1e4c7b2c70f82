"""EAGLE drafting (``specdec.decoding.eagle``): EAGLE-1 static and EAGLE-2 dynamic trees from an ``EagleHead``.

Greedy output equals the target's greedy output on the embedded pair's held-out prompts (batch 1 and a
ragged batch of 8); sampling follows the target's exact joint (T = 1, top-p 0.9) with a random head far
from the target; a depth-d tree costs d head forwards over new rows only; one host sync per step; the
dynamic tree's rerank always selects a tree; bad arguments are refused by name.
"""

import dataclasses
import math

import pytest
import torch
from helpers import random_eagle_head, random_model, tiny_config
from sampling_helpers import model_joint
from sync_counter import events_per_step, run_under_sync_debug_error

from specdec import use_backend
from specdec.decoding import SpeculativeDecoder
from specdec.decoding.autoregressive import generate as autoregressive_generate
from specdec.decoding.eagle import EagleStrategy
from specdec.decoding.eagle_trees import rerank
from specdec.decoding.proposal import DeviceTrees, Proposal, check_proposal
from specdec.model import EagleHead
from specdec.testing import ASSETS, heldout_token_ids, load_pair

pytestmark = pytest.mark.usefixtures("torch_backend")

EAGLES = {
    "eagle2": lambda head: EagleStrategy(head, tree_budget=32, depth=5, top_k=4, confidence_temperature=0.3),
    "eagle1": lambda head: EagleStrategy(head, static_tree="default", tree_budget=24, depth=5, top_k=4),
}


@pytest.fixture(scope="module")
def embedded():
    target, _, tokenizer = load_pair()
    head = EagleHead.from_pretrained(ASSETS.parent / "eagle", target)
    prompts = heldout_token_ids(tokenizer)[:8]
    return target, head, prompts


@pytest.fixture(scope="module")
def tiny():
    target = random_model(tiny_config(vocab_size=48), seed=0)
    return target, random_eagle_head(target, seed=1)


# ---- greedy: the target's own tokens ------------------------------------------------------------------


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("kind", list(EAGLES))
def test_greedy_equals_target_greedy_on_heldout_prompts(embedded, kind, batch):
    target, head, prompts = embedded
    prompts = prompts[:batch]
    max_new = [48 - 5 * b for b in range(batch)]  # requests end at different steps: ragged trees near the end
    expected = autoregressive_generate(target, prompts, max_new_tokens=max_new, eos_token_id=None)
    result = SpeculativeDecoder(target, EAGLES[kind](head), adaptive=False).generate(
        prompts, max_new_tokens=max_new, eos_token_id=None
    )
    for b in range(batch):
        assert result.tokens[b] == expected[b], f"request {b} diverged"
    generated = sum(s.generated for s in result.stats)
    forwards = sum(s.target_forwards for s in result.stats)
    assert generated / forwards > 3.0, f"tau {generated / forwards:.2f}: the shipped head should draft well"


@pytest.mark.parametrize("kind", list(EAGLES))
def test_greedy_with_a_random_head_and_a_paged_cache(tiny, kind):
    target, head = tiny
    prompts = [[3, 9, 4, 3, 9, 4, 3], [7], [5, 5, 2, 8], [1, 2]]
    options = dict(max_new_tokens=[20, 9, 14, 1], eos_token_id=None)
    expected = autoregressive_generate(target, prompts, **options)
    decoder = SpeculativeDecoder(target, EAGLES[kind](head), cache_layout="paged", block_size=4)
    assert decoder.generate(prompts, **options).tokens == expected


@pytest.mark.parametrize("kind", list(EAGLES))
def test_per_request_limits_an_adaptive_caller_sets_are_kept(tiny, kind):
    """Each step, request r gets its own node and depth limits (as an adaptive caller would vary them):
    every tree keeps within them, ragged across the batch, and greedy output stays the target's."""
    target, head = tiny
    strategy = EAGLES[kind](head)
    propose, seen = strategy.propose, []

    def limited(step):
        nodes = [(3 + 5 * r + len(seen)) % 11 + 1 for r in range(len(step.running))]
        depths = [min(d, (r + len(seen)) % 4) for r, d in enumerate(step.max_depth)]
        proposal = propose(dataclasses.replace(step, max_nodes=nodes, max_depth=depths))
        seen.append((proposal.counts, proposal.depths, nodes, depths))
        return proposal

    strategy.propose = limited
    prompts = [[3, 9, 4, 3, 9, 4, 3], [7], [5, 5, 2, 8], [1, 2]]
    expected = autoregressive_generate(target, prompts, max_new_tokens=16, eos_token_id=None)
    assert SpeculativeDecoder(target, strategy).generate(prompts, max_new_tokens=16, eos_token_id=None).tokens == (
        expected
    )
    for counts, depths, nodes, limits in seen:
        assert all(c <= n for c, n in zip(counts, nodes)) and all(d <= lim for d, lim in zip(depths, limits))
    assert any(len(set(counts)) > 1 for counts, *_ in seen), "no ragged step"


# ---- sampling: exactly the target's distribution ------------------------------------------------------


@pytest.mark.parametrize("vocabulary", [None, (0, 2, 3)], ids=["whole-vocabulary", "draft-vocabulary"])
@pytest.mark.parametrize("kind", ["eagle2", "eagle1"])
def test_first_tokens_follow_the_exact_model_joint(kind, vocabulary):
    # The first token comes from the prefill; the next two from one drafted tree of depth 2. With a draft
    # vocabulary (``set_draft_vocabulary``) of 3 of the 4 tokens, token 1 is never drafted, yet emitted as often as
    # the target says.
    vocab, steps, draws, temperature, top_p = 4, 3, 20000, 1.0, 0.9
    target = random_model(tiny_config(vocab_size=vocab, num_layers=1), seed=5, scale=1.5)
    head = random_eagle_head(target, seed=6).set_draft_vocabulary(vocabulary)
    strategy = {
        "eagle2": EagleStrategy(head, tree_budget=5, depth=2, top_k=2),
        "eagle1": EagleStrategy(head, static_tree=[[0], [1], [0, 0], [1, 0]], depth=2, top_k=2),
    }[kind]
    prompt = [1, 2, 3]
    result = SpeculativeDecoder(target, strategy).generate(
        [prompt] * draws, max_new_tokens=steps, temperature=temperature, top_p=top_p, seed=1000, eos_token_id=None
    )
    index = torch.tensor([sum(t * vocab ** (steps - 1 - i) for i, t in enumerate(toks)) for toks in result.tokens])
    empirical = torch.bincount(index, minlength=vocab**steps).double() / draws
    exact = model_joint(target, prompt, steps, temperature, 0, top_p)
    support = int((exact > 0).sum())
    expected_tvd = 0.5 * math.sqrt(2 * (support - 1) / (math.pi * draws))
    tvd = 0.5 * (empirical - exact).abs().sum().item()
    assert tvd < 2.5 * expected_tvd, f"TVD {tvd:.4f} vs expected noise {expected_tvd:.4f}"
    assert (empirical[exact == 0] == 0).all(), "a filtered-out sequence was emitted"
    hotter = model_joint(target, prompt, steps, temperature * 1.3, 0, top_p)
    assert 0.5 * (empirical - hotter).abs().sum().item() > 2.5 * expected_tvd, "the test cannot tell T=1 from T=1.3"
    assert sum(s.accepted for s in result.stats) > 0 and sum(s.drafted for s in result.stats) > draws
    if vocabulary is not None:
        assert any(1 in toks[1:] for toks in result.tokens), "token 1, outside the draft vocabulary, is still emitted"


# ---- cost: d head forwards over new rows only ---------------------------------------------------------


class HeadRecorder:
    """Records every head forward: (rows, whether it is a tree level starting below the cache's length)."""

    def __init__(self, head):
        self.calls, self._forward = [], head.forward
        head.forward = self

    def __call__(self, features, tokens, positions, metadata, cache, logits_rows=None):
        self.calls.append((features.shape[0], metadata.tree_start is not None))
        return self._forward(features, tokens, positions, metadata, cache, logits_rows)


@pytest.mark.parametrize("kind", ["eagle2", "eagle1"])
def test_a_depth_d_tree_costs_d_head_forwards_over_new_nodes(tiny, kind):
    target, _ = tiny
    head = random_eagle_head(target, seed=1)  # its own copy: the recorder replaces its forward
    recorder = HeadRecorder(head)
    k, depth = 3, 4
    static = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0], [0, 0, 0, 0]]
    strategy = EagleStrategy(
        head, tree_budget=40, depth=depth, top_k=k, static_tree=static if kind == "eagle1" else None
    )
    fed_per_level = [2, 2, 1]  # static: the depth-1..3 nodes that have children
    strategy_commit = strategy.commit
    accepted: list[list[int]] = []
    strategy.commit = lambda result: (accepted.append(list(result.accepted)), strategy_commit(result))
    prompts = [[3, 9, 4, 3, 9, 4, 3], [7, 1], [5, 5, 2, 8]]
    steps = SpeculativeDecoder(target, strategy, adaptive=False).stream(prompts, max_new_tokens=40, eos_token_id=None)
    next(steps)  # the prefill: one causal forward over the prompts but their last tokens
    assert recorder.calls == [(sum(len(p) - 1 for p in prompts), False)]
    for _ in range(3):  # far from the end: every request drafts the full depth
        recorder.calls.clear()
        running = len(accepted[-1])
        next(steps)
        catch_up, *levels = recorder.calls
        assert len(recorder.calls) == depth, "a depth-d tree costs d head forwards"
        assert catch_up == (sum(a + 1 for a in accepted[-2]), False), "the catch-up feeds the accepted nodes once"
        if kind == "eagle2":
            assert levels == [(k * running, True)] * (depth - 1), "each level feeds its k expanded nodes only"
        else:
            assert levels == [(n * running, True) for n in fed_per_level]


# ---- host synchronisation ------------------------------------------------------------------------------


def syncs_per_step(decoder, prompts, **sampling) -> list[list[tuple[str, str]]]:
    """Each step's would-be synchronisations as (what, file)."""
    per_step = events_per_step(decoder, prompts, **sampling)
    return [[(what, where.split(":")[0]) for what, where in events] for events in per_step]


SMALL = {  # small trees: the sampled case runs the Triton kernels in the interpreter
    "eagle2": lambda head: EagleStrategy(head, tree_budget=6, depth=3, top_k=2),
    "eagle1": lambda head: EagleStrategy(head, static_tree=[[0], [1], [0, 0], [0, 0, 0]], depth=3, top_k=2),
}


@pytest.mark.parametrize("kind", list(SMALL))
def test_greedy_generation_syncs_once_per_step(tiny, kind):
    target, head = tiny
    decoder = SpeculativeDecoder(target, SMALL[kind](head), cache_layout="paged", block_size=4)
    prompts = [[3, 9, 4, 3, 9, 4, 3], [7, 1], [5, 5, 2, 8]]
    with use_backend("torch"):
        per_step = syncs_per_step(decoder, prompts, max_new_tokens=[12, 5, 9], eos_token_id=None, seed=0)
    assert len(per_step) >= 4
    for i, events in enumerate(per_step):
        assert events == [("Tensor.tolist", "_transfer.py")], f"step {i}: {events}"


@pytest.mark.interpreter
@pytest.mark.parametrize("kind", list(SMALL))
def test_sampled_generation_syncs_once_per_step_on_the_triton_path(tiny, kind):
    target, head = tiny
    decoder = SpeculativeDecoder(target, SMALL[kind](head))
    sampling = dict(max_new_tokens=[6, 4], temperature=[1.0, 0.0], top_k=[5, 0], top_p=[0.9, 1.0], seed=3)
    with use_backend("triton"):
        per_step = syncs_per_step(decoder, [[3, 9, 4, 3, 9], [7, 1, 7]], eos_token_id=None, **sampling)
    assert len(per_step) >= 2
    for i, events in enumerate(per_step):
        assert events == [("Tensor.tolist", "_transfer.py")], f"step {i}: {events}"


@pytest.mark.gpu
@pytest.mark.parametrize("kind", list(SMALL))
def test_generation_runs_under_sync_debug_mode_error(kind):
    """On a GPU: any synchronising CUDA call but the read-back raises (the GPU's own path: this module's
    tests force the PyTorch bodies, whose references read sizes back)."""
    target = random_model(tiny_config(vocab_size=48), seed=0).to("cuda")
    head = random_eagle_head(target, seed=1).to("cuda")
    with use_backend("auto"):
        run_under_sync_debug_error(SpeculativeDecoder(target, SMALL[kind](head)))


# ---- the dynamic tree's rerank ---------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_rerank_keeps_the_most_confident_nodes_and_their_ancestors(seed):
    gen = torch.Generator().manual_seed(seed)
    rows, k, levels = 3, 3, 3
    # drafted nodes level by level: k at depth 1, k*k below (children of k expanded nodes of the level above)
    parents, depth = [-1] * k, [1] * k
    for level in range(2, levels + 1):
        above = [i for i, d in enumerate(depth) if d == level - 1]
        expanded = [above[j] for j in torch.randperm(len(above), generator=gen)[:k].tolist()]
        parents += [p for p in expanded for _ in range(k)]
        depth += [level] * (k * k)
    m = len(parents)
    step = torch.randint(0, 3, (rows, m), generator=gen).float() * -0.5  # coarse: many equal confidences
    scores = torch.zeros(rows, m)
    for i, p in enumerate(parents):
        scores[:, i] = step[:, i] + (scores[:, p] if p >= 0 else 0)
    tokens = torch.randint(0, 100, (rows, m), generator=gen)
    max_depth, keep = torch.tensor([3, 2, 1]), torch.tensor([9, 7, 2])
    width = 10
    tree_tokens, tree_parents = rerank(
        scores, tokens, torch.tensor(parents).expand(rows, m), torch.tensor(depth), torch.tensor([5, 6, 7]),
        max_depth, keep, width,
    )  # fmt: skip
    for r in range(rows):
        n = int(keep[r])
        valid = [i for i in range(m) if depth[i] <= max_depth[r]]
        best = sorted(valid, key=lambda i: (-scores[r, i].item(), i))[:n]
        chosen = sorted(best)
        assert tree_tokens[r, 0] == 5 + r and tree_parents[r, 0] == -1
        assert tree_tokens[r, 1 : n + 1].tolist() == [tokens[r, i].item() for i in chosen]
        local = {node: j + 1 for j, node in enumerate(chosen)}
        expected_parents = [0 if parents[i] < 0 else local[parents[i]] for i in chosen]  # KeyError: not a tree
        assert tree_parents[r, 1 : n + 1].tolist() == expected_parents


# ---- bad input ---------------------------------------------------------------------------------------


def test_bad_arguments_are_refused_by_name(tiny):
    target, head = tiny
    vocab = target.config.vocab_size
    for kwargs, match in [
        (dict(tree_budget=0), "tree_budget must be an int >= 1"),
        (dict(depth=0), "depth must be an int >= 1"),
        (dict(top_k=0), "top_k must be an int >= 1"),
        (dict(top_k=vocab + 1), f"top_k must be at most the vocabulary \\({vocab}\\)"),
        (dict(confidence_temperature=0.0), "confidence_temperature must be a positive number"),
        (dict(static_tree=[[0], [0, 0]], depth=1), r"static_tree\[1\] = \[0, 0\] is 2 deep"),
        (dict(static_tree=[[5]], top_k=2), r"static_tree\[0\] = \[5\] takes candidate 5; top_k is 2"),
        (dict(static_tree=[[0], [1]], tree_budget=2), "more than the budget of 2"),
    ]:
        with pytest.raises(ValueError, match=match):
            EagleStrategy(head, **kwargs)
    with pytest.raises(TypeError, match="head must be an EagleHead"):
        EagleStrategy(target)


def test_a_head_built_for_another_target_is_refused(tiny):
    target, head = tiny
    other = random_model(tiny_config(vocab_size=48), seed=9)  # same sizes, other weights
    with pytest.raises(ValueError, match="head was built for another target model"):
        SpeculativeDecoder(other, EagleStrategy(head))
    small = random_model(tiny_config(vocab_size=32), seed=9)
    with pytest.raises(ValueError, match="its vocab_size is 48, the target's is 32"):
        EagleHead(head.config, small)


def test_budget_one_drafts_nothing(tiny):
    target, head = tiny
    prompts = [[3, 9, 4], [7, 1]]
    result = SpeculativeDecoder(target, EagleStrategy(head, tree_budget=1)).generate(
        prompts, max_new_tokens=6, eos_token_id=None
    )
    assert result.tokens == autoregressive_generate(target, prompts, max_new_tokens=6, eos_token_id=None)
    assert all(s.drafted == 0 for s in result.stats)


def test_device_trees_are_checked_on_their_host_facts():
    tokens = torch.tensor([5, 7, 9, 4])
    good = DeviceTrees(torch.tensor([-1, 0, 0, -1], dtype=torch.int32), [3, 1], [1, 0])
    check_proposal(Proposal(tokens, good, rule="deterministic"), "eagle", 2, [3, 1], [1, 0])
    with pytest.raises(ValueError, match="eagle proposed tree 0 with 3 nodes and depth 1; the limits were 2 nodes"):
        check_proposal(Proposal(tokens, good, rule="deterministic"), "eagle", 2, [2, 1], [1, 0])
    with pytest.raises(ValueError, match="eagle proposed tree 0 with 3 nodes and depth 3"):
        deep = DeviceTrees(good.parents, [3, 1], [3, 0])  # deeper than its nodes allow
        check_proposal(Proposal(tokens, deep, rule="deterministic"), "eagle", 2, [3, 1], [5, 5])
    with pytest.raises(TypeError, match="eagle's DeviceTrees.parents must have dtype int32"):
        wrong = DeviceTrees(good.parents.long(), [3, 1], [1, 0])
        check_proposal(Proposal(tokens, wrong, rule="deterministic"), "eagle", 2, [3, 1], [1, 0])
    with pytest.raises(ValueError, match="eagle proposed 2 trees for 3 running requests"):
        check_proposal(Proposal(tokens, good, rule="deterministic"), "eagle", 3, [3, 1, 1], [1, 0, 0])
