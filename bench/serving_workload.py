"""The serving benchmark's workload and figures, shared by its live runs (``bench_serving.py``) and its replay on a
recorded trace (``serving_replay.py``): seeded Poisson arrivals, and per run throughput, time to first token and
time per output token, summarised over rounds and paired round by round."""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Workload(Generic[T]):
    """Request i arrives at ``arrivals[i]`` seconds with ``prompts[i]`` and asks for ``lengths[i]`` tokens."""

    arrivals: list[float]
    prompts: list[T]
    lengths: list[int]


@dataclass(frozen=True)
class Served:
    """One run's figures: tokens per second, per request TTFT and TPOT in seconds, and the mean tokens a request
    got per step (first tokens included)."""

    throughput: float
    ttft: list[float]
    tpot: list[float]
    tokens_per_step: float


def workload(pool: Sequence[T], requests: int, rate: float, lengths: tuple[int, int], seed: int) -> Workload[T]:
    """Poisson arrivals at ``rate`` requests per second (seeded), the prompt pool in turn from a seeded start, output
    lengths uniform in ``lengths``."""
    rng = random.Random(seed)
    now, arrivals = 0.0, []
    for _ in range(requests):
        arrivals.append(now)
        now += rng.expovariate(rate)
    start = rng.randrange(len(pool))
    prompts = [pool[(start + i) % len(pool)] for i in range(requests)]
    return Workload(arrivals, prompts, [rng.randint(*lengths) for _ in range(requests)])


def served(work: Workload, first: dict[int, float], last: dict[int, float], emitted: Sequence[int],
           per_step: Sequence[float]) -> Served:  # fmt: skip
    """A run's figures from when each request got its first (``first``) and last (``last``) token, the tokens each
    got (``emitted``) and the mean tokens per request of each step (``per_step``)."""
    n = len(work.arrivals)
    ttft = [first[i] - work.arrivals[i] for i in range(n)]
    tpot = [(last[i] - first[i]) / (emitted[i] - 1) for i in range(n) if emitted[i] > 1]
    return Served(sum(emitted) / (max(last.values()) - work.arrivals[0]), ttft, tpot, statistics.mean(per_step))


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) by linear interpolation between the order statistics."""
    ordered = sorted(values)
    x = (len(ordered) - 1) * q / 100
    i = int(x)
    return ordered[i] if i + 1 >= len(ordered) else ordered[i] + (x - i) * (ordered[i + 1] - ordered[i])


def summarise(runs: list[Served]) -> dict[str, float]:
    """Per figure, the median over the rounds of each run's value (ms for times)."""

    def median(f) -> float:
        return statistics.median(f(run) for run in runs)

    figures = dict(throughput=median(lambda r: r.throughput), tokens_per_step=median(lambda r: r.tokens_per_step))
    for what in ("ttft", "tpot"):
        for q in (50, 99):
            figures[f"{what}_p{q}"] = median(lambda r, w=what, q=q: percentile(getattr(r, w), q)) * 1e3
    return figures


def paired(runs: list[Served], against: list[Served], figure) -> tuple[float, float, float]:
    """(median, lowest, highest) over the rounds of ``figure(run) / figure(other run)``: each round's two runs served
    the same arrivals, so the ratio leaves out how the rounds' workloads differ."""
    ratios = sorted(figure(a) / figure(b) for a, b in zip(runs, against))
    return statistics.median(ratios), ratios[0], ratios[-1]


def p99_tpot(run: Served) -> float:
    return percentile(run.tpot, 99)
