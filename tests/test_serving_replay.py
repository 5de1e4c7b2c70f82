"""The serving benchmark's replay on a recorded trace (``bench/serving_replay.py``): the engine's serving loop on
recorded costs -- arrivals, joins into the lowest free slots, first tokens in the joining step, what each step is
charged -- and its refusals. Pure Python, deterministic: no timing here."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from helpers import run_bench, table_rows
from replay import NoisyClock, Trace
from serving_policies import Adaptive, FixedDepth
from serving_replay import replay_serving, trace_costs
from serving_workload import Workload, workload

from specdec.decoding.adaptive import AdaptiveSpeculation

# A step of b requests drafting d tokens each costs 1 + b / 4 + d / 2 (half-drafting shapes on the same line).
SERVING_TRACE = Path(__file__).resolve().parents[1] / "bench" / "traces" / "embedded_pair_cpu_3e22767.json"
COSTS = [[b, d, h, 1.0 + b / 4 + h * d / (2 * b)] for b in (1, 2) for d in range(3) for h in {b, b // 2 or 1}]
JOINS = [[0, 0, 0.1], [1, 0, 0.2], [1, 2, 0.3]]  # seconds per prompt token beside 0 or 1 running requests


def trace(matches: list[list[int]], prompt_lengths: list[int], joins=JOINS) -> Trace:
    return Trace("test", 4, 2, prompt_lengths, matches, COSTS, 0.0, join_costs=joins)


class Spy(AdaptiveSpeculation):
    """Fixed depths, and a log of what the loop tells the controller."""

    def __init__(self, depth: int):
        super().__init__(forced=lambda step, running, limits: [depth] * len(running))
        self.calls: list[tuple] = []

    def forget(self, slots):
        self.calls.append(("forget", list(slots)))
        super().forget(slots)

    def choose(self, running, limits, contexts):
        self.calls.append(("choose", list(running), list(limits), list(contexts)))
        return super().choose(running, limits, contexts)

    def untimed(self):
        self.calls.append(("untimed",))
        super().untimed()

    def observe(self, running, nodes, depths, accepted, contexts):
        self.calls.append(("observe", list(depths), list(accepted)))
        super().observe(running, nodes, depths, accepted, contexts)


def test_a_lone_request_is_charged_its_prefill_then_its_steps():
    """Prompt of 5 tokens alone: 0.1 s a token; then two depth-2 steps of batch 1 (1 + 1/4 + 1 s each), both drafts
    accepted each time: 1 + 3 + 3 tokens."""
    spy = Spy(2)
    run = replay_serving(trace([[2] * 8], [5]), Workload([0.0], [0], [7]), slots=1, max_depth=2, controller=spy)
    end = 0.5 + 2 * 2.25
    assert run.throughput == pytest.approx(7 / end)
    assert run.ttft == [pytest.approx(0.5)] and run.tpot == [pytest.approx((end - 0.5) / 6)]
    assert run.tokens_per_step == pytest.approx(7 / 3)
    # Limits are the tokens each may still draft; contexts its cached tokens (prompt + generated - 1).
    assert spy.calls == [("forget", [0]), ("choose", [0], [5], [5]), ("observe", [2], [2]),
                         ("choose", [0], [2], [8]), ("observe", [2], [2])]  # fmt: skip


def test_requests_queue_for_the_lowest_free_slot_and_join_steps_are_untimed():
    """Two slots, three requests at once: the third waits for the first to end, joins its slot in a step of the
    one still running (charged that step plus its prompt at the running-1 price), gets its first token there, and the
    controller is told the step's time prices nothing."""
    spy = Spy(0)
    work = Workload([0.0, 0.0, 0.0], [0, 1, 0], [2, 4, 2])
    run = replay_serving(trace([[0] * 8, [0] * 8], [5, 3]), work, slots=2, max_depth=2, controller=spy)
    prefill = 0.1 * (5 + 3)  # both prompts beside nobody
    plain2, plain1 = 1.5, 1.25
    join_step = plain1 + 0.2 * 5
    assert run.ttft == pytest.approx([prefill, prefill, prefill + plain2 + join_step])
    assert spy.calls[0] == ("forget", [0, 1])
    assert spy.calls[3:6] == [("forget", [0]), ("choose", [1], [1], [4]), ("untimed",)]
    # request 1's tokens: 1 at the prefill, then 1 a step for 3 steps; request 2's second token a step after joining
    assert run.tpot == pytest.approx([plain2, (2 * plain2 + join_step) / 3, plain2])


def test_a_fixed_depth_replay_is_the_same_whatever_the_clock_but_adaptive_reads_it():
    matches = [[i % 3 for i in range(40)], [2] * 40, [1] * 40]
    noisy = dataclasses.replace(trace(matches, [6, 9, 4]), relative_noise=0.2)
    work = Workload([0.0, 0.5, 0.7, 3.0, 3.1], [0, 1, 2, 0, 1], [30, 12, 25, 40, 7])
    runs = {}
    for seed in (0, 1):
        for policy in (FixedDepth(2), Adaptive()):
            clock = NoisyClock(noisy.relative_noise, seed)
            runs[policy.name, seed] = replay_serving(noisy, work, 2, 2, policy.controller(clock), clock)
    assert runs["K=2", 0] == runs["K=2", 1]
    assert runs["adaptive", 0] != runs["adaptive", 1], "the controller's choices follow its noisy clock"
    for run in runs.values():  # every request got its tokens: one TPOT each, and a first token after it arrived
        assert len(run.tpot) == 5 and all(t > 0 for t in run.ttft)


def test_the_drafter_is_fed_a_joined_prompt_and_a_run_of_plain_steps_before_the_step_that_drafts_again():
    """A 9-token prompt: the draft owes its 8 tokens but the last (more than ``FOLD_MISSING``) until the request's first
    step that drafts, which pays 0.01 s a token before it; plain steps add a token each to the debt; plain decoding
    never pays it. The adaptive controller is given the debt (the ``owed_tokens`` hook) to price."""
    priced = dataclasses.replace(trace([[2] * 20], [9]), catch_up_price=0.01)
    work = Workload([0.0], [0], [12])
    prefill, d2, d1, plain = 0.9, 2.25, 1.75, 1.25  # 9 tokens x 0.1; steps of batch 1 drafting 2, 1 and none
    k2 = replay_serving(priced, work, 1, 2, FixedDepth(2).controller())
    assert k2.throughput == pytest.approx(12 / (prefill + 0.08 + 3 * d2 + d1))  # tokens 1 + 3 + 3 + 3 + 2
    unpriced = replay_serving(trace([[2] * 20], [9]), work, 1, 2, FixedDepth(2).controller())
    assert unpriced.throughput == pytest.approx(12 / (prefill + 3 * d2 + d1))
    later = AdaptiveSpeculation(forced=lambda step, running, limits: [0 if step < 6 else 2] * len(running))
    run = replay_serving(priced, work, 1, 2, later)  # 6 plain steps, then the prompt and those 6 tokens fed
    assert run.throughput == pytest.approx(12 / (prefill + 6 * plain + 0.14 + d2 + d1))
    assert replay_serving(priced, work, 1, 2, FixedDepth(0).controller()).throughput == pytest.approx(
        12 / (prefill + 11 * plain)
    )
    hooks = []

    class Bound(AdaptiveSpeculation):
        def bind(self, max_depth, max_nodes, draft_nodes=None, owed_tokens=None):
            hooks.append(owed_tokens)
            super().bind(max_depth, max_nodes, draft_nodes, owed_tokens)

    replay_serving(priced, work, 1, 2, Bound())
    replay_serving(trace([[2] * 20], [9]), work, 1, 2, Bound())
    assert hooks[0] is not None and hooks[1] is None, "the hook where the trace prices catch-ups"


def test_the_slot_admissions_cost_table_is_the_traces_uniform_shapes():
    costs = trace_costs(trace([[0] * 8], [5]), [1, 2], 2)
    assert costs.batches == (1, 2)
    assert costs.seconds == ((1.25, 1.75, 2.25), (1.5, 2.0, 2.5))


def test_what_a_serving_replay_cannot_charge_is_refused():
    work = Workload([0.0], [0], [9])
    with pytest.raises(ValueError, match="--match-tokens 9"):
        replay_serving(trace([[0] * 8], [5]), work, 1, 2, FixedDepth(1).controller())
    with pytest.raises(ValueError, match="no join costs: record it again"):
        replay_serving(trace([[0] * 9], [5], joins=None), work, 1, 2, FixedDepth(1).controller())
    with pytest.raises(ValueError, match="max_depth must be in 1 .. the trace's 2"):
        replay_serving(trace([[0] * 9], [5]), work, 1, 3, FixedDepth(1).controller())


def test_the_benchmark_replays_every_policy_on_a_trace(tmp_path):
    path = tmp_path / "trace.json"
    data = dataclasses.asdict(trace([[i % 3 for i in range(30)], [1] * 30], [6, 9]))
    batch4 = [[4, d, h, 2.0 + h * d / 8] for d in range(3) for h in (2, 4)]  # the quick run's 4 slots
    path.write_text(json.dumps({**data, "costs": COSTS + batch4}))
    done = run_bench("bench_serving.py", "--quick", "--replay", str(path), "--seeds", "2", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "serving.json").read_text())
    assert "replayed on trace.json, 1 rounds x 2 clock seeds" in report["title"]
    assert [r["policy"] for r in report["rows"]] == ["plain", "K=1", "K=2", "adaptive", "slot admission"] * 2
    assert [row[0] for row in table_rows(tmp_path / "serving_targets.md", "2")] == ["2"]
    refused = run_bench("bench_serving.py", "--quick", "--replay", str(path), "--temperature", "1")
    assert refused.returncode != 0 and "--replay replays a greedy draft chain" in refused.stderr


@pytest.mark.parametrize("load", [1.0, 2.0])
def test_the_controller_serves_within_four_percent_of_the_best_fixed_depth_on_the_recorded_trace(load):
    """On the trace recorded for it, at and past saturation (bench_serving.py's loads, 8 slots, 48 requests of 16-96
    tokens, depths up to 4), every one of four clock seeds within 4% of the best of plain and every fixed depth (the
    issue's line, 0.97x, holds for the median run: ``bench_serving.py --replay``). Plain decoding and every other
    fixed depth fall under it there: the bound tells choices apart."""
    trace = Trace.load(SERVING_TRACE)
    capacity = trace_costs(trace, [8], 4).capacity(8, 56)
    work = workload(range(len(trace.matches)), 48, load * capacity, (16, 96), seed=1000)
    fixed = [replay_serving(trace, work, 8, 4, FixedDepth(d).controller()).throughput for d in range(5)]
    best = max(fixed)
    assert [f < 0.96 * best for f in fixed] == [True, True, False, True, True]
    for seed in range(4):
        clock = NoisyClock(trace.relative_noise, seed, trace.drift, trace.drift_steps)
        run = replay_serving(trace, work, 8, 4, Adaptive().controller(clock), clock)
        assert run.throughput >= 0.96 * best, f"seed {seed}: {run.throughput / best:.3f} of the best fixed depth"
