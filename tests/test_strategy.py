"""The strategy contract (specdec.decoding.strategy): a drafter written against it alone plugs into the
engine, the engine refuses one that breaks it, and the shipped strategies honour per-request limits."""

import dataclasses
import random

import pytest
import torch
from helpers import forward_prompts, i32, noisy_copy, random_model, rel_err, tiny_config

from specdec.decoding import (
    BaseStrategy,
    DraftModelStrategy,
    NgramStrategy,
    NoDraft,
    Prefill,
    Proposal,
    SpeculativeDecoder,
    StepContext,
    StepResult,
    Strategy,
)
from specdec.decoding.autoregressive import generate as autoregressive_generate
from specdec.decoding.proposal import tree_metadata_on
from specdec.decoding.strategy import StrategyHooks
from specdec.kernels import build_tree_metadata
from specdec.kernels.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("torch_backend")

VOCAB = 8  # small, so random draft tokens are often right and paths of every length get accepted


@pytest.fixture(scope="module")
def target():
    return random_model(tiny_config(vocab_size=VOCAB), seed=0)


class RandomTrees:
    """A drafter that knows nothing but the protocol: random trees within the limits, random tokens.

    It also records what the engine hands it, to check the contract: the prompt features at
    prefill, and after every verification the committed length with the target's feature of the
    last accepted node (what Medusa heads and EAGLE read next).
    """

    name = "random trees"
    max_nodes = 6
    max_depth = 3

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.features: dict[int, list[tuple[int, torch.Tensor]]] = {}
        self.prefill_rows = None
        self.attached = None

    def attach(self, target) -> None:
        self.attached = target

    def prefill(self, prefill: Prefill) -> None:
        self.prefill_rows = (prefill.hidden.shape[0], prefill.q_offsets.tolist(), [len(p) for p in prefill.prompts])

    def propose(self, step: StepContext) -> Proposal:
        trees, tokens = [], []
        for root, nodes, depth_limit in zip(step.roots, step.max_nodes, step.max_depth):
            parents, depth = [-1], [0]
            for i in range(1, self.rng.randint(1, nodes)):
                options = [j for j in range(i) if depth[j] < depth_limit]
                if not options:
                    break
                parents.append(self.rng.choice(options))
                depth.append(depth[parents[-1]] + 1)
            trees.append(parents)
            tokens += [root] + [self.rng.randrange(VOCAB) for _ in parents[1:]]
        return Proposal(torch.tensor(tokens, device=step.device), trees, rule="deterministic")

    def commit(self, result: StepResult) -> None:
        assert result.accepted_path.shape[0] == len(result.running) == len(result.accepted)
        assert result.hidden.shape[0] == result.node_offsets[-1].item()
        for r, b in enumerate(result.running):
            path = result.accepted_path[r]
            assert path[0].item() == 0 and (path[: result.accepted[r] + 1] >= 0).all()
            last = result.node_offsets[r] + path[result.accepted[r]]
            self.features.setdefault(b, []).append((result.lengths[b], result.hidden[last].clone()))


@pytest.mark.parametrize("batch", [1, 5])
def test_a_drafter_written_against_the_protocol_alone_gives_target_greedy(target, batch):
    prompts = [[1 + b % 3, 2, 3, b % VOCAB, 4][: 2 + b] for b in range(batch)]
    limits = [24, 7, 1, 16, 0][:batch]
    expected = autoregressive_generate(target, prompts, max_new_tokens=limits, eos_token_id=None)
    strategy = RandomTrees(seed=batch)
    assert isinstance(strategy, Strategy)
    decoder = SpeculativeDecoder(target, strategy, adaptive=False)  # random drafts: adaptive would stop drafting
    assert strategy.attached is target
    result = decoder.generate(prompts, max_new_tokens=limits, eos_token_id=None)
    assert result.tokens == expected
    assert sum(s.accepted for s in result.stats) > 0, "random trees over 8 tokens should hit sometimes"
    # Prefill: one hidden row per prompt token of the requests that run (a 0-token request sends none).
    running_lengths = [len(p) if m > 0 else 0 for p, m in zip(prompts, limits)]
    assert strategy.prefill_rows[0] == sum(running_lengths)
    assert strategy.prefill_rows[2] == running_lengths
    # Features: after each verification, the last accepted node's hidden state is the target's feature at
    # position length - 1 of the committed text, as a plain forward over that text computes it.
    for b, records in strategy.features.items():
        text = prompts[b] + result.tokens[b]
        assert [n for n, _ in records] == sorted({n for n, _ in records}), "committed lengths only grow"
        _, hidden, _ = forward_prompts(target, [text[: records[-1][0]]])
        for length, feature in records:
            assert rel_err(feature, hidden[length - 1]) < 1e-4, f"request {b}, committed length {length}"


class Broken(NoDraft):
    """NoDraft with one thing wrong in its proposals."""

    def __init__(self, fault):
        self.fault = fault
        self.name = f"broken ({fault})"

    def propose(self, step):
        roots = torch.tensor(step.roots)
        n = len(step.running)
        if self.fault == "type":
            return roots
        if self.fault == "count":
            return Proposal(roots[:1].repeat(n + 1), [[-1]] * (n + 1), rule="deterministic")
        if self.fault == "too big":
            return Proposal(roots.repeat_interleave(2), [[-1, 0]] * n, rule="deterministic")
        if self.fault == "parents":
            return Proposal(roots.repeat_interleave(2), [[0, 0]] * n, rule="deterministic")
        return Proposal(roots.repeat(2), [[-1]] * n, rule="deterministic")  # tokens of the wrong size


@pytest.mark.parametrize(
    "fault, error, match",
    [
        ("type", TypeError, r"broken \(type\).propose must return a Proposal"),
        ("count", ValueError, r"broken \(count\) proposed 2 trees for 1 running requests"),
        ("too big", ValueError, r"broken \(too big\) proposed tree 0 with 2 nodes .* limits were 1 nodes"),
        ("parents", ValueError, r"broken \(parents\) proposed tree 0 with parents \[0, 0\]"),
        ("tokens", ValueError, r"broken \(tokens\) proposed tokens of shape \(2,\) for 1 nodes"),
    ],
)
def test_the_engine_refuses_a_proposal_that_breaks_the_contract(target, fault, error, match):
    with pytest.raises(error, match=match):
        SpeculativeDecoder(target, Broken(fault)).generate([[1, 2]], max_new_tokens=3)


def test_strategies_are_checked_when_the_decoder_is_built(target):
    assert isinstance(SpeculativeDecoder(target).strategy, NoDraft)
    with pytest.raises(TypeError, match="strategy must implement the Strategy protocol"):
        SpeculativeDecoder(target, object())
    zero = NoDraft()
    zero.max_nodes = 0
    with pytest.raises(ValueError, match="strategy.max_nodes must be an int >= 1"):
        SpeculativeDecoder(target, zero)


class Hooked(NgramStrategy):
    """An n-gram drafter with every optional hook of ``BaseStrategy``, recording the calls."""

    def __init__(self):
        super().__init__(num_draft=3)
        self.calls = []

    def prepare(self, step):
        self.calls.append(("prepare", list(step.running)))

    def owed_tokens(self, running, contexts):
        self.calls.append(("owed_tokens", list(running)))
        return 0

    def draft_nodes(self, depth):
        self.calls.append(("draft_nodes", depth))
        return depth + 1


def test_optional_hooks_are_the_strategys_own_else_the_base_defaults(target):
    """The engine calls the hooks ``BaseStrategy`` declares: a subclass's own, or the defaults for a drafter written
    against the protocol alone (or a wrapper that sets a hook to None)."""

    def functions(hooks):
        return hooks.prepare.__func__, hooks.owed_tokens.__func__, hooks.draft_nodes

    defaults = StrategyHooks.of(RandomTrees(seed=0))
    assert not isinstance(RandomTrees(seed=0), BaseStrategy)
    assert defaults.prepare(None) is None and defaults.owed_tokens([0, 1], [5, 6]) == 0 and defaults.draft_nodes is None
    assert functions(defaults) == (BaseStrategy.prepare, BaseStrategy.owed_tokens, None)
    assert functions(StrategyHooks.of(NoDraft())) == functions(defaults)  # the base class's own
    wrapper = EveryOtherStepPlain(NgramStrategy())
    wrapper.prepare = wrapper.owed_tokens = None
    assert functions(StrategyHooks.of(wrapper)) == functions(defaults)

    strategy = Hooked()
    hooks = StrategyHooks.of(strategy)
    assert (hooks.prepare, hooks.owed_tokens, hooks.draft_nodes) == (strategy.prepare, strategy.owed_tokens,
                                                                     strategy.draft_nodes)  # fmt: skip
    prompts = [[1, 2, 3, 1, 2], [4, 5, 4, 5]]
    result = SpeculativeDecoder(target, strategy, adaptive=False).generate(prompts, max_new_tokens=8,
                                                                           eos_token_id=None)  # fmt: skip
    prepared = [args for name, args in strategy.calls if name == "prepare"]
    assert len(prepared) == result.stats[0].target_forwards - 1 > 0  # once a step, before its proposal
    assert prepared[0] == [0, 1]
    strategy.calls.clear()
    decoder = SpeculativeDecoder(target, strategy)  # the adaptive controller's hooks too
    decoder.generate(prompts, max_new_tokens=8, eos_token_id=None)
    assert decoder.adaptive.nodes(3) == 4 and ("draft_nodes", 3) in strategy.calls
    assert {name for name, _ in strategy.calls} == {"prepare", "owed_tokens", "draft_nodes"}


def test_proposal_rule_is_explicit():
    tokens = torch.tensor([3, 4])
    with pytest.raises(ValueError, match="rule must be one of"):
        Proposal(tokens, [[-1, 0]], rule="greedy")
    with pytest.raises(ValueError, match="rule='stochastic' needs draft_probs"):
        Proposal(tokens, [[-1, 0]], rule="stochastic")
    with pytest.raises(ValueError, match="rule='deterministic' takes no draft_probs"):
        Proposal(tokens, [[-1, 0]], rule="deterministic", draft_probs=torch.rand(2, VOCAB))


def context(histories, max_nodes, max_depth, device="cpu") -> StepContext:
    rows = len(histories)
    return StepContext(
        running=list(range(rows)), batch_size=rows, roots=[h[-1] for h in histories],
        previous=[h[-2] for h in histories], histories=histories, max_depth=max_depth, max_nodes=max_nodes,
        params=SamplingParams.make(rows, seed=list(range(rows))), greedy=True, device=torch.device(device),
    )  # fmt: skip


@pytest.mark.parametrize("make", ["ngram", "chain", "tree"])
def test_shipped_strategies_honour_per_request_limits(target, make):
    strategy = {
        "ngram": lambda: NgramStrategy(num_draft=4),
        "chain": lambda: DraftModelStrategy(noisy_copy(target, 1, 0.3), (1,) * 4),
        "tree": lambda: DraftModelStrategy(noisy_copy(target, 1, 0.3), (3, 2, 1), rule="deterministic"),
    }[make]()
    histories = [[1, 2, 3, 1, 2], [4, 5, 6], [7, 1, 7, 1], [2, 2]]
    cache_options = {"layout": "contiguous", "block_size": 16}
    q_offsets = i32(0, *[sum(len(h) - 1 for h in histories[: b + 1]) for b in range(len(histories))])
    strategy.prefill(Prefill([h[:-1] for h in histories], 32, cache_options, torch.zeros(0, 32), q_offsets))
    max_nodes = [1, 3, strategy.max_nodes, strategy.max_nodes]
    max_depth = [4, 4, 1, 0]
    with torch.inference_mode():
        proposal = strategy.propose(context(histories, max_nodes, max_depth))
    for r, tree in enumerate(proposal.parents):
        depth = tree_metadata_on([tree], torch.device("cpu"))[0]
        assert len(tree) <= max_nodes[r] and int(depth.max()) <= max_depth[r], f"request {r}: {tree}"
        assert proposal.tokens[sum(proposal.counts[:r])].item() == histories[r][-1], "node 0 is the root"
    assert proposal.counts[0] == 1 and proposal.counts[3] == 1
    assert proposal.counts[1] == 3  # the node budget, not the depth, is the limit here
    assert proposal.counts[2] == 1 + (3 if make == "tree" else 1)  # depth 1: a chain's first draft, the tree's level 1


def test_host_tree_metadata_equals_the_op():
    rng = random.Random(0)
    trees = [[-1]] + [[-1] + [rng.randrange(i) for i in range(1, n)] for n in (2, 7, 70, 130)]
    depth, mask = tree_metadata_on(trees, torch.device("cpu"))
    flat = torch.tensor([p for t in trees for p in t], dtype=torch.int32)
    offsets = torch.tensor([0, *[len(t) for t in trees]]).cumsum(0).to(torch.int32)
    expected = build_tree_metadata(flat, offsets, max(len(t) for t in trees))
    assert torch.equal(depth, expected.depth) and torch.equal(mask, expected.ancestor_mask)


class EveryOtherStepPlain:
    """Wraps a strategy; every other step the limits allow one node per request (as an adaptive policy may)."""

    def __init__(self, inner):
        self.inner, self.steps = inner, 0
        self.name, self.max_nodes, self.max_depth = inner.name, inner.max_nodes, inner.max_depth
        self.attach, self.prefill, self.commit = inner.attach, inner.prefill, inner.commit

    def propose(self, step):
        self.steps += 1
        if self.steps % 2:
            step = dataclasses.replace(step, max_nodes=[1] * len(step.running))
        return self.inner.propose(step)


@pytest.mark.parametrize("branching, rule", [((1,) * 3, "stochastic"), ((2, 2, 1), "deterministic")])
def test_a_draft_model_keeps_its_context_across_steps_that_draft_nothing(target, branching, rule):
    """Draft = target, greedy: every drafted position is accepted, however the steps in between went."""
    strategy = EveryOtherStepPlain(DraftModelStrategy(target, branching, rule=rule))
    prompts = [[1, 2, 3], [4, 5], [6]]
    decoder = SpeculativeDecoder(target, strategy, adaptive=False)
    result = decoder.generate(prompts, max_new_tokens=20, eos_token_id=None)
    assert result.tokens == autoregressive_generate(target, prompts, max_new_tokens=20, eos_token_id=None)
    for b, stats in enumerate(result.stats):
        assert stats.drafted > 0 and stats.acceptance_by_position() == [1.0] * len(branching), f"request {b}"
