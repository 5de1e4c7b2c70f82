"""A step synchronises the host once: its read-back. Counted on the CPU (``sync_counter``), checked on a GPU.

Every strategy runs a whole generation (prefill, every step, requests finishing at different
steps) while ``SyncCounter`` records every operation that would make the host wait for a GPU;
each step must record exactly one, the read-back in ``specdec._transfer.read_back``. Greedy
batches run the PyTorch bodies (the CPU's own path); sampled batches run the Triton path through
Triton's interpreter, the code a GPU runs (the PyTorch bodies of the general sampling ops are
readable vectorised references that read sizes back, which is free on the CPU they serve).
"""

import copy

import pytest
import torch
from helpers import noisy_copy, random_eagle_head, random_heads, random_model, tiny_config
from sync_counter import SyncCounter, events_per_step, run_under_sync_debug_error

from specdec import use_backend
from specdec.decoding import (
    AdaptiveSpeculation,
    DraftModelStrategy,
    EagleStrategy,
    MedusaStrategy,
    NgramStrategy,
    NoDraft,
    ParallelDraftStrategy,
    ParallelEagleStrategy,
    SpeculativeDecoder,
)
from specdec.model import ParallelDraft

STRATEGIES = {
    "autoregressive": lambda draft: NoDraft(),
    "chain": lambda draft: DraftModelStrategy(draft, (1,) * 3),
    "tree-deterministic": lambda draft: DraftModelStrategy(draft, (2, 2, 1), rule="deterministic"),
    "tree-stochastic": lambda draft: DraftModelStrategy(draft, (2, 1, 1), rule="stochastic"),
    "ngram": lambda draft: NgramStrategy(num_draft=3, max_ngram=2),
    "parallel-chain": lambda draft: ParallelDraftStrategy(ParallelDraft(draft, 47, block_size=4, vocab_size=48)),
    "parallel-tree": lambda draft: ParallelDraftStrategy(ParallelDraft(draft, 47, 4, 48), max_nodes=6),
    # Heads on the draft's weights: random guesses of the right shapes, for the target the draft copies.
    "medusa": lambda draft: MedusaStrategy(random_heads(draft, seed=2), [[0], [1], [0, 0], [1, 0], [0, 0, 0]]),
}
# Strategies of heads that read the target's features, built for the target (random weights).
HEAD_STRATEGIES = {
    "eagle": lambda target: EagleStrategy(random_eagle_head(target, 6), tree_budget=8, depth=3, top_k=2),
    "parallel-eagle": lambda target: ParallelEagleStrategy(random_eagle_head(target, 6, block_size=4), max_nodes=6),
    "parallel-eagle-chain": lambda target: ParallelEagleStrategy(random_eagle_head(target, 6, block_size=4)),
}


def make(strategy, target, draft):
    return HEAD_STRATEGIES[strategy](target) if strategy in HEAD_STRATEGIES else STRATEGIES[strategy](draft)


READ_BACK = ("Tensor.tolist", "_transfer.py")


@pytest.fixture(scope="module")
def pair():
    target = random_model(tiny_config(vocab_size=48), seed=0)
    return target, noisy_copy(target, 1, 0.3)


def assert_one_read_back_per_step(per_step, min_steps: int) -> None:
    assert len(per_step) >= min_steps, f"only {len(per_step)} steps ran"
    for i, events in enumerate(per_step):
        assert [(what, where.split(":")[0]) for what, where in events] == [READ_BACK], (
            f"step {i}: {len(events)} would-be synchronisations, expected the read-back alone: {events}"
        )


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
@pytest.mark.parametrize("strategy", [*STRATEGIES, *HEAD_STRATEGIES])
def test_greedy_generation_syncs_once_per_step(pair, strategy, layout):
    target, draft = pair
    decoder = SpeculativeDecoder(target, make(strategy, target, draft), cache_layout=layout, block_size=4)
    prompts = [[3, 9, 4, 3, 9, 4, 3], [7, 1], [5, 5, 2, 8]]
    with use_backend("torch"):
        per_step = events_per_step(decoder, prompts, max_new_tokens=[12, 5, 9], eos_token_id=None, seed=0)
    assert_one_read_back_per_step(per_step, min_steps=4)


@pytest.mark.parametrize("strategy", [*STRATEGIES, *HEAD_STRATEGIES])
def test_a_bounded_paged_pool_adds_no_sync(pair, strategy):
    """Planning, pausing and resuming (the recompute forward included) read nothing back."""
    target, draft = pair
    decoder = SpeculativeDecoder(target, make(strategy, target, draft), cache_layout="paged", block_size=4,
                                 num_blocks=6)  # fmt: skip
    prompts = [[3, 9, 4, 3, 9, 4, 3], [7, 1], [5, 5, 2, 8]]
    with use_backend("torch"):
        per_step = events_per_step(decoder, prompts, max_new_tokens=[14, 5, 12], eos_token_id=None, seed=0)
    assert sum(s.preemptions for s in decoder.stats) > 0, "the pool should have been too small for every request"
    assert [s.finish_reason for s in decoder.stats] == ["length"] * 3
    assert_one_read_back_per_step(per_step, min_steps=4)


@pytest.mark.interpreter
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_sampled_generation_syncs_once_per_step_on_the_triton_path(pair, strategy):
    target, draft = pair
    decoder = SpeculativeDecoder(target, STRATEGIES[strategy](draft))
    prompts = [[3, 9, 4, 3, 9], [7, 1, 7]]
    sampling = dict(max_new_tokens=[6, 4], temperature=[1.0, 0.0], top_k=[5, 0], top_p=[0.9, 1.0], seed=3)
    with use_backend("triton"):
        per_step = events_per_step(decoder, prompts, eos_token_id=None, **sampling)
    assert_one_read_back_per_step(per_step, min_steps=2)


@pytest.mark.parametrize("strategy", ["chain", "tree-deterministic", "ngram"])
def test_adaptive_choices_add_no_sync(pair, strategy):
    """The adaptive controller (the default, here exploring every other step: ragged depths, plain steps)
    times steps with the host clock only."""
    target, draft = pair
    decoder = SpeculativeDecoder(target, STRATEGIES[strategy](draft), adaptive=AdaptiveSpeculation(explore_every=2))
    prompts = [[3, 9, 4, 3, 9, 4, 3], [7, 1], [5, 5, 2, 8]]
    with use_backend("torch"):
        per_step = events_per_step(decoder, prompts, max_new_tokens=[16, 9, 12], eos_token_id=None, seed=0)
    assert_one_read_back_per_step(per_step, min_steps=5)
    chosen = {d for s in decoder.stats for d in s.chosen_depths}
    assert 0 in chosen and max(chosen) > 0, chosen


# (step at which it joins, prompt, max_new_tokens): more requests than the engine's 3 slots, joining while others run
ARRIVALS = [(0, [3, 9, 4, 3, 9, 4, 3], 12), (0, [7, 1], 5), (1, [5, 5, 2, 8], 9), (2, [1, 2, 3, 4, 5], 7),
            (2, [6, 1, 6, 1], 1), (4, [2, 4, 2, 4], 10), (7, [9] * 6, 6)]  # fmt: skip


def events_per_engine_step(engine, **sampling) -> tuple[list[list[tuple[str, str]]], int]:
    """The would-be synchronisations of each ``Engine.step`` while ``ARRIVALS`` join, and how many steps admitted
    requests while others ran."""
    per_step, joined_running = [], 0
    for step in range(100):
        for at, prompt, limit in ARRIVALS:
            if at == step:
                engine.add_request(prompt, max_new_tokens=limit, eos_token_id=None, **sampling)
        if step > ARRIVALS[-1][0] and not engine.has_unfinished():
            return per_step, joined_running
        waiting, running = engine.num_waiting, bool(engine._run.running)
        with SyncCounter() as counter:
            engine.step()
        joined_running += running and engine.num_waiting < waiting
        per_step.append(counter.events)
    raise AssertionError("the requests did not end")


@pytest.mark.parametrize("layout", ["contiguous", "paged", "bounded"])
@pytest.mark.parametrize("strategy", [*STRATEGIES, *HEAD_STRATEGIES])
def test_engine_steps_with_requests_joining_sync_once(pair, strategy, layout):
    """Continuous batching: steps that prefill joining requests beside the running ones' trees (and, in a bounded
    pool, pause and resume) make one would-be synchronisation each, the read-back of both."""
    target, draft = pair
    made = make(strategy, target, draft)
    pool = dict(cache_layout="paged", block_size=4) if layout != "contiguous" else {}
    if layout == "bounded":
        pool["num_blocks"] = 9
    engine = SpeculativeDecoder(target, made, **pool).engine(max_batch=3, max_len=32)
    with use_backend("torch"):
        per_step, joined_running = events_per_engine_step(engine)
    assert joined_running >= 2, "requests should have joined steps with others running"
    assert_one_read_back_per_step(per_step, min_steps=8)


@pytest.mark.interpreter
@pytest.mark.parametrize("strategy", ["chain", "tree-stochastic", "medusa"])
def test_sampled_engine_steps_with_requests_joining_sync_once_on_the_triton_path(pair, strategy):
    target, draft = pair
    engine = SpeculativeDecoder(target, STRATEGIES[strategy](draft)).engine(max_batch=3, max_len=32)
    with use_backend("triton"):
        per_step, joined_running = events_per_engine_step(engine, temperature=0.8, top_k=5, seed=1)
    assert joined_running >= 3
    assert_one_read_back_per_step(per_step, min_steps=8)


def test_the_counter_sees_the_reads_a_gpu_would_wait_for():
    x = torch.arange(6.0)
    with SyncCounter() as counter:
        x.nonzero()
        x[x > 2]  # a bool mask: its size is data
        torch.repeat_interleave(torch.tensor([1, 2]))
        torch.repeat_interleave(torch.tensor([1, 2]), output_size=3)  # sized on the host: no sync
        (x.sum() > 0).item()
    assert [what for what, _ in counter.events] == ["nonzero", "index", "repeat_interleave", "_local_scalar_dense"]


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_generation_runs_under_sync_debug_mode_error(pair, strategy):
    """On a GPU: any synchronising CUDA call but the read-back raises."""
    target, draft = (copy.deepcopy(m).to("cuda") for m in pair)  # the module's CPU pair stays on the CPU
    run_under_sync_debug_error(SpeculativeDecoder(target, STRATEGIES[strategy](draft)))


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", ["autoregressive", "chain", "medusa"])
def test_engine_steps_with_requests_joining_run_under_sync_debug_mode_error(pair, strategy):
    """On a GPU: steps with requests joining (their prefill beside the running trees) make no synchronising CUDA
    call but the read-back."""
    import warnings

    target, draft = (copy.deepcopy(m).to("cuda") for m in pair)
    engine = SpeculativeDecoder(target, STRATEGIES[strategy](draft)).engine(max_batch=3, max_len=32)
    engine.add_request([3, 9, 4, 3, 9], max_new_tokens=12, eos_token_id=None, seed=0)
    engine.step()  # the first prefill (one-off allocations and uploads)
    torch.cuda.synchronize()
    steps = 0
    torch.cuda.set_sync_debug_mode("error")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for step in range(60):
                for at, prompt, limit in ARRIVALS:
                    if at == step:
                        engine.add_request(prompt, max_new_tokens=limit, eos_token_id=None, temperature=0.7, seed=step)
                if step > ARRIVALS[-1][0] and not engine.has_unfinished():
                    break
                engine.step()
                steps += 1
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert steps >= 8 and not engine.has_unfinished()
