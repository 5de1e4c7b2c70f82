"""The serving benchmark replayed on a recorded trace: the depth policies judged on exact costs (issue 36).

Live serving runs (``bench_serving.py``) move by 10% or more from round to round on the same arrivals, more than
the policies differ. Greedy decoding with a draft chain depends on two things no policy changes: which draft tokens
the target accepts at each position of each prompt's text, and what each step shape costs. A ``Trace``
(``replay.py``, recorded by ``bench_adaptive_replay.py --record --match-tokens N``) holds both, and what a joining
prompt adds to a step. ``replay_serving`` runs the engine's serving loop on it: requests arrive at the workload's
seeded times in recorded seconds, take the lowest free slots and get their first token in the step they join (their
prompt's cost added to it, the step untimed for the controller, as the engine does), running requests draft the
depths the policy's controller chooses, and each step costs its shape's recorded time. The controller reads a clock
that adds the machine's noise and drift to those times (``NoisyClock``); the run is charged the recorded times
themselves, so a fixed depth's run is exact and an adaptive one's differs only by the noise it was shown.

The drafter's catch-up is replayed where the trace prices it (``catch_up_price``): a joined request's prompt fed to
the draft at its first step that drafts, and a run of plain steps fed when drafting resumes, both before the step as
the strategy's ``prepare`` runs them (the adaptive controller prices them through the ``owed_tokens`` hook, as live).
Not replayed: pausing in a bounded pool, and sampling (the text is the greedy one).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from replay import NoisyClock, Trace
from serving_policies import CostTable
from serving_workload import Served, Workload, served, workload

from specdec.decoding.adaptive import AdaptiveSpeculation
from specdec.decoding.draft_cache import FOLD_MISSING


def trace_costs(trace: Trace, batches: Sequence[int], max_depth: int) -> CostTable:
    """The slot admission's start-up cost table (``CostTable.profile``'s batch sizes and depths 0 .. ``max_depth``)
    read from the trace's recorded shapes instead of timed."""
    seconds = tuple(tuple(trace.step_seconds(b, d, b * d) for d in range(max_depth + 1)) for b in batches)
    return CostTable(tuple(batches), tuple(tuple(itertools.accumulate(row, max)) for row in seconds))


def replay_rounds(trace: Trace, policies, rate: float, rounds: int, seeds: int, requests: int,
                  lengths: tuple[int, int], slots: int, max_depth: int) -> dict[str, list[Served]]:  # fmt: skip
    """``bench_serving.serve_rounds`` on the trace: per policy (by name), ``rounds`` x ``seeds`` runs, round r's
    seeded arrivals at ``rate`` served once per clock seed (the trace's noise and drift), each with a fresh
    controller; a run of a policy that reads no clock is the same for every seed."""
    runs: dict[str, list[Served]] = {p.name: [] for p in policies}
    for r in range(rounds):
        work = workload(range(len(trace.matches)), requests, rate, lengths, seed=1000 + r)
        for policy in policies:
            for s in range(seeds):
                clock = NoisyClock(trace.relative_noise, 1000 * r + s, trace.drift, trace.drift_steps)
                runs[policy.name].append(replay_serving(trace, work, slots, max_depth, policy.controller(clock), clock))
    return runs


class _DrafterGaps:
    """What the draft chain's cache lacks per slot, as ``specdec.decoding.draft_cache`` counts it: a joined request's
    prompt but its last token, fed at the request's first step that drafts; a token more for every step that drafts
    nothing. A step that drafts feeds every running request's gap: in a forward of its own before the step (the
    catch-up the trace prices) when one exceeds ``FOLD_MISSING``, else as rows of its first draft forward (in the
    step's recorded cost)."""

    def __init__(self):
        self.missing: dict[int, int] = {}

    def join(self, slot: int, prompt_length: int) -> None:
        self.missing[slot] = prompt_length - 1

    def owed(self, running: Sequence[int], contexts: Sequence[int] = ()) -> int:
        """Tokens a step of ``running`` that drafts would feed in a forward of its own (the strategy's
        ``owed_tokens`` hook, which the adaptive controller prices)."""
        gaps = [self.missing[b] for b in running]
        return sum(gaps) if max(gaps, default=0) > FOLD_MISSING else 0

    def step(self, running: Sequence[int], drafts: bool) -> int:
        """A step of ``running`` ran (``drafts``: some request drafted): the tokens its catch-up fed."""
        owed = self.owed(running) if drafts else 0
        for b in running:
            self.missing[b] = 0 if drafts else self.missing[b] + 1
        return owed


def replay_serving(trace: Trace, work: Workload[int], slots: int, max_depth: int, controller: AdaptiveSpeculation,
                   clock: NoisyClock | None = None) -> Served:  # fmt: skip
    """``work`` (prompts: indices into the trace's prompts) served by an engine of ``slots`` slots whose depths
    ``controller`` chooses (bound here to a chain of ``max_depth``); ``clock``: the controller's, advanced by
    each step's recorded cost (None when the controller reads no clock). Times in recorded seconds."""
    if not 1 <= max_depth <= trace.max_depth:
        raise ValueError(f"max_depth must be in 1 .. the trace's {trace.max_depth}, got {max_depth}")
    longest = min(map(len, trace.matches))
    if max(work.lengths) > longest:
        raise ValueError(f"the trace records acceptance over {longest} tokens per prompt, the workload asks up to "
                         f"{max(work.lengths)}: record it with --match-tokens {max(work.lengths)}")  # fmt: skip
    drafter = _DrafterGaps()
    controller.bind(max_depth, max_depth + 1, None, drafter.owed if trace.catch_up_price else None)
    controller.start()
    n, now, waiting = len(work.arrivals), 0.0, 0
    held: dict[int, list[int]] = {}  # slot -> [request, tokens it got]
    first, last, emitted, per_step = {}, {}, [0] * n, []
    while waiting < n or held:
        if not held:
            now = max(now, work.arrivals[waiting])  # idle until the next arrival
        joining = []
        for slot in range(slots):
            if waiting < n and work.arrivals[waiting] <= now and slot not in held:
                joining.append((slot, waiting))
                waiting += 1
        running = sorted(held)
        if joining:
            controller.forget([slot for slot, _ in joining])
        depths, accepted, contexts, cost, catch_up = [], [], [], 0.0, 0.0
        if running:
            requests = [held[b] for b in running]
            limits = [work.lengths[r] - got - 1 for r, got in requests]
            contexts = [trace.prompt_lengths[work.prompts[r]] + got - 1 for r, got in requests]
            depths = controller.choose(running, limits, contexts)
            catch_up = drafter.step(running, max(depths) > 0) * (trace.catch_up_price or 0.0)
            if clock is not None and catch_up:  # the strategy's ``prepare``: before the step's clock restarts
                clock.advance(catch_up)
            controller.restart_clock()
            accepted = [min(d, trace.matches[work.prompts[r]][got]) for (r, got), d in zip(requests, depths)]
            cost = trace.step_seconds(len(running), max(depths), sum(depths))
        if joining:
            tokens = sum(trace.prompt_lengths[work.prompts[r]] for _, r in joining)
            cost += trace.join_seconds(len(running), max(depths, default=0), tokens)
            for slot, r in joining:
                drafter.join(slot, trace.prompt_lengths[work.prompts[r]])
        now += catch_up + cost
        if clock is not None:
            clock.advance(cost)
        got_now = []
        for b, a in zip(running, accepted):
            held[b][1] += a + 1
            got_now.append(a + 1)
        for slot, r in joining:
            held[slot] = [r, 1]
            first[r] = now
            got_now.append(1)
        for slot in running + [slot for slot, _ in joining]:
            r, got = held[slot]
            emitted[r] = got
            if got >= work.lengths[r]:
                last[r] = now
                del held[slot]
        per_step.append(sum(got_now) / len(got_now))
        if running:
            if joining:
                controller.untimed()
            controller.observe(running, [d + 1 for d in depths], depths, accepted, contexts)
    return served(work, first, last, emitted, per_step)
