"""Draft-depth policies for ``bench_serving.py``, each behind one interface: a fresh controller per run.

A policy's ``controller(clock)`` is what ``SpeculativeDecoder(adaptive=...)`` takes (an ``AdaptiveSpeculation``
reading ``clock``: per-thread CPU time live, a simulated clock in the replay, ``serving_replay.py``):
the engine asks it for every running request's depth before each step (``choose``), tells it when new requests
take slots (``forget``) and what each step cost and accepted (``observe``). The policies:

* ``FixedDepth(d)``: every request drafts ``d`` tokens every step (0: plain decoding), through the controller's
  ``forced`` option;
* ``Adaptive()``: specdec's per-request controller with its defaults (what the benchmark judges);
* ``SlotAdmission(costs)``: batch-wide slot admission in the style of vLLM's adaptive verification (PR #47808):
  every draft slot (request r, position i) of the batch is scored by its survival probability, the product of
  request r's acceptance at positions 1..i, and the B best slots of the whole batch are admitted, B maximising
  the batch's expected tokens (requests + admitted survivals) per second of a step as priced by a cost table
  timed at start-up (``CostTable.profile``: steps of every batch size and uniform depth). vLLM scores slots
  with the drafter's live confidences; here, where reading the draft's probabilities back would be a second host
  synchronisation per step, a request's confidences are its observed acceptance per position, smoothed with an
  exponential moving average (factor 0.8, as vLLM smooths its confidences), starting from the batch's.
"""

from __future__ import annotations

import bisect
import itertools
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

from specdec.decoding import AdaptiveSpeculation, SpeculativeDecoder

EMA = 0.8  # weight of a request's earlier confidence in each update (vLLM's default smoothing)
POOLED_EMA = 0.99  # the batch's confidence per position, the seed of a new request's
PRIOR = 0.6  # confidence at every position before anything was observed


class FixedDepth:
    """``d`` draft tokens per request every step (within each request's limit); 0 is plain decoding."""

    def __init__(self, depth: int):
        self.depth = depth
        self.name = "plain" if depth == 0 else f"K={depth}"

    def controller(self, clock=time.thread_time) -> AdaptiveSpeculation:
        return AdaptiveSpeculation(clock=clock, forced=lambda step, running, limits: [self.depth] * len(running))


class Adaptive:
    """specdec's adaptive controller, defaults as shipped (its clock per-thread CPU time, as the benchmark's)."""

    name = "adaptive"

    def controller(self, clock=time.thread_time) -> AdaptiveSpeculation:
        return AdaptiveSpeculation(clock=clock)


@dataclass(frozen=True)
class CostTable:
    """Seconds of a step by batch size and uniform draft depth, timed at start-up (``profile``).

    ``seconds[i][d]``: the median step of ``batches[i]`` requests drafting ``d`` tokens each (d = 0 .. max_depth).
    """

    batches: tuple[int, ...]
    seconds: tuple[tuple[float, ...], ...]

    @classmethod
    def profile(cls, make_decoder, prompts: Sequence[Sequence[int]], batches: Sequence[int], max_depth: int,
                steps: int = 12) -> CostTable:  # fmt: skip
        """Time ``steps`` steps (after two untimed ones) of each batch size at each uniform depth, the median: an
        engine per shape, its requests long enough to run throughout; each row made non-decreasing in the depth.
        ``make_decoder(controller)`` builds the decoder."""
        table = []
        for batch in batches:
            row = []
            for depth in range(max_depth + 1):
                times: list[float] = []
                controller = AdaptiveSpeculation(clock=time.thread_time, forced=lambda s, r, lim, d=depth: [d] * len(r),
                                                 on_step=lambda seconds, *rest, t=times: t.append(seconds))  # fmt: skip
                decoder: SpeculativeDecoder = make_decoder(controller)
                limit = (steps + 3) * (max_depth + 1)
                engine = decoder.engine(max_batch=batch, max_len=max(map(len, prompts)) + limit + max_depth + 1)
                for b in range(batch):
                    engine.add_request(prompts[b % len(prompts)], max_new_tokens=limit, eos_token_id=None)
                for _ in range(steps + 3):  # the prefill, then two untimed steps
                    engine.step()
                row.append(statistics.median(times[2:]))
            table.append(tuple(itertools.accumulate(row, max)))  # a deeper draft never costs less: noise out
        return cls(tuple(batches), tuple(table))

    def capacity(self, slots: int, mean_tokens: float) -> float:
        """Requests per second plain decoding serves with ``slots`` requests of ``mean_tokens`` tokens running at once
        (its step at the largest batch timed): ``bench_serving.py``'s load 1."""
        return slots / (self.seconds[-1][0] * mean_tokens)

    def cost(self, batch: int, drafted: int) -> float:
        """Seconds of a step of ``batch`` requests drafting ``drafted`` tokens in all: linear in the mean depth
        between the timed depths, and in the batch size between the timed ones (beyond them, the nearest)."""
        i = bisect.bisect_left(self.batches, batch)
        if i == 0 or i == len(self.batches):
            i = min(i, len(self.batches) - 1)
            return self._at_depth(i, drafted / batch)
        lo, hi = self.batches[i - 1], self.batches[i]
        w = (batch - lo) / (hi - lo)
        return (1 - w) * self._at_depth(i - 1, drafted / batch) + w * self._at_depth(i, drafted / batch)

    def _at_depth(self, i: int, depth: float) -> float:
        row = self.seconds[i]
        depth = min(max(depth, 0.0), len(row) - 1)
        d = int(depth)
        if d == len(row) - 1:
            return row[d]
        return row[d] + (depth - d) * (row[d + 1] - row[d])


def admit(survival: Sequence[Sequence[float]], cost) -> list[int]:
    """Depths of a batch-wide admission: ``survival[r][i]`` is request r's chance that its drafts 1 .. i + 1 are all
    accepted (non-increasing in i); ``cost(drafted)`` the seconds of a step drafting that many tokens in all. The
    slots are taken best first; of every such prefix, the one with the most expected tokens per second wins.

    >>> admit([[0.9, 0.8], [0.5]], lambda drafted: 1.0 + 0.1 * drafted)   # (2 + 0.9 + 0.8) / 1.2 beats the rest
    [2, 0]
    """
    slots = sorted(((s, -i, r) for r, row in enumerate(survival) for i, s in enumerate(row)), reverse=True)
    requests = len(survival)
    best, best_rate, gain = 0, requests / cost(0), 0.0
    for taken, (s, _, _) in enumerate(slots, 1):
        gain += s
        rate = (requests + gain) / cost(taken)
        if rate > best_rate:
            best, best_rate = taken, rate
    depths = [0] * requests
    for _, _, r in slots[:best]:
        depths[r] += 1
    return depths


class SlotAdmission:
    """Batch-wide slot admission (see the module docstring) over the step costs of ``costs``."""

    name = "slot admission"

    def __init__(self, costs: CostTable, max_depth: int):
        self.costs, self.max_depth = costs, max_depth

    def controller(self, clock=time.thread_time) -> AdaptiveSpeculation:
        return _SlotAdmissionController(self.costs, self.max_depth, clock)


class _SlotAdmissionController(AdaptiveSpeculation):
    """The engine's controller interface around ``admit``: depths through ``forced``, acceptance from ``on_step``,
    and a slot's confidences dropped when a new request takes it (``forget``)."""

    def __init__(self, costs: CostTable, max_depth: int, clock):
        super().__init__(clock=clock, forced=self._depths, on_step=self._observe)
        self.costs, self.top = costs, max_depth
        self.pooled = [PRIOR] * max_depth
        self.confidence: dict[int, list[float]] = {}

    def forget(self, slots: Sequence[int]) -> None:
        super().forget(slots)
        for b in slots:
            self.confidence.pop(b, None)

    def _depths(self, step: int, running: Sequence[int], limits: Sequence[int]) -> list[int]:
        survival = []
        for b, limit in zip(running, limits):
            confidence, reach, row = self.confidence.get(b, self.pooled), 1.0, []
            for i in range(max(0, min(limit, self.top))):
                reach *= confidence[i]
                row.append(reach)
            survival.append(row)
        return admit(survival, lambda drafted: self.costs.cost(len(running), drafted))

    def _observe(self, seconds, running, nodes, depths, accepted, contexts) -> None:
        for b, depth, a in zip(running, depths, accepted):
            if a is None or depth == 0:
                continue
            own = self.confidence.setdefault(b, list(self.pooled))
            for i in range(min(depth, a + 1)):  # positions 1 .. a + 1 were tested
                hit = float(a > i)
                own[i] = EMA * own[i] + (1 - EMA) * hit
                self.pooled[i] = POOLED_EMA * self.pooled[i] + (1 - POOLED_EMA) * hit
