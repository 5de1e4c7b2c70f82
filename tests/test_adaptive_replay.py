"""The adaptive controller on a recorded trace (``bench/replay.py``): the replay's own arithmetic, the
step-cost model's pooling of shapes, and the controller's choices against fixed depths under step-time noise.

``data/adaptive_trace.json`` was recorded on the embedded pair by ``bench/bench_adaptive_replay.py --record``
(a 2-core AMD EPYC, one thread). Replays are pure Python and deterministic per seed: no timing here.
"""

import json
import math
import random
from pathlib import Path

import pytest
from helpers import run_bench
from replay import (
    SwitchPenalty,
    Trace,
    fit_drift,
    replay,
    replay_fixed,
    replay_policy,
    sweep_groups,
)

from specdec.decoding.adaptive import AdaptiveSpeculation, StepCostModel

TRACE = Path(__file__).parent / "data" / "adaptive_trace.json"  # recorded before ragged steps ran on the kernel
CURRENT_TRACE = Path(__file__).resolve().parents[1] / "bench" / "traces" / "embedded_pair_cpu_dbf04f7.json"


def tiny_trace(matches: list[list[int]], costs: list[list[float]], new_tokens: int = 6) -> Trace:
    return Trace("test", new_tokens, 4, [5] * len(matches), matches, costs, 0.0)


LINEAR_COSTS = [[b, d, h, 10.0 + b + h * d + 0.5 * d] for b in (1, 2, 4) for d in range(5) for h in {b, b // 2 or 1}]


def test_step_costs_are_the_recorded_ones_and_lines_between():
    trace = tiny_trace([[0] * 6], LINEAR_COSTS)
    for b, d, h, seconds in LINEAR_COSTS:
        assert trace.step_seconds(b, d, h * d) == pytest.approx(seconds)
    assert trace.step_seconds(4, 3, 9) == pytest.approx(10 + 4 + 9 + 1.5)  # a ragged fill: on the line in rows
    assert trace.step_seconds(3, 2, 6) == pytest.approx(10 + 3 + 6 + 1.0)  # between batch 2 and 4
    assert trace.step_seconds(3, 0, 5) == trace.step_seconds(3, 0, 0)  # no levels, no extra rows


def test_a_trace_missing_what_a_replay_needs_is_refused():
    with pytest.raises(ValueError, match="matches"):
        tiny_trace([[0] * 5], LINEAR_COSTS)
    with pytest.raises(ValueError, match="uniform shapes"):
        tiny_trace([[0] * 6], [c for c in LINEAR_COSTS if c[1] != 3])
    with pytest.raises(ValueError, match="batch"):
        replay(tiny_trace([[0] * 6], LINEAR_COSTS), 0)
    with pytest.raises(ValueError, match="batch"):
        replay_fixed(tiny_trace([[0] * 6], LINEAR_COSTS), 0, 1)
    with pytest.raises(TypeError, match="policy"):
        replay_policy(tiny_trace([[0] * 6], LINEAR_COSTS), 1, "depth 2")


def test_the_sweeps_work_is_six_requests_cycled_through_the_pool():
    assert sweep_groups(range(4), 1) == [[0], [1], [2], [3], [0], [1]]
    assert sweep_groups(range(4), 4) == [[0, 1, 2, 3]]
    assert sweep_groups(range(4), 8) == [[0, 1, 2, 3, 0, 1, 2, 3]]  # one group, however large the batch
    with pytest.raises(ValueError, match="batch"):
        sweep_groups(range(4), 0)
    with pytest.raises(ValueError, match="pool"):
        sweep_groups([], 2)


class Fixed(AdaptiveSpeculation):
    """A controller that always drafts ``depth`` tokens (within each request's limit): the replay's charges alone."""

    def __init__(self, clock, depth: int):
        super().__init__(clock=clock)
        self.depth = depth

    def choose(self, running, limits, contexts):
        super().choose(running, limits, contexts)
        return [max(0, min(self.depth, x)) for x in limits]


def test_a_step_after_steps_of_the_other_kind_is_charged_the_switch_penalty():
    """One prompt, 6 tokens, nothing accepted (each step emits one token), plain costing 11 and one level 12.5 a
    step. Fixed depth 2 drafts until the last step, whose limit (no token left to draft) makes it plain: only that
    step pays, ``1 + plain``. A rule alternating plain and one level pays on every step after the first while the
    penalty lasts one step; lasting two steps changes nothing there (each step's last two hold the other kind); no
    penalty and a zero one charge alike, and the controller's replay is charged the same way."""
    trace = tiny_trace([[0] * 6], LINEAR_COSTS)
    switch = SwitchPenalty(plain=0.5, drafting=0.25, steps=1)
    drafting_step = 11.0 + 1 + 0.5  # one level: batch 1, one extra row, one draft level (LINEAR_COSTS)
    assert replay_fixed(trace, 1, 1, switch) == pytest.approx(6 * (5 * drafting_step + 11.0 * 1.5))
    assert replay_fixed(trace, 1, 1, SwitchPenalty(0.0, 0.0)) == replay_fixed(trace, 1, 1)
    alternate = lambda prompts: lambda running, limits, contexts: [  # noqa: E731
        min(1, limits[0]) if (6 - 1 - limits[0]) % 2 else 0]  # fmt: skip
    # steps 0..5 go plain, one level, plain, one level, plain, plain (the last has no token left to draft)
    unpenalised = 6 * (4 * 11.0 + 2 * drafting_step)
    assert replay_policy(trace, 1, alternate) == pytest.approx(unpenalised)
    one_step = 6 * (11.0 + 2 * drafting_step * 1.25 + 2 * 11.0 * 1.5 + 11.0)  # the last plain follows a plain
    assert replay_policy(trace, 1, alternate, switch) == pytest.approx(one_step)
    two_steps = 6 * (11.0 + 2 * drafting_step * 1.25 + 3 * 11.0 * 1.5)  # the last plain: a drafting step 2 back
    assert replay_policy(trace, 1, alternate, SwitchPenalty(0.5, 0.25, steps=2)) == pytest.approx(two_steps)
    plain_only = replay(trace, 1, noise=0.0, controller=lambda clock: Fixed(clock, 0))
    charged = replay(trace, 1, noise=0.0, controller=lambda clock: Fixed(clock, 0), switch=switch)
    assert charged.seconds == plain_only.seconds  # never switching, never charged
    with pytest.raises(ValueError, match="plain"):
        SwitchPenalty(plain=-0.1, drafting=0.0)
    with pytest.raises(ValueError, match="steps"):
        SwitchPenalty(plain=0.1, drafting=0.0, steps=0)
    with pytest.raises(TypeError, match="switch"):
        replay_fixed(trace, 1, 1, (0.5, 0.25))


def test_fixed_depths_are_charged_their_steps():
    """One prompt (the sweep's work at batch 1: six groups of it), 6 tokens, the draft matching 2 tokens everywhere:
    depth 2 emits 3 tokens a step (2 steps), depth 1 emits 2 (3 steps), plain decoding 1 (6 steps)."""
    trace = tiny_trace([[2] * 6], LINEAR_COSTS)
    assert replay_fixed(trace, 1, 0) == pytest.approx(6 * 6 * 11.0)
    assert replay_fixed(trace, 1, 1) == pytest.approx(6 * 3 * (11.0 + 1.5))
    assert replay_fixed(trace, 1, 2) == pytest.approx(6 * 2 * (11.0 + 3.0))
    # depth 4 drafts 4 (2 accepted, 3 emitted), then 2 (the most the last 3 tokens leave to draft): 2 steps
    assert replay_fixed(trace, 1, 4) == pytest.approx(6 * ((11.0 + 6.0) + (11.0 + 3.0)))


@pytest.mark.parametrize(("noise", "drift", "steps"), [(0.04, 0.10, 20.0), (0.03, 0.15, 50.0), (0.05, 0.0, 1.0)])
def test_the_drift_fit_finds_the_model_it_was_drawn_from(noise, drift, steps):
    """5000 steps of independent noise plus an AR(1) drift: the fit's three figures are near the drawn ones (no
    drift: a drift of at most a fifth of the noise)."""
    rng, rho = random.Random(1), math.exp(-1 / steps)
    level, residuals = drift * rng.gauss(0, 1), []
    for _ in range(5000):
        level = rho * level + drift * math.sqrt(1 - rho * rho) * rng.gauss(0, 1)
        residuals.append(level + noise * rng.gauss(0, 1))
    fit_noise, fit_drift_sd, fit_steps = fit_drift(residuals)
    assert fit_noise == pytest.approx(noise, rel=0.3)
    if drift:
        assert fit_drift_sd == pytest.approx(drift, rel=0.2) and fit_steps == pytest.approx(steps, rel=0.3)
    else:
        assert fit_drift_sd < noise / 5
    with pytest.raises(ValueError, match="residuals"):
        fit_drift(residuals[:3])


def test_a_replay_is_deterministic_per_seed_and_noise_moves_it():
    trace = Trace.load(TRACE)
    first, again = replay(trace, 4, noise=0.04, seed=3), replay(trace, 4, noise=0.04, seed=3)
    assert first == again
    assert any(replay(trace, 4, noise=0.04, seed=s) != first for s in range(4, 8))


def test_stalled_steps_cost_the_controller_and_the_shape_cap_wins_part_of_it_back(monkeypatch):
    """2% of the steps stalled 15-40% (as seen live), the current engine's trace, batch 2 and 8, 8 seeds: the
    controller's mean ratio to the best fixed depth drops against the same seeds without stalls, and drops less with
    the shape means' step cap (``SHAPE_STEP_CAP``) than without it; a stall share outside [0, 1] is refused."""
    import specdec.decoding.step_cost as step_cost

    trace = Trace.load(CURRENT_TRACE)

    def mean_ratio(stalls):
        ratios = []
        for batch in (2, 8):
            best = min(replay_fixed(trace, batch, k) for k in range(trace.max_depth + 1))
            ratios += [best / replay(trace, batch, seed=s, stalls=stalls).seconds for s in range(8)]
        return sum(ratios) / len(ratios)

    calm, capped = mean_ratio(0.0), mean_ratio(0.02)
    monkeypatch.setattr(step_cost, "SHAPE_STEP_CAP", 10.0)
    uncapped = mean_ratio(0.02)
    assert uncapped < capped < calm, (uncapped, capped, calm)
    with pytest.raises(ValueError, match="stalls"):
        replay(trace, 2, stalls=1.5)


def test_ragged_fills_a_row_apart_share_one_measured_mean():
    """Steps of shapes (4 requests, 3 levels) with 11 and 12 extra rows are one shape to the cost model; a fill
    whose mean depth rounds elsewhere (6 extra rows) is another. A shape's first step ran cold: the next replaces
    it, and later ones average with a fading weight (the third step here within the shape's step cap)."""
    model = StepCostModel()
    for seconds, rows in ((50.0, 12), (20.0, 11), (21.5, 12), (30.0, 6)):
        model.observe(StepCostModel.features(4, rows, 3, 400.0), seconds)
    assert set(model.shape_mean) == {(4, 3, 3), (4, 3, 2)}
    seconds, _, rows, weight = model.shape_mean[4, 3, 3]
    assert weight == pytest.approx(1.7)
    assert seconds == pytest.approx((0.7 * 20 + 21.5) / 1.7) and rows == pytest.approx((0.7 * 11 + 12) / 1.7)
    assert model.shape_mean[4, 3, 2][0] == pytest.approx(30)


@pytest.mark.parametrize("batch", [1, 2, 4, 8, 16, 32])
def test_the_controller_stays_near_the_best_fixed_depth_on_the_recorded_trace(batch):
    """Step times noisy by 4% (this machine's step-to-step noise), 8 seeds: the mean of the best fixed depth's (or
    plain decoding's) time over the controller's stays at or above the bound. A regression guard at what the
    controller reaches (bench/RESULTS.md, the replay section), not the issue's 0.97 target."""
    trace = Trace.load(TRACE)
    best = min(replay_fixed(trace, batch, k) for k in range(trace.max_depth + 1))
    ratios = [best / replay(trace, batch, noise=0.04, seed=s).seconds for s in range(8)]
    assert sum(ratios) / len(ratios) >= BOUND[batch], ratios


BOUND = {1: 0.97, 2: 0.97, 4: 0.94, 8: 0.955, 16: 0.965, 32: 0.965}  # about 2% under the 8-seed means


def test_a_controller_that_always_drafts_its_longest_fails_the_bound():
    """The bound can fail: a controller that never shortens its drafts is far below it at batch 32."""

    def longest(clock):  # each request drafts as far as it may: its limit, within the strategy's size
        return AdaptiveSpeculation(clock=clock, forced=lambda step, running, limits: limits)

    trace = Trace.load(TRACE)
    best = min(replay_fixed(trace, 32, k) for k in range(trace.max_depth + 1))
    assert best / replay(trace, 32, noise=0.04, controller=longest).seconds < BOUND[32]


def test_the_benchmark_records_a_trace_and_replays_it(tmp_path):
    """``bench/bench_adaptive_replay.py`` on the embedded pair, batches 1 and 2, depth 2, one round: a trace whose
    matches are the draft's accepted tokens (within the depth) over ``--match-tokens``, whose costs cover every
    recorded shape, whose join costs every joining shape and with the drafter's catch-up priced, then the replay's
    table (with a switch penalty, named in its title)."""
    trace_path = tmp_path / "trace.json"
    args = ["--record", str(trace_path), "--trace", str(trace_path), "--batches", "1", "2", "--max-depth", "2",
            "--rounds", "1", "--drift-passes", "12", "--seeds", "2", "--out", str(tmp_path), "--oracles",
            "--switch-penalty", "0.3", "0.1", "--match-tokens", "56"]  # fmt: skip
    done = run_bench("bench_adaptive_replay.py", *args, cpu_path=True)
    assert done.returncode == 0, done.stderr
    data = json.loads(trace_path.read_text())
    assert data["new_tokens"] == 48 and all(len(row) == 56 and set(row) <= {0, 1, 2} for row in data["matches"])
    joins = {(running, levels): price for running, levels, price in data["join_costs"]}
    assert set(joins) == {(0, 0)} | {(running, levels) for running in (1, 4, 7) for levels in (0, 1, 2)}
    assert all(0 < price < 0.01 for price in joins.values()), "seconds per prompt token"
    assert 0 < data["catch_up_price"] < 0.01, "seconds per token the drafter catches up"
    assert {(b, d, h) for b, d, h, _ in data["costs"]} == {(1, 0, 1), (1, 1, 1), (1, 2, 1), (2, 0, 2), (2, 1, 2),
                                                            (2, 1, 1), (2, 2, 2), (2, 2, 1)}  # fmt: skip
    assert all(seconds > 0 for *_, seconds in data["costs"])
    # Step times vary: the fit puts it in the independent noise, the drift or both (on a loaded machine, with few
    # steps, a drift over about one step can take all of it).
    assert data["relative_noise"] >= 0 and data["drift"] >= 0 and data["relative_noise"] + data["drift"] > 0
    assert data["drift_steps"] >= 1
    assert "switch penalty 30% / 10% over 4 steps" in (tmp_path / "adaptive_replay.md").read_text()
    for name in ("adaptive_replay", "adaptive_oracles"):
        table = (tmp_path / f"{name}.md").read_text()
        assert [line.split("|")[1].strip() for line in table.splitlines() if line[:3] in ("| 1", "| 2")] == ["1", "2"]


def test_a_rule_that_weighs_the_batchs_finish_drafts_less_for_a_request_that_finishes_early():
    """Two prompts, one whose drafts are always accepted and one whose never are, and steps whose drafting costs a
    fixed part: the step's own tokens per second (``oracle(..., "step")``) drafts deep for both (the leader's
    tokens pay for the step), and the pair still finishes with the laggard, 6 steps on; weighing the time until
    the last request finishes (``"finish"``) decodes plainly and is faster. Also: ``replay_policy`` runs a rule
    with the group's prompt indices (drafting for the prompt that accepts costs less than for the one that does
    not)."""
    from bench_adaptive_replay import oracle

    costs = [[b, d, h, 10.0 + b + h * d + 0.5 * d + (8.0 if d else 0.0)] for b in (1, 2) for d in range(5)
             for h in {b, b // 2 or 1}]  # fmt: skip
    trace = tiny_trace([[4] * 6, [0] * 6], costs)
    step, finish = (replay_policy(trace, 2, oracle(trace, o, own_acceptance=True)) for o in ("step", "finish"))
    assert finish < step and finish == pytest.approx(replay_fixed(trace, 2, 0)), (step, finish)

    def drafts_only_for(prompt):
        return lambda prompts: lambda running, limits, contexts: [
            min(4, x) if prompts[r] == prompt else 0 for r, x in zip(running, limits)]  # fmt: skip

    assert replay_policy(trace, 2, drafts_only_for(0)) < replay_policy(trace, 2, drafts_only_for(1))


def test_the_sweeps_held_out_ratio_never_picks_a_reference_by_the_round_it_compares():
    """``e2e_sweep.held_out_ratio`` (``bench_e2e.py --sweep-only``): each round against the reference fastest in
    the other rounds, where ``paired_ratio`` takes the one fastest in all of them, that round included."""
    from e2e_sweep import held_out_ratio, paired_ratio

    rounds = {"a": [8.0, 12.0, 10.4], "b": [10.2, 10.2, 10.6], "adaptive": [10.0, 10.0, 10.0]}
    # all rounds: b (median 10.2) beats a (10.4): ratios 1.02, 1.02, 1.06
    assert paired_ratio(rounds, ["a", "b"], "adaptive") == pytest.approx(1.02)
    # without round 1: a 11.2, b 10.4 -> b (1.02); without round 2: a 9.2 -> a (1.2); without round 3: a 10 -> a (1.04)
    assert held_out_ratio(rounds, ["a", "b"], "adaptive") == pytest.approx(1.04)
    assert held_out_ratio({"a": [1.0], "adaptive": [1.0]}, ["a"], "adaptive") is None
