"""A stand-in adaptive controller that drafts a fixed pattern of depths and records every step (issue 16 benches).

The adaptive controller's hooks (``choose`` before a step, ``observe`` after its read-back) are where a step's
depths are set and where its time and acceptance are known, so the benchmarks that study the controller's inputs
drive the decoder through this subclass instead of patching the engine: depths come from a pattern, nothing is
learnt, and each step is kept as a ``StepRecord``.
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


class ForcedDepths(AdaptiveSpeculation):
    """Not adaptive: step k of each stream drafts ``pattern(k)`` tokens per request (within its limit); every step is
    appended to ``steps``."""

    def __init__(self, pattern: Callable[[int], int]):
        super().__init__(clock=time.thread_time)
        self.pattern, self.step, self.steps = pattern, 0, []

    def start(self) -> None:
        super().start()
        self.step = 0

    def choose(self, running, limits, contexts):
        self.depth = self.pattern(self.step)
        self.step += 1
        self._started = self.clock()
        return [max(0, min(self.depth, limit)) for limit in limits]

    def observe(self, running, nodes, depths, accepted, contexts):
        seconds = self.clock() - self._started
        self.steps.append(StepRecord(len(running), self.depth, max(depths, default=0), seconds, tuple(accepted)))


def full_batch_ms(steps: Sequence[StepRecord], batch: int, depth: int) -> float | None:
    """The median ms of the ``steps`` that ran all ``batch`` requests at ``depth`` (None without any)."""
    times = [s.seconds for s in steps if s.running == batch and s.depth == s.drafted == depth]
    return statistics.median(times) * 1e3 if times else None
