"""The adaptive controller replayed on a recorded trace: its choices against fixed draft depths, without the noise
of timing whole runs (issue 16).

A run of the batch sweep (``bench_e2e.py --sweep-only``) times real decoding, so a controller loss of a few
percent hides in the machine's drift. This benchmark records once what the sweep's runs depend on -- for every
held-out prompt, how many of the draft's greedy tokens the target accepts at each position of its greedy text,
and the step time of each step shape on this machine -- then replays the controller on that trace
(``bench/replay.py``): step times drawn with noise and the machine's drift (both measured when
recording), every seed's exact cost in the recorded times, the fixed depths' costs alike. ``adaptive / best`` is
the best fixed depth's (or plain decoding's) time over the controller's, per batch size, over seeds.

    python bench/bench_adaptive_replay.py --record trace.json     # record (embedded pair, one thread, ~4 min)
    python bench/bench_adaptive_replay.py --record trace.json --match-tokens 96   # one bench_serving.py --replay
                                                                  # can use (acceptance over 96 tokens a prompt)
    python bench/bench_adaptive_replay.py --trace trace.json      # replay: a table per batch size
    python bench/bench_adaptive_replay.py --record t.json --trace t.json --batches 1 2 --max-depth 2 --rounds 1
                                                                  # a smoke run (tests/test_adaptive_replay.py)
    python bench/bench_adaptive_replay.py --trace trace.json --oracles    # and what rules that read the trace reach
    python bench/bench_adaptive_replay.py --trace trace.json --switch-penalty 0.5 0.15   # steps after the other
                                                                  # kind's cost more (bench_step_mixing.py)

``--oracles`` adds a table of rules that know what the controller must estimate -- each step shape's recorded
time and the trace's acceptance -- and choose one uniform depth a step: by the step's expected tokens per second
(the controller's objective, perfectly informed), or by the expected time until the group's last request finishes
(a static batch's objective: a request that will finish early anyway gains nothing for the batch by drafting
deeper), each with the pooled acceptance or with each prompt's own over its whole text (which no controller knows
at a stream's start). They show what each objective can reach, not what a controller can.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

from common import Table, cpu_threads
from replay import (
    DEFAULT_NOISE,
    SwitchPenalty,
    Trace,
    fit_drift,
    replay,
    replay_fixed,
    replay_policy,
)

BATCHES = (1, 2, 4, 8, 16, 32)
MAX_DEPTH = 8
NEW_TOKENS = 48


def record(path: Path, rounds: int, batches: list[int], max_depth: int, drift_passes: int, match_tokens: int) -> None:
    """Writes the trace of the embedded pair on this machine (CPU, one intra-op thread, fp32): acceptance over each
    prompt's first ``match_tokens`` generated tokens, step costs, noise and drift, what a joining prompt adds and
    what the drafter's catch-up costs."""
    from specdec.decoding import AdaptiveSpeculation, DraftModelStrategy, SpeculativeDecoder
    from specdec.testing import ASSETS, heldout_token_ids, load_pair

    cpu_threads("cpu")
    target, draft, tokenizer = load_pair("cpu", assets=ASSETS)
    pool = heldout_token_ids(tokenizer)
    greedy = {"temperature": 0.0, "seed": 0, "eos_token_id": None}
    texts = SpeculativeDecoder(target, None).generate(pool, max_new_tokens=match_tokens + max_depth, **greedy).tokens
    matches = []
    for prompt, text in zip(pool, texts):  # the draft's greedy chain from every position of the target's text
        prefixes = [prompt + text[:p] for p in range(match_tokens)]
        drafts = SpeculativeDecoder(draft, None).generate(prefixes, max_new_tokens=max_depth, **greedy).tokens
        row = []
        for p, chain in enumerate(drafts):
            m = 0
            while m < max_depth and chain[m] == text[p + m]:
                m += 1
            row.append(m)
        matches.append(row)

    class Forced:
        """Drafts ``depths`` (one per request, within its limit) every step through the controller's ``forced``
        option; records the full batch's step times (``on_step``)."""

        def __init__(self):
            self.depths, self.times = [], []
            self.controller = AdaptiveSpeculation(clock=time.thread_time, forced=self.choose, on_step=self.record)

        def choose(self, step, running, limits):
            return self.depths[: len(running)]

        def record(self, seconds, running, nodes, depths, accepted, contexts):
            if len(running) == len(self.depths) and list(depths) == self.depths:
                self.times.append(seconds)

    forced = Forced()
    strategy = DraftModelStrategy(draft, (1,) * max_depth)
    decoder = SpeculativeDecoder(target, strategy, adaptive=forced.controller)
    shapes = [
        (b, d, h) for b in batches for d in range(max_depth + 1) for h in ((b,) if b == 1 or d == 0 else (b, b // 2))
    ]
    samples = {shape: [] for shape in shapes}
    changes = []  # relative change between consecutive steps of one run: the step-to-step noise (the context drifts)
    for r in range(rounds):  # every shape once a round, so the machine's drift falls on all of them alike
        for b, d, h in shapes:
            forced.depths, forced.times = [d] * h + [0] * (b - h), []
            prompts = [pool[(r * b + i) % len(pool)] for i in range(b)]
            decoder.generate(prompts, max_new_tokens=NEW_TOKENS // 2, **greedy)
            times = forced.times[1:]  # the first step after the prefill runs colder
            samples[b, d, h] += times
            changes += [(y - x) / (x + y) * 2 for x, y in zip(times, times[1:])]
        print(f"round {r + 1}/{rounds} recorded", flush=True)
    costs = [[b, d, h, statistics.median(s)] for (b, d, h), s in samples.items()]
    noise = statistics.pstdev(changes) / 2**0.5  # a difference of two steps has twice one step's variance
    drift, drift_steps = 0.0, 1.0
    if drift_passes:  # one shape decoded over and over: how the machine's speed wanders from step to step
        batch = 4 if 4 in batches else batches[-1]
        forced.depths = [min(2, max_depth)] * batch
        prompts = [pool[i % len(pool)] for i in range(batch)]
        runs = []
        for _ in range(drift_passes):
            forced.times = []
            decoder.generate(prompts, max_new_tokens=NEW_TOKENS, **greedy)
            runs.append(forced.times[1:])
        noise, drift, drift_steps = fit_drift(step_residuals(runs))
        print(f"drift measured over {sum(map(len, runs))} steps of batch {batch}, depth {forced.depths[0]}", flush=True)
    joins = record_joins(decoder, forced, pool, max_depth, rounds)
    catch_up = record_catch_up(target, draft, pool, rounds)
    trace = {
        "machine": "embedded pair, CPU, one intra-op thread, fp32, thread time",
        "recorded": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "new_tokens": NEW_TOKENS,
        "max_depth": max_depth,
        "prompt_lengths": [len(p) for p in pool],
        "matches": matches,
        "costs": costs,
        "relative_noise": noise,
        "drift": drift,
        "drift_steps": drift_steps,
        "join_costs": joins,
        "catch_up_price": catch_up,
    }
    path.write_text(json.dumps(trace))
    print(f"trace written to {path} (step-time noise {noise:.1%} per step, drift {drift:.1%} over "
          f"{drift_steps:.0f} steps)")  # fmt: skip


def expected_tokens(matches: list[list[int]], max_depth: int) -> list[float]:
    """Tokens a step emits on average at each depth 0 .. max_depth (the accepted drafts, plus one), over ``matches``
    (rows of accepted-draft counts per position)."""
    every = [m for row in matches for m in row]
    reach = [sum(m >= i for m in every) / len(every) for i in range(1, max_depth + 1)]
    return [1.0 + sum(reach[:d]) for d in range(max_depth + 1)]


def oracle(trace: Trace, objective: str, own_acceptance: bool):
    """A rule that reads the trace (``replay_policy``): each step the uniform depth with the best ``objective``
    -- "step" (expected tokens / recorded seconds of this step) or "finish" (expected seconds until the group's
    last request finishes, every request keeping the depth: each takes its tokens left / its tokens a step, and
    the running requests thin out as they finish) -- with the pooled acceptance or each prompt's own."""
    depths = range(trace.max_depth + 1)
    pooled = expected_tokens(trace.matches, trace.max_depth)
    own = [expected_tokens([row], trace.max_depth) for row in trace.matches]

    def policy(prompts):
        def choose(running, limits, contexts):
            tokens = [own[prompts[r]] if own_acceptance else pooled for r in running]
            best, choice = -math.inf, None
            for d in depths:
                capped = [max(0, min(d, limit)) for limit in limits]
                if objective == "step":
                    emitted = sum(t[c] for t, c in zip(tokens, capped))
                    score = emitted / trace.step_seconds(len(running), max(capped), sum(capped))
                else:  # minus the seconds to finish: segments between the requests' expected finishing steps
                    finish = sorted((limit + 1) / t[min(d, limit)] for t, limit in zip(tokens, limits))
                    score, done = 0.0, 0.0
                    for j, step in enumerate(finish):
                        left = len(finish) - j
                        score -= (step - done) * trace.step_seconds(left, d, left * d)
                        done = step
                if score > best:
                    best, choice = score, capped
            return choice

        return choose

    return policy


def oracle_table(trace: Trace, batches: list[int], out: Path | None) -> None:
    rules = [("step, pooled acceptance", "step", False), ("step, own acceptance", "step", True),
             ("finish, pooled acceptance", "finish", False), ("finish, own acceptance", "finish", True)]  # fmt: skip
    table = Table(
        f"Rules that read {trace.machine}'s trace (uniform depth a step): the best fixed depth's seconds over theirs",
        ["batch", "best fixed", *(name for name, _, _ in rules)],
    )
    for batch in batches:
        fixed = [replay_fixed(trace, batch, k) for k in range(trace.max_depth + 1)]
        best = min(fixed)
        ratios = [best / replay_policy(trace, batch, oracle(trace, o, own)) for _, o, own in rules]
        table.add(batch, f"K={fixed.index(best)}", *(f"{r:.3f}" for r in ratios))
    table.write(out, "adaptive_oracles")


JOIN_RUNNING = (0, 1, 4, 7)  # running requests beside a joining prompt (7: a full 8-slot serving engine)


def record_joins(decoder, forced, pool, max_depth: int, rounds: int, steps: int = 6) -> list[list[float]]:
    """What a joining prompt adds to a step: rows ``[running, levels, seconds per prompt token]``. Per shape, an
    engine of ``running + 1`` slots runs ``running`` requests at ``levels`` draft tokens each, and every other step a
    one-token request joins (its prompt rides in the step's forward and it ends at once; the drafter's prefill of a
    prompt waits for the request's first step that drafts, ``record_catch_up``): the median join step less the median
    step without one, over the prompts' mean length (whole steps' thread time, as ``bench_serving.py`` counts them)."""
    rows = []
    for running in JOIN_RUNNING:
        for levels in (0,) if running == 0 else sorted({0, (max_depth + 1) // 2, max_depth}):
            plain, joined, tokens = [], [], []
            for r in range(rounds):
                forced.depths = [levels] * running
                engine = decoder.engine(max_batch=running + 1, max_len=max(map(len, pool)) + 4 * steps * (levels + 1))
                for b in range(running):
                    engine.add_request(pool[(r + b) % len(pool)], max_new_tokens=3 * steps * (levels + 1),
                                       eos_token_id=None)  # fmt: skip
                for _ in range(3 if running else 0):  # the prefill and two untimed steps
                    engine.step()
                for k in range(steps):
                    prompt = pool[(r * steps + k) % len(pool)]
                    if running:
                        start = time.thread_time()
                        engine.step()
                        plain.append(time.thread_time() - start)
                    engine.add_request(prompt, max_new_tokens=1, eos_token_id=None)
                    start = time.thread_time()
                    engine.step()
                    joined.append(time.thread_time() - start)
                    tokens.append(len(prompt))
            extra = statistics.median(joined) - (statistics.median(plain) if plain else 0.0)
            rows.append([running, levels, extra / statistics.mean(tokens)])
    print(f"join costs recorded for {len(rows)} shapes", flush=True)
    return rows


def record_catch_up(target, draft, pool, rounds: int) -> float:
    """Seconds per token of the draft chain's catch-up: ``prepare`` feeding the drafter what its cache missed (a joined
    request's prompt, which waits for the request's first step that drafts, or a run of plain steps) as a forward of
    its own, outside the step's timing. The median over every prompt joining an engine alone, ``rounds`` times, of
    ``prepare``'s thread time over the tokens it owed."""
    from specdec.decoding import AdaptiveSpeculation, DraftModelStrategy, SpeculativeDecoder

    strategy = DraftModelStrategy(draft, (1,))
    own, prices = strategy.prepare, []

    def timed(step):
        owed = strategy.owed_tokens(step.running, [len(h) - 1 for h in step.histories])
        start = time.thread_time()
        own(step)
        if owed:
            prices.append((time.thread_time() - start) / owed)

    strategy.prepare = timed
    forced = AdaptiveSpeculation(forced=lambda step, running, limits: [1] * len(running))
    decoder = SpeculativeDecoder(target, strategy, adaptive=forced)
    for _ in range(rounds):
        for prompt in pool:
            engine = decoder.engine(max_batch=1, max_len=len(prompt) + 8)
            engine.add_request(prompt, max_new_tokens=4, eos_token_id=None)
            while engine.has_unfinished():
                engine.step()
    print(f"catch-up timed over {len(prices)} prompts", flush=True)
    return statistics.median(prices)


def step_residuals(runs: list[list[float]]) -> list[float]:
    """Runs of one shape's step times, in the order they ran, as one series of log times less the median log time
    of the same step of every run (the context grows through a run, and the runs repeat it)."""
    typical = {}
    for i in range(max(map(len, runs))):
        at = [math.log(run[i]) for run in runs if i < len(run)]
        typical[i] = statistics.median(at)
    return [math.log(t) - typical[i] for run in runs for i, t in enumerate(run)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record", type=Path, help="record a trace of the embedded pair to this JSON file")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of step-shape timings when recording")
    parser.add_argument("--trace", type=Path, help="replay the controller on this trace")
    parser.add_argument("--seeds", type=int, default=20, help="replays per batch size (the clock's noise seeds)")
    parser.add_argument("--noise", type=float, default=None, help=f"relative step-time noise (default: the "
                        f"trace's own, else {DEFAULT_NOISE})")  # fmt: skip
    parser.add_argument("--drift", type=float, default=None, help="sd of the log of the machine's speed (default: "
                        "the trace's own, else none)")  # fmt: skip
    parser.add_argument("--drift-steps", type=float, default=None, help="steps over which the drift's correlation "
                        "falls by e (default: the trace's own)")  # fmt: skip
    parser.add_argument("--stalls", type=float, default=0.0, help="share of steps that stall, 15-40%% slower "
                        "(seen live: 1-2%%; default none)")  # fmt: skip
    parser.add_argument("--switch-penalty", type=float, nargs=2, metavar=("PLAIN", "DRAFTING"), help="a plain / "
                        "drafting step within --switch-steps steps of one of the other kind costs 1 + this share more "
                        "(bench/bench_step_mixing.py measures it; default none)")  # fmt: skip
    parser.add_argument("--switch-steps", type=int, default=4, help="steps the switch penalty lasts")
    parser.add_argument("--drift-passes", type=int, default=60, help="passes of one shape recorded to measure the "
                        "drift (0: none)")  # fmt: skip
    parser.add_argument("--batches", type=int, nargs="+", default=list(BATCHES), help="batch sizes recorded / replayed")
    parser.add_argument("--max-depth", type=int, default=MAX_DEPTH, help="the longest draft recorded")
    parser.add_argument("--match-tokens", type=int, default=NEW_TOKENS, help="generated tokens per prompt whose "
                        "acceptance is recorded (at least the replay's 48; bench_serving.py --replay needs its "
                        "--max-tokens)")  # fmt: skip
    parser.add_argument("--out", type=Path, help="directory for the table (markdown and CSV)")
    parser.add_argument("--oracles", action="store_true", help="also the table of rules that read the trace")
    args = parser.parse_args()
    if args.record:
        if args.match_tokens < NEW_TOKENS:
            parser.error(f"--match-tokens must be at least {NEW_TOKENS} (the replay's tokens per request)")
        record(args.record, args.rounds, args.batches, args.max_depth, args.drift_passes, args.match_tokens)
    if not args.trace:
        return
    trace = Trace.load(args.trace)
    try:
        switch = SwitchPenalty(*args.switch_penalty, args.switch_steps) if args.switch_penalty else None
    except ValueError as error:
        parser.error(f"--switch-penalty / --switch-steps: {error}")
    switched = "" if switch is None else (
        f", switch penalty {switch.plain:.0%} / {switch.drafting:.0%} over {switch.steps} steps")  # fmt: skip
    noise = trace.relative_noise if args.noise is None else args.noise
    drift = trace.drift if args.drift is None else args.drift
    drift_steps = trace.drift_steps if args.drift_steps is None else args.drift_steps
    table = Table(
        f"Adaptive controller replayed on {args.trace.name} ({trace.machine}), {args.seeds} seeds, step-time noise "
        f"{noise:.1%}, drift {drift:.1%} over {drift_steps:.0f} steps, {args.stalls:.0%} of steps stalled{switched}: "
        f"step seconds per run and ratios",
        ["batch", "plain s", *(f"K={k}" for k in range(1, trace.max_depth + 1)), "best fixed",
         "adaptive / best: mean", "min", "max", "mean depth"],
    )  # fmt: skip
    for batch in args.batches:
        fixed = [replay_fixed(trace, batch, k, switch) for k in range(trace.max_depth + 1)]
        best = min(fixed)
        runs = [
            replay(trace, batch, noise=noise, seed=s, drift=drift, drift_steps=drift_steps, stalls=args.stalls,
                   switch=switch)
            for s in range(args.seeds)
        ]  # fmt: skip
        ratios = [best / r.seconds for r in runs]
        table.add(
            batch, f"{fixed[0]:.3f}", *(f"{fixed[0] / f:.2f}x" for f in fixed[1:]), f"K={fixed.index(best)}",
            f"{statistics.mean(ratios):.3f}", f"{min(ratios):.3f}", f"{max(ratios):.3f}",
            f"{statistics.mean(r.mean_depth for r in runs):.2f}",
        )  # fmt: skip
    table.write(args.out, "adaptive_replay")
    if args.oracles:
        oracle_table(trace, args.batches, args.out)


if __name__ == "__main__":
    main()
