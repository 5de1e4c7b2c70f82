"""A controller that drafts a fixed pattern of depths and records every step (issue 16 benches).

The adaptive controller's hooks (``choose`` before a step, ``observe`` after its read-back) are where a step's
depths are set and where its time and acceptance are known, so the benchmarks that study the controller's inputs
drive the decoder through its declared options instead of patching the engine: ``forced`` gives the depths from
a pattern (nothing is learnt), ``on_step`` keeps each step as a ``StepRecord``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from specdec.decoding import AdaptiveSpeculation


@dataclass(frozen=True)
class StepRecord:
    """One step: the requests it ran, the depth the pattern asked for, the deepest tree drafted (less where a
    request's limit cut it), its thread seconds and the drafted tokens each request had accepted (None: invalid)."""

    running: int
    depth: int
    drafted: int
    seconds: float
    accepted: tuple[int | None, ...]


class ForcedDepths:
    """Not adaptive: step k of each stream drafts ``pattern(k)`` tokens per request (within its limit); every step is
    appended to ``steps``. ``controller`` is what the decoder takes (``SpeculativeDecoder(..., adaptive=...)``)."""

    def __init__(self, pattern: Callable[[int], int]):
        self.pattern, self.depth, self.steps = pattern, 0, []
        self.controller = AdaptiveSpeculation(clock=time.thread_time, forced=self._depths, on_step=self._record)

    def _depths(self, step: int, running: Sequence[int], limits: Sequence[int]) -> list[int]:
        self.depth = self.pattern(step)
        return [self.depth] * len(running)

    def _record(self, seconds, running, nodes, depths, accepted, contexts) -> None:
        self.steps.append(StepRecord(len(running), self.depth, max(depths, default=0), seconds, tuple(accepted)))


def full_batch_ms(steps: Sequence[StepRecord], batch: int, depth: int) -> float | None:
    """The median ms of the ``steps`` that ran all ``batch`` requests at ``depth`` (None without any)."""
    times = [s.seconds for s in steps if s.running == batch and s.depth == s.drafted == depth]
    return statistics.median(times) * 1e3 if times else None
