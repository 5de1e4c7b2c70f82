"""The step-level engine (``SpeculativeDecoder.engine``): requests join a running batch, finished slots refill,
aborts and pauses lose nothing, and every request's tokens are the ones it gets alone (PyTorch path)."""

import re
from pathlib import Path

import pytest
from helpers import noisy_copy, random_eagle_head, random_heads, random_model, tiny_config

from specdec.decoding import (
    AdaptiveSpeculation,
    DraftModelStrategy,
    EagleStrategy,
    MedusaStrategy,
    NgramStrategy,
    NoDraft,
    ParallelEagleStrategy,
    SpeculativeDecoder,
)
from specdec.decoding.autoregressive import generate as autoregressive_generate
from specdec.model import LlamaModel
from specdec.testing import ASSETS

pytestmark = pytest.mark.usefixtures("torch_backend")

STRATEGIES = {
    "autoregressive": lambda target, draft: NoDraft(),
    "chain": lambda target, draft: DraftModelStrategy(draft, (1,) * 3),
    "tree-deterministic": lambda target, draft: DraftModelStrategy(draft, (3, 2, 1), rule="deterministic"),
    "tree-stochastic": lambda target, draft: DraftModelStrategy(draft, (2, 1, 1), rule="stochastic"),
    "ngram": lambda target, draft: NgramStrategy(num_draft=3, max_ngram=2),
    "medusa": lambda target, draft: MedusaStrategy(random_heads(target, 5), [[0], [1], [0, 0], [0, 0, 0]]),
    "eagle2": lambda target, draft: EagleStrategy(random_eagle_head(target, 6), tree_budget=8, depth=3, top_k=2),
    "eagle1": lambda target, draft: EagleStrategy(
        random_eagle_head(target, 6), static_tree=[[0], [1], [0, 0], [0, 0, 0]], depth=3, top_k=2
    ),
    "parallel-eagle-chain": lambda target, draft: ParallelEagleStrategy(random_eagle_head(target, 6, block_size=3)),
    "parallel-eagle-tree": lambda target, draft: ParallelEagleStrategy(
        random_eagle_head(target, 6, block_size=4), max_nodes=7
    ),
}
# (step at which it is added, prompt, max_new_tokens): more requests than slots, joining while others run, some
# ending before others join, prompts that repeat themselves (n-gram drafts that hit).
ARRIVALS = [
    (0, [1, 2, 3, 4, 5], 14),
    (0, [7, 8, 9], 5),
    (1, [10, 11, 12, 13, 14, 15, 16], 9),
    (2, [3, 9, 4, 3, 9, 4, 3], 12),
    (2, [5, 5, 2, 8], 1),
    (4, [6, 1, 6, 1, 6], 10),
    (9, [2, 4, 2, 4], 7),
    (9, [9] * 9, 6),
]


@pytest.fixture(scope="module")
def pair():
    target = random_model(tiny_config(), seed=0)
    return target, noisy_copy(target, 1, 0.3)


def drive(engine, arrivals=ARRIVALS, aborts=None, sampling=None):
    """Add each request at its step and step until every one ended; (tokens per id, endings, steps run).
    ``aborts``: {step: [ids]} aborted right before that step. ``sampling``: per-request keyword dicts by id."""
    tokens, endings, step = {}, {}, 0
    while step <= max(a[0] for a in arrivals) or engine.has_unfinished():
        for i, (at, prompt, limit) in enumerate(arrivals):
            if at == step:
                engine.add_request(prompt, request_id=i, max_new_tokens=limit, eos_token_id=None,
                                   **(sampling or {}).get(i, {}))  # fmt: skip
        for i in (aborts or {}).get(step, []):
            assert engine.abort(i)
        out = engine.step()
        for request, new in zip(out.requests, out.tokens):
            assert request not in endings, f"request {request} emitted after it ended"
            tokens.setdefault(request, []).extend(new)
        for request, why in out.finished.items():
            assert request not in endings, f"request {request} ended twice"
            endings[request] = why
        step += 1
        assert step < 500
    return tokens, endings, step


def solo_greedy(target, arrivals=ARRIVALS):
    return {i: autoregressive_generate(target, [p], max_new_tokens=m, eos_token_id=None)[0]
            for i, (_, p, m) in enumerate(arrivals)}  # fmt: skip


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_requests_joining_mid_run_get_their_solo_greedy_tokens(pair, strategy, layout):
    """Three slots for eight requests arriving over ten steps, the adaptive controller exploring every other step
    (ragged depths, plain steps): every request's tokens are the target's greedy text for it alone."""
    target, draft = pair
    decoder = SpeculativeDecoder(target, STRATEGIES[strategy](target, draft), cache_layout=layout, block_size=4,
                                 adaptive=AdaptiveSpeculation(explore_every=2))  # fmt: skip
    engine = decoder.engine(max_batch=3, max_len=40)
    tokens, endings, steps = drive(engine)
    assert tokens == solo_greedy(target)
    assert endings == dict.fromkeys(range(len(ARRIVALS)), "length")
    assert not engine.has_unfinished() and engine.step().requests == ()


@pytest.mark.parametrize("strategy", ["chain", "tree-stochastic", "ngram", "medusa", "eagle2", "parallel-eagle-tree"])
def test_seeded_sampled_requests_joining_mid_run_get_their_solo_tokens(pair, strategy):
    """With fixed sizes, a seeded request's tokens depend on its own seed only: joining a busy engine at any step
    gives the tokens it gets alone, so its samples are exactly distributed as alone (tested there)."""
    target, draft = pair
    sampling = {i: dict(temperature=0.9 if i % 3 else 0.0, top_k=[0, 20][i % 2], top_p=0.95, seed=100 + i)
                for i in range(len(ARRIVALS))}  # fmt: skip
    decoder = SpeculativeDecoder(target, STRATEGIES[strategy](target, draft), adaptive=False)
    tokens, _, _ = drive(decoder.engine(max_batch=3, max_len=40), sampling=sampling)
    for i, (_, prompt, limit) in enumerate(ARRIVALS):
        alone = SpeculativeDecoder(target, STRATEGIES[strategy](target, draft), adaptive=False)
        expected = alone.generate([prompt], max_new_tokens=limit, eos_token_id=None, **sampling[i]).tokens[0]
        assert tokens[i] == expected, f"request {i}"


@pytest.mark.parametrize("strategy", ["chain", "ngram", "medusa", "eagle2", "parallel-eagle-tree"])
def test_aborts_free_the_slot_and_change_no_other_request(pair, strategy):
    """A running request and a queued one aborted: each is reported 'abort' once, the freed slot takes the next
    queued request at the next step, and every other request gets its solo tokens."""
    target, draft = pair
    decoder = SpeculativeDecoder(target, STRATEGIES[strategy](target, draft))
    engine = decoder.engine(max_batch=3, max_len=40)
    tokens, endings, _ = drive(engine, aborts={3: [0], 9: [7]})  # 7 is added at step 9: queued, never run
    expected = solo_greedy(target)
    assert endings[0] == endings[7] == "abort" and 7 not in tokens
    assert tokens[0] == expected[0][: len(tokens[0])] and 0 < len(tokens[0]) < 14
    for i in set(expected) - {0, 7}:
        assert tokens[i] == expected[i] and endings[i] == "length", f"request {i}"
    assert not engine.abort(0) and not engine.abort("never added")


def test_an_aborted_slot_refills_at_the_next_step(pair):
    target, _ = pair
    engine = SpeculativeDecoder(target).engine(max_batch=1, max_len=32)
    engine.add_request([1, 2, 3], request_id="a", max_new_tokens=20)
    engine.add_request([4, 5], request_id="b", max_new_tokens=3, eos_token_id=None)
    assert engine.step().requests == ("a",) and engine.num_waiting == 1
    assert engine.abort("a")
    out = engine.step()
    assert out.finished == {"a": "abort"} and out.requests == ("b",)  # b's prefill in the slot a left


@pytest.mark.parametrize(
    "strategy, forwards", [("autoregressive", [1 + 4]), ("chain", [4 + 4]), ("tree-deterministic", [4, 16])]
)
def test_a_prompt_joining_a_step_of_chains_rides_in_its_forward(pair, monkeypatch, strategy, forwards):
    """A request joining running ones: a step of chains takes its prompt as more causal rows of its one target
    forward (the running chain's nodes and the 4 prompt rows); a step with a tree mask runs the prompt in a forward
    of its own first (then the 16-node tree). The tokens are the solo ones either way (the tests above)."""
    target, draft = pair
    decoder = SpeculativeDecoder(target, STRATEGIES[strategy](target, draft), adaptive=False)
    engine = decoder.engine(max_batch=2, max_len=40)
    tokens = {}

    def step():
        out = engine.step()
        for request, new in zip(out.requests, out.tokens):
            tokens.setdefault(request, []).extend(new)
        return out

    engine.add_request([1, 2, 3, 4, 5], request_id="first", max_new_tokens=12, eos_token_id=None)
    step()  # its prefill
    rows, forward = [], target.forward
    monkeypatch.setattr(target, "forward", lambda tokens, *rest, **kw: rows.append(tokens.numel()) or forward(
        tokens, *rest, **kw))  # fmt: skip
    engine.add_request([7, 8, 9, 10], request_id="late", max_new_tokens=3, eos_token_id=None)
    assert set(step().requests) == {"first", "late"} and rows == forwards
    monkeypatch.undo()
    while engine.has_unfinished():
        step()
    alone = solo_greedy(target, [(0, [1, 2, 3, 4, 5], 12), (0, [7, 8, 9, 10], 3)])
    assert tokens == {"first": alone[0], "late": alone[1]}


@pytest.mark.parametrize(
    "strategy", ["autoregressive", "chain", "tree-deterministic", "medusa", "eagle2", "parallel-eagle-tree"]
)
def test_a_bounded_pool_pauses_and_resumes_with_requests_joining(pair, strategy):
    """A pool too small for three running requests: the engine pauses and resumes them while others join;
    nothing is lost and every request gets its solo tokens."""
    target, draft = pair
    decoder = SpeculativeDecoder(target, STRATEGIES[strategy](target, draft), cache_layout="paged", block_size=4,
                                 num_blocks=10)  # fmt: skip
    engine = decoder.engine(max_batch=3, max_len=40)
    stats = []
    real_add = engine.add_request

    def add(*args, **kwargs):  # keep each request's stats (the engine drops them when it ends)
        request = real_add(*args, **kwargs)
        stats.append(engine.stats(request))
        return request

    engine.add_request = add
    tokens, endings, _ = drive(engine)
    assert tokens == solo_greedy(target)
    assert endings == dict.fromkeys(range(len(ARRIVALS)), "length")
    assert sum(s.preemptions for s in stats) > 0, "10 blocks of 4 cannot hold three requests of up to 24 tokens"


@pytest.mark.parametrize("strategy", ["autoregressive", "chain", "eagle2"])
def test_aborting_a_paused_request_frees_its_place_and_loses_nothing_else(pair, strategy):
    target, draft = pair
    decoder = SpeculativeDecoder(target, STRATEGIES[strategy](target, draft), cache_layout="paged", block_size=4,
                                 num_blocks=8)  # fmt: skip
    engine = decoder.engine(max_batch=3, max_len=40)
    arrivals = [(0, [1, 2, 3, 4, 5], 20), (0, [7, 8, 9], 20), (0, [3, 9, 4, 3, 9, 4, 3], 20), (0, [5, 5, 2], 6)]
    for i, (_, prompt, limit) in enumerate(arrivals):
        engine.add_request(prompt, request_id=i, max_new_tokens=limit, eos_token_id=None)
    tokens, endings, aborted = {}, {}, None
    while engine.has_unfinished():
        out = engine.step()
        for request, new in zip(out.requests, out.tokens):
            tokens.setdefault(request, []).extend(new)
        endings.update(out.finished)
        paused = list(engine._run.pool.paused)
        if aborted is None and paused:
            aborted = engine._id_of[paused[0]]
            assert engine.abort(aborted) and engine._run.pool.paused == paused[1:]
    assert aborted is not None, "8 blocks of 4 cannot hold three requests of up to 27 tokens"
    expected = solo_greedy(target, arrivals)
    assert endings[aborted] == "abort" and tokens[aborted] == expected[aborted][: len(tokens[aborted])]
    for i in set(expected) - {aborted}:
        assert tokens[i] == expected[i] and endings[i] == "length", f"request {i}"


class WholeBatches(NoDraft):
    """A strategy without ``join``: served whole batches, its ``prefill`` called once per batch."""

    join = None

    def __init__(self):
        self.batches = []

    def prefill(self, prefill):
        self.batches.append([b for b, p in enumerate(prefill.prompts) if p])


def test_a_strategy_without_join_is_served_whole_batches(pair):
    target, _ = pair
    strategy = WholeBatches()
    engine = SpeculativeDecoder(target, strategy).engine(max_batch=3, max_len=40)
    tokens, _, _ = drive(engine)
    assert tokens == solo_greedy(target)
    # Requests 0, 1 join at step 0; 2 (step 1) waits until both ended, then 2, 3, 4 fill the slots; ...
    assert strategy.batches[0] == [0, 1] and all(len(b) >= 1 for b in strategy.batches) and len(strategy.batches) > 2


def test_add_request_checks_its_arguments_and_the_engine_its_decoder(pair):
    target, draft = pair
    decoder = SpeculativeDecoder(target, DraftModelStrategy(draft, (1,) * 3))
    engine = decoder.engine(max_batch=2, max_len=20)
    with pytest.raises(ValueError, match=r"the prompt \(10 tokens\) and max_new_tokens \(9\) need 21 cached tokens "
                       r"with a 4-node tree, beyond this engine's max_len \(20\)"):  # fmt: skip
        engine.add_request([1] * 10, max_new_tokens=9)
    with pytest.raises(ValueError, match="temperature"):
        engine.add_request([1], temperature=-1.0)
    with pytest.raises(ValueError, match=r"prompts\[0\] is empty"):
        engine.add_request([])
    assert engine.add_request([1, 2], max_new_tokens=4) == 0 and engine.add_request([3], max_new_tokens=4) == 1
    with pytest.raises(ValueError, match="request_id 1 is already in use"):
        engine.add_request([3], request_id=1)
    assert engine.add_request([3], max_new_tokens=0, request_id="none") == "none"  # ends at once, reported next
    assert engine.step().finished == {"none": "length"}
    with pytest.raises(ValueError, match=r"max_batch must be an int >= 1"):
        decoder.engine(max_batch=0, max_len=20)
    with pytest.raises(ValueError, match=r"max_len must be an int >= 5"):
        decoder.engine(max_batch=1, max_len=4)
    decoder.generate([[1, 2]], max_new_tokens=3)  # a stream takes the decoder's strategy over
    with pytest.raises(RuntimeError, match="this engine's decoder runs another engine"):
        engine.step()


def test_stream_is_a_loop_over_an_engine(pair):
    """``stream`` yields the engine's steps: the prefill first (every request's first token), then one per step."""
    target, draft = pair
    prompts = [p for _, p, _ in ARRIVALS[:3]]
    decoder = SpeculativeDecoder(target, DraftModelStrategy(draft, (1,) * 3), adaptive=False)
    steps = list(decoder.stream(prompts, max_new_tokens=6, eos_token_id=None))
    assert steps[0].requests == (0, 1, 2) and all(len(t) == 1 for t in steps[0].tokens)
    assert steps[-1].finished and decoder._engine is not None
    engine = decoder.engine(max_batch=3, max_len=20)
    for prompt in prompts:
        engine.add_request(prompt, max_new_tokens=6, eos_token_id=None)
    by_engine = [engine.step() for _ in range(len(steps))]
    assert by_engine == steps and not engine.has_unfinished()


def test_the_server_loop_of_the_readme_runs():
    """The README's server loop as written there (section "Serving"), on the embedded target: the greedy requests
    get their solo tokens, the aborted one a prefix of them, the sampled one ends."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = readme[readme.index("## Serving: requests joining a running engine") :]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    target = LlamaModel.from_pretrained(ASSETS / "target")
    scope = {"target": target}
    exec(compile(code, "README.md (Serving)", "exec"), scope)
    streams, finished = scope["streams"], scope["finished"]
    solo = autoregressive_generate(target, [[1, 15, 27, 4], [1, 9, 9, 3]], max_new_tokens=[24, 64])
    assert streams[0] == solo[0] and finished[0] in ("eos", "length")
    assert finished[1] == "abort" and 8 <= len(streams[1]) < 64 and streams[1] == solo[1][: len(streams[1])]
    assert finished[2] in ("eos", "length") and 0 < len(streams[2]) <= 40


@pytest.mark.parametrize(
    "strategy", ["chain", "tree-deterministic", "ngram", "medusa", "eagle2", "parallel-eagle-chain"]
)
def test_seeded_requests_joining_mid_run_sample_plain_decodings_tokens_under_the_adaptive_controller(pair, strategy):
    """Random numbers keyed on (seed, position, role) and drafts verified by sampling and comparing (coupled draft
    chains, deterministic trees, n-gram, heads): whatever joins beside it and whatever depths the controller picks,
    a seeded request emits the tokens plain sampling gives it alone."""
    target, draft = pair
    sampling = {i: dict(temperature=0.9, top_k=[0, 20][i % 2], top_p=0.95, seed=200 + i) for i in range(len(ARRIVALS))}
    decoder = SpeculativeDecoder(target, STRATEGIES[strategy](target, draft),
                                 adaptive=AdaptiveSpeculation(explore_every=2))  # fmt: skip
    tokens, _, _ = drive(decoder.engine(max_batch=3, max_len=40), sampling=sampling)
    plain = SpeculativeDecoder(target)
    for i, (_, prompt, limit) in enumerate(ARRIVALS):
        expected = plain.generate([prompt], max_new_tokens=limit, eos_token_id=None, **sampling[i]).tokens[0]
        assert tokens[i] == expected, f"request {i}"


@pytest.mark.parametrize("strategy", ["tree-deterministic", "eagle1"])
def test_tree_commits_beside_slots_without_blocks_keep_every_token(pair, strategy):
    """A bounded paged pool and depths drawn at random (as an adaptive controller's may fall): requests pause, their
    blocks go to others, and the running requests' trees are compacted beside them; every token stays greedy."""
    import random

    target, draft = pair
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16], [3] * 10]
    expected = autoregressive_generate(target, prompts, max_new_tokens=30, eos_token_id=None)
    diverged = []
    for seed in range(10):
        rng = random.Random(seed)
        depths = AdaptiveSpeculation(forced=lambda step, running, limits, rng=rng: [rng.randint(0, 3) for _ in running])
        decoder = SpeculativeDecoder(target, STRATEGIES[strategy](target, draft), adaptive=depths, cache_layout="paged",
                                     block_size=4, num_blocks=14)  # fmt: skip
        if decoder.generate(prompts, max_new_tokens=30, eos_token_id=None).tokens != expected:
            diverged.append(seed)
    assert diverged == []


def test_a_step_runs_in_inference_mode_whatever_the_callers(pair, monkeypatch):
    """A serving loop calls ``step`` without entering ``torch.inference_mode``: the step enters it, so no forward runs
    with autograd recording (on the CPU that would leave the packed GEMM kernels for ``F.linear``, twice as slow),
    and aborting a request between such steps works; the caller's own mode is left as it was."""
    import torch

    import specdec.model.llama as llama

    grad_at_forward, real = [], llama.linear_for
    monkeypatch.setattr(llama, "linear_for", lambda rows: grad_at_forward.append(torch.is_grad_enabled()) or real(rows))
    target, draft = pair
    engine = SpeculativeDecoder(target, DraftModelStrategy(draft, (1,) * 3)).engine(max_batch=2, max_len=64)
    first = engine.add_request([1, 2, 3, 4], max_new_tokens=8)
    engine.add_request([5, 6], max_new_tokens=8)
    engine.step()
    engine.step()
    assert engine.abort(first)
    engine.add_request([7, 8, 9], max_new_tokens=5)
    while engine.has_unfinished():
        engine.step()
    assert torch.is_grad_enabled()
    assert grad_at_forward and not any(grad_at_forward)
