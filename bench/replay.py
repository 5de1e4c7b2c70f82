"""Replaying the adaptive controller on a recorded trace: its choices judged without timing whole runs.

Timing real decoding cannot tell a controller loss of a few percent from a machine's drift. Greedy
speculation with a draft chain is a function of two things the controller does not change: which draft
tokens the target accepts (at text position p, the draft's greedy chain matches the target's next
``matches[p]`` tokens, so a chain of depth d gets ``min(d, matches[p])`` accepted), and what each step
shape costs. A ``Trace`` holds both, recorded once (``bench/bench_adaptive_replay.py --record``); ``replay``
then runs the controller against a simulated clock whose step times are the recorded ones times the machine's
drifting speed and independent noise (``fit_drift`` measures both), while the run is charged the recorded times
themselves -- so every seed's result is exact, and fixed depths (``replay_fixed``) are charged the same way.

The replay mirrors the batch sweep (``bench/bench_e2e.py --sweep-only``): per batch size B, ``max(1, 6 //
B)`` groups of B prompts from the trace's pool (cycled), ``new_tokens`` each; one untimed pass warms the
controller, then ``passes`` timed passes; a step's cost is looked up by its shape (running requests,
draft levels, extra rows), interpolated between the recorded shapes. Optionally (``SwitchPenalty``) a step within a
few steps of one of the other kind (plain after drafting, drafting after plain) costs more, as on a CPU whose
caches hold the model (``bench/bench_step_mixing.py``).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from specdec.decoding.adaptive import AdaptiveSpeculation

DEFAULT_NOISE = 0.05  # relative step-time noise when a trace does not say
GROUP_WORK = 6  # requests per batch-size's work, as in the sweep: max(1, 6 // B) groups of B
T = TypeVar("T")


@dataclass
class Trace:
    """A recorded trace: acceptance per prompt and position, step costs per shape.

    ``matches[i][p]``: draft tokens the target accepts after prompt i's first p generated tokens (at most
    ``max_depth``); ``costs``: rows ``[batch, levels, drafting requests, seconds]``, every request drafting
    ``levels`` tokens or the first ``drafting requests`` of them and the rest none; ``relative_noise``: one
    step's time's independent relative noise; ``drift`` and ``drift_steps``: the machine's speed drift (its log's
    standard deviation, and the steps over which its correlation falls by e), both as ``fit_drift`` measures them
    (no drift when the trace does not say); ``join_costs``: rows ``[running, levels, seconds per prompt token]``,
    what a joining prompt adds to a step of ``running`` requests drafting ``levels`` tokens (traces recorded before
    the serving replay have none); ``catch_up_price``: seconds per token the drafter feeds in a forward of its own when
    it owes more than a few (a joined request's prompt, a run of plain steps; none in traces recorded before)."""

    machine: str
    new_tokens: int
    max_depth: int
    prompt_lengths: list[int]
    matches: list[list[int]]
    costs: list[list[float]]
    relative_noise: float = DEFAULT_NOISE
    drift: float = 0.0
    drift_steps: float = 1.0
    join_costs: list[list[float]] | None = None
    catch_up_price: float | None = None

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        data = json.loads(Path(path).read_text())
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})

    def __post_init__(self):
        if any(len(row) < self.new_tokens for row in self.matches) or len(self.prompt_lengths) != len(self.matches):
            raise ValueError(f"matches must hold new_tokens ({self.new_tokens}) entries per prompt, one prompt per "
                             "prompt_lengths entry")  # fmt: skip
        self._table = {(round(b), round(d), round(h)): s for b, d, h, s in self.costs}
        self._batches = sorted({b for b, _, _ in self._table})
        missing = [(b, d) for b in self._batches for d in range(self.max_depth + 1) if (b, d, b) not in self._table]
        if missing:
            raise ValueError(f"costs lack the uniform shapes (batch, levels) {missing[:4]} (every batch recorded needs "
                             f"levels 0 .. max_depth = {self.max_depth})")  # fmt: skip

    def step_seconds(self, running: int, levels: int, extra_rows: int) -> float:
        """A step's recorded cost: between the two recorded batch sizes around ``running``, each priced by a line
        in the extra rows through its uniform and half-drafting shapes at ``levels``."""
        low = max((b for b in self._batches if b <= running), default=self._batches[0])
        high = min((b for b in self._batches if b >= running), default=self._batches[-1])
        w = 0.0 if high == low else (running - low) / (high - low)
        return (1 - w) * self._at(low, levels, extra_rows * low / running) + w * self._at(
            high, levels, extra_rows * high / running
        )

    def join_seconds(self, running: int, levels: int, tokens: int) -> float:
        """What joining prompts of ``tokens`` tokens in all add to a step of ``running`` requests drafting up to
        ``levels`` tokens: the price per token of the recorded shape nearest in running requests, then in levels."""
        if not self.join_costs:
            raise ValueError("this trace has no join costs: record it again (bench_adaptive_replay.py --record)")
        _, _, price = min(self.join_costs, key=lambda row: (abs(row[0] - running), abs(row[1] - levels)))
        return price * tokens

    def _at(self, batch: int, levels: int, extra_rows: float) -> float:
        uniform = self._table[batch, levels, batch]
        half = self._table.get((batch, levels, batch // 2))
        if levels == 0 or half is None or batch < 2:
            return uniform
        slope = (uniform - half) / (levels * (batch - batch // 2))
        return uniform + slope * (extra_rows - levels * batch)


@dataclass
class ReplayRun:
    seconds: float  # recorded seconds of one timed pass (the mean over passes)
    mean_depth: float  # mean chosen depth over the timed passes' request-steps


@dataclass(frozen=True)
class SwitchPenalty:
    """Step costs that depend on the steps before them (``bench/bench_step_mixing.py``): on a CPU whose caches hold
    most of the model, plain and drafting steps can run their GEMMs on different copies of the weights, so a step
    within ``steps`` steps of one of the other kind finds its working set evicted and costs ``1 + plain`` (a plain
    step) or ``1 + drafting`` (a drafting one) times its recorded time; ``bench/bench_step_mixing.py`` measures both
    shares per batch size."""

    plain: float
    drafting: float
    steps: int = 4

    def __post_init__(self):
        for name in ("plain", "drafting"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not 0.0 <= value <= 10.0:
                raise ValueError(f"{name} must be a share in [0, 10], got {value!r}")
        if not isinstance(self.steps, int) or self.steps < 1:
            raise ValueError(f"steps must be an int >= 1, got {self.steps!r}")


STALL_SLOWER = (0.15, 0.40)  # how much longer a stalled step takes, drawn uniformly (spanning what live runs show)


class NoisyClock:
    """The controller's clock: advanced by each step's recorded cost times the machine's speed (a drift: its log an
    AR(1) process of stationary standard deviation ``drift`` and correlation ``exp(-1 / drift_steps)`` from one
    step to the next) times independent noise; a share ``stalls`` of the steps also stall (``STALL_SLOWER``: a page
    fault, a preempted thread: live step times have a heavier tail than Gaussian noise)."""

    def __init__(self, noise: float, seed: int, drift: float = 0.0, drift_steps: float = 1.0, stalls: float = 0.0):
        self.now, self.noise, self.rng = 0.0, noise, random.Random(seed)
        self.drift, self.rho, self.stalls = drift, math.exp(-1.0 / drift_steps), stalls
        self.log_speed = drift * self.rng.gauss(0.0, 1.0) if drift else 0.0  # without drift, a seed draws as before

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        if self.drift:
            step = self.drift * math.sqrt(1 - self.rho**2) * self.rng.gauss(0.0, 1.0)
            self.log_speed = self.rho * self.log_speed + step
        seconds *= math.exp(self.log_speed) * max(0.5, 1.0 + self.noise * self.rng.gauss(0.0, 1.0))
        if self.stalls and self.rng.random() < self.stalls:  # (no draw without stalls: a seed replays as before)
            seconds *= 1.0 + self.rng.uniform(*STALL_SLOWER)
        self.now += seconds


def fit_drift(residuals: list[float], max_lag: int = 100) -> tuple[float, float, float]:
    """``(noise, drift, drift_steps)`` of consecutive steps' log-time residuals (each step's log time less its
    shape's and context's typical one): the model ``NoisyClock`` draws from -- independent noise of standard
    deviation ``noise`` plus a drift of standard deviation ``drift`` whose correlation from one step to the next
    is ``exp(-1 / drift_steps)`` -- fitted by least squares to the residuals' variogram at lags 1 .. ``max_lag``
    (half the mean squared difference of residuals that many steps apart: ``noise**2 + drift**2 * (1 - rho**lag)``).
    """
    n = len(residuals)
    lags = range(1, max(1, min(max_lag, n // 4)) + 1)
    if n < 2 * len(lags) + 2:
        raise ValueError(f"fit_drift needs at least {2 * len(lags) + 2} residuals, got {n}")
    gamma = [sum((residuals[k + lag] - residuals[k]) ** 2 for k in range(n - lag)) / (2 * (n - lag)) for lag in lags]
    best = None
    for steps in (1.25**i for i in range(32)):  # 1 .. ~1000 steps
        f = [1 - math.exp(-lag / steps) for lag in lags]
        a, b = _least_squares_nonnegative(f, gamma)
        error = sum((g - a - b * x) ** 2 for g, x in zip(gamma, f))
        if best is None or error < best[0]:
            best = (error, a, b, steps)
    _, a, b, steps = best
    return math.sqrt(a), math.sqrt(b), steps


def _least_squares_nonnegative(f: list[float], y: list[float]) -> tuple[float, float]:
    """``a, b >= 0`` minimising ``sum((y - a - b * f)**2)``."""
    mf, my = sum(f) / len(f), sum(y) / len(y)
    sff = sum((x - mf) ** 2 for x in f)
    b = sum((x - mf) * (v - my) for x, v in zip(f, y)) / sff if sff > 0 else 0.0
    a = my - b * mf
    if b < 0:
        return max(my, 0.0), 0.0
    if a < 0:  # through the origin
        return 0.0, max(sum(x * v for x, v in zip(f, y)) / max(sum(x * x for x in f), 1e-300), 0.0)
    return a, b


def sweep_groups(pool: Sequence[T], batch: int) -> list[list[T]]:
    """The batch sweep's work at batch size ``batch``: ``max(1, GROUP_WORK // batch)`` groups of ``batch`` items of
    ``pool``, cycled (``bench/bench_e2e.py --sweep-only``, the replay and ``bench/bench_finish_effect.py``).

    >>> sweep_groups("abcde", 2)
    [['a', 'b'], ['c', 'd'], ['e', 'a']]
    """
    if not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be an int >= 1, got {batch!r}")
    if len(pool) == 0:
        raise ValueError("pool must hold at least one item")
    return [[pool[(g * batch + i) % len(pool)] for i in range(batch)] for g in range(max(1, GROUP_WORK // batch))]


def _run_group(trace: Trace, prompts: list[int], choose, observe, switch: SwitchPenalty | None = None
               ) -> tuple[float, list[int]]:  # fmt: skip
    """One batch decoded to ``new_tokens`` each; returns (recorded seconds, every request-step's depth)."""
    generated = {r: 0 for r in range(len(prompts))}
    seconds, depths_seen = 0.0, []
    recent: list[bool] = []  # whether each of the group's last ``switch.steps`` steps drafted
    while generated:
        running = list(generated)
        limits = [trace.new_tokens - generated[r] - 1 for r in running]
        contexts = [trace.prompt_lengths[prompts[r]] + generated[r] for r in running]
        depths = choose(running, limits, contexts)
        accepted = [min(d, trace.matches[prompts[r]][generated[r]]) for r, d in zip(running, depths)]
        cost = trace.step_seconds(len(running), max(depths), sum(depths))
        if switch is not None:
            drafting = max(depths) > 0
            if any(kind != drafting for kind in recent):
                cost *= 1.0 + (switch.drafting if drafting else switch.plain)
            recent = (recent + [drafting])[-switch.steps :]
        seconds += cost
        observe(running, depths, accepted, contexts, cost)
        depths_seen += depths
        for r, a in zip(running, accepted):
            generated[r] += a + 1
            if generated[r] >= trace.new_tokens:
                del generated[r]
    return seconds, depths_seen


def replay(
    trace: Trace, batch: int, *, noise: float | None = None, seed: int = 0, passes: int = 5,
    drift: float | None = None, drift_steps: float | None = None, stalls: float = 0.0,
    controller: Callable[[Callable[[], float]], AdaptiveSpeculation] | None = None,
    switch: SwitchPenalty | None = None,
) -> ReplayRun:  # fmt: skip
    """The adaptive controller (``controller(clock)``, default ``AdaptiveSpeculation(clock=clock)``) on ``batch``
    requests at a time: recorded seconds per timed pass and the mean chosen depth. ``noise``, ``drift`` and
    ``drift_steps`` default to the trace's; ``stalls``: the share of steps that stall (none by default);
    ``switch``: what a step costs more after steps of the other kind (none by default)."""
    _check(batch, switch)
    if not isinstance(stalls, (int, float)) or not 0.0 <= stalls <= 1.0:
        raise ValueError(f"stalls must be a share in [0, 1], got {stalls!r}")
    clock = NoisyClock(
        trace.relative_noise if noise is None else noise, seed, trace.drift if drift is None else drift,
        trace.drift_steps if drift_steps is None else drift_steps, stalls,
    )  # fmt: skip
    ctl = controller(clock) if controller is not None else AdaptiveSpeculation(clock=clock)
    ctl.bind(trace.max_depth, trace.max_depth + 1)  # a chain: depth + 1 nodes

    def observe(running, depths, accepted, contexts, cost):
        clock.advance(cost)
        ctl.observe(running, [d + 1 for d in depths], depths, accepted, contexts)

    groups, total, chosen = sweep_groups(range(len(trace.matches)), batch), 0.0, []
    for p in range(passes + 1):  # the first pass warms the controller, as the sweep's warm-up does
        for prompts in groups if p else groups[:1]:
            ctl.start()
            seconds, depths = _run_group(trace, prompts, ctl.choose, observe, switch)
            if p:
                total, chosen = total + seconds, chosen + depths
    return ReplayRun(total / passes, sum(chosen) / max(len(chosen), 1))


def replay_fixed(trace: Trace, batch: int, depth: int, switch: SwitchPenalty | None = None) -> float:
    """Recorded seconds of one pass drafting ``depth`` tokens per request every step (0: plain decoding)."""
    return replay_policy(trace, batch, lambda prompts: lambda running, limits, contexts: [
        max(0, min(depth, x)) for x in limits], switch)  # fmt: skip


def replay_policy(trace: Trace, batch: int, policy: Callable[[list[int]], Callable],
                  switch: SwitchPenalty | None = None) -> float:  # fmt: skip
    """Recorded seconds of one pass of a fixed rule (no clock, no learning): ``policy(prompts)`` -- the group's
    prompt indices into the trace -- gives the group's ``choose(running, limits, contexts) -> depths``, where
    ``running`` indexes ``prompts`` and ``limits`` are the tokens each may still draft (what an oracle that
    reads the trace needs). ``switch``: as in ``replay``."""
    _check(batch, switch)
    if not callable(policy):
        raise TypeError(f"policy must be a callable taking the group's prompts, got {type(policy).__name__}")
    total = 0.0
    for prompts in sweep_groups(range(len(trace.matches)), batch):
        seconds, _ = _run_group(trace, prompts, policy(prompts), lambda *args: None, switch)
        total += seconds
    return total


def _check(batch: int, switch: SwitchPenalty | None) -> None:
    """The arguments every replay takes: a batch of at least one request, a ``SwitchPenalty`` or none."""
    if not isinstance(batch, int) or batch < 1:
        raise ValueError(f"batch must be an int >= 1, got {batch!r}")
    if switch is not None and not isinstance(switch, SwitchPenalty):
        raise TypeError(f"switch must be a SwitchPenalty or None, got {type(switch).__name__}")
