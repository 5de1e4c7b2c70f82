"""Serving benchmark (issue 36): seeded Poisson arrivals into the step engine, finished slots refilled at once.

Requests arrive at seeded Poisson times (held-out prompts in turn, output lengths drawn between ``--min-tokens``
and ``--max-tokens``, EOS ignored) into one ``Engine`` of ``--slots`` batch slots; each policy of
``serving_policies`` (plain decoding, every fixed depth 1 .. ``--max-depth``, the adaptive controller, batch-wide
slot admission) serves the same arrivals, interleaved round by round, at several loads: arrival rates as
multiples of plain decoding's capacity at full batch (its step time there, timed at start-up with the slot
admission's cost table). Time is the serving loop's own: each step advances a clock by its per-thread CPU time
(one intra-op thread), and an idle engine jumps to the next arrival, so what other processes do on the machine
does not enter. Per run: throughput (output tokens over the time from the first arrival to the last ending),
time to first token (TTFT, from arrival) and time per output token after the first (TPOT), p50 and p99 over the
requests; per load the median run of the rounds. Ratios against the best of plain and the fixed depths, and
against slot admission, are the issue's targets.

    python bench/bench_serving.py --out OUT                       # 4 loads, every policy, 3 rounds
    python bench/bench_serving.py --quick --out OUT               # a smoke run (tests/test_bench_serving.py)
"""

from __future__ import annotations

import argparse
import operator
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from common import Table, cpu_threads, positive_int
from png_chart import line_chart
from serving_policies import Adaptive, CostTable, FixedDepth, SlotAdmission

from specdec.decoding import DraftModelStrategy, NgramStrategy, SpeculativeDecoder
from specdec.testing import ASSETS, heldout_token_ids, load_pair


@dataclass(frozen=True)
class Workload:
    """Request i arrives at ``arrivals[i]`` seconds with ``prompts[i]`` and asks for ``lengths[i]`` tokens."""

    arrivals: list[float]
    prompts: list[list[int]]
    lengths: list[int]


@dataclass(frozen=True)
class Served:
    """One run's figures: tokens per second, per request TTFT and TPOT in seconds, and the mean tokens a request
    got per step (first tokens included)."""

    throughput: float
    ttft: list[float]
    tpot: list[float]
    tokens_per_step: float


def workload(
    pool: Sequence[Sequence[int]], requests: int, rate: float, lengths: tuple[int, int], seed: int
) -> Workload:
    """Poisson arrivals at ``rate`` requests per second (seeded), the prompt pool in turn from a seeded start, output
    lengths uniform in ``lengths``."""
    rng = random.Random(seed)
    now, arrivals = 0.0, []
    for _ in range(requests):
        arrivals.append(now)
        now += rng.expovariate(rate)
    start = rng.randrange(len(pool))
    prompts = [list(pool[(start + i) % len(pool)]) for i in range(requests)]
    return Workload(arrivals, prompts, [rng.randint(*lengths) for _ in range(requests)])


def serve(decoder: SpeculativeDecoder, work: Workload, slots: int, temperature: float) -> Served:
    """Run ``work`` through an engine of ``slots`` slots; the clock advances by each step's thread time."""
    widest = decoder.strategy.max_nodes
    engine = decoder.engine(max_batch=slots, max_len=max(map(len, work.prompts)) + max(work.lengths) + widest)
    clock, waiting, n = 0.0, 0, len(work.arrivals)
    first, last, emitted, per_step = {}, {}, [0] * n, []
    while waiting < n or engine.has_unfinished():
        if not engine.has_unfinished():
            clock = max(clock, work.arrivals[waiting])  # idle until the next arrival
        while waiting < n and work.arrivals[waiting] <= clock:
            engine.add_request(work.prompts[waiting], request_id=waiting, max_new_tokens=work.lengths[waiting],
                               temperature=temperature, seed=waiting, eos_token_id=None)  # fmt: skip
            waiting += 1
        start = time.thread_time()
        out = engine.step()
        clock += time.thread_time() - start
        for request, tokens in zip(out.requests, out.tokens):
            first.setdefault(request, clock)
            emitted[request] += len(tokens)
        for request in out.finished:
            last[request] = clock
        if out.requests:
            per_step.append(sum(map(len, out.tokens)) / len(out.requests))
    ttft = [first[i] - work.arrivals[i] for i in range(n)]
    tpot = [(last[i] - first[i]) / (emitted[i] - 1) for i in range(n) if emitted[i] > 1]
    return Served(sum(emitted) / (max(last.values()) - work.arrivals[0]), ttft, tpot, statistics.mean(per_step))


def serve_rounds(policies, make_decoder, pool: Sequence[Sequence[int]], rate: float, rounds: int, requests: int,
                 lengths: tuple[int, int], slots: int, temperature: float) -> dict[str, list[Served]]:  # fmt: skip
    """Per policy (by name), its run in each round: round r's seeded arrivals at ``rate`` served by every policy, in
    an order rotated from round to round (no policy always first), each with a fresh controller."""
    runs: dict[str, list[Served]] = {p.name: [] for p in policies}
    for r in range(rounds):
        work = workload(pool, requests, rate, lengths, seed=1000 + r)
        for policy in policies[r % len(policies) :] + policies[: r % len(policies)]:
            runs[policy.name].append(serve(make_decoder(policy.controller()), work, slots, temperature))
    return runs


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loads", type=float, nargs="+", default=[0.25, 0.5, 1.0, 2.0],
                        help="arrival rates as multiples of plain decoding's capacity at full batch")  # fmt: skip
    parser.add_argument("--requests", type=positive_int, default=48, help="requests per run")
    parser.add_argument("--slots", type=positive_int, default=8, help="the engine's batch slots")
    parser.add_argument("--max-depth", type=positive_int, default=4, help="the deepest fixed depth (and the drafter's)")
    parser.add_argument("--min-tokens", type=positive_int, default=16)
    parser.add_argument("--max-tokens", type=positive_int, default=96)
    parser.add_argument("--rounds", type=positive_int, default=3, help="rounds (each runs every policy once)")
    parser.add_argument("--strategy", choices=["chain", "ngram"], default="chain", help="draft chain or n-gram")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2 loads, 8 requests, depths 0-2, 1 round")
    parser.add_argument("--out", type=Path, help="directory for the tables and charts")
    args = parser.parse_args()
    if args.quick:
        args.loads, args.requests, args.slots, args.max_depth, args.rounds = [0.5, 2.0], 8, 4, 2, 1
        args.min_tokens, args.max_tokens = 8, 24
    cpu_threads("cpu")
    target, draft, tokenizer = load_pair("cpu", assets=ASSETS)
    pool = heldout_token_ids(tokenizer)
    top = args.max_depth

    def make_decoder(controller) -> SpeculativeDecoder:
        strategy = DraftModelStrategy(draft, (1,) * top) if args.strategy == "chain" else NgramStrategy(num_draft=top)
        return SpeculativeDecoder(target, strategy, adaptive=controller)

    batches = sorted({1, *(2**k for k in range(1, args.slots.bit_length()) if 2**k < args.slots), args.slots})
    started = time.thread_time()
    costs = CostTable.profile(make_decoder, pool, batches, top)
    profile_s = time.thread_time() - started
    mean_tokens = (args.min_tokens + args.max_tokens) / 2
    capacity = args.slots / (costs.seconds[-1][0] * mean_tokens)  # requests per second plain decoding can serve
    policies = [FixedDepth(d) for d in range(top + 1)] + [Adaptive(), SlotAdmission(costs, top)]
    # A short run per policy first, untimed: one-off costs (weight packs, the first allocations) go there.
    warm = workload(pool, max(2, args.slots), capacity, (args.min_tokens, args.min_tokens), seed=0)
    for policy in policies:
        serve(make_decoder(policy.controller()), warm, args.slots, args.temperature)
    by_load: dict[float, dict[str, list[Served]]] = {}
    for load in args.loads:
        by_load[load] = serve_rounds(policies, make_decoder, pool, load * capacity, args.rounds, args.requests,
                                     (args.min_tokens, args.max_tokens), args.slots, args.temperature)  # fmt: skip
    report(args, by_load, costs, capacity, profile_s)


def report(args, by_load: dict[float, dict[str, list[Served]]], costs: CostTable, capacity: float,
           profile_s: float) -> None:  # fmt: skip
    """The per-policy table, the targets table (ratios paired round by round), the charts."""
    figures = {load: {name: summarise(served) for name, served in runs.items()} for load, runs in by_load.items()}
    names = list(next(iter(by_load.values())))
    fixed = [n for n in names if n == "plain" or n.startswith("K=")]
    what = "draft chain" if args.strategy == "chain" else "n-gram"
    setting = (f"embedded pair, {what} up to {args.max_depth}, cpu, one thread, T={args.temperature:g}, {args.slots} "
               f"slots, {args.requests} requests of {args.min_tokens}-{args.max_tokens} tokens, {args.rounds} rounds "
               f"(median); load 1 = {capacity:.2f} requests/s, plain decoding's capacity at full batch; cost table "
               f"timed in {profile_s:.1f} s")  # fmt: skip
    table = Table(
        f"Serving: Poisson arrivals, slots refilled ({setting})",
        ["load", "policy", "tok/s", "/ best fixed", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "TPOT p99 ms",
         "tokens/step"],
    )  # fmt: skip
    throughput = operator.attrgetter("throughput")
    best = {load: max(fixed, key=lambda n, f=f: f[n]["throughput"]) for load, f in figures.items()}
    for load, runs in by_load.items():
        for name in names:
            f, versus_best = figures[load][name], paired(runs[name], runs[best[load]], throughput)[0]
            table.add(
                f"{load:g}", name, f"{f['throughput']:.1f}", f"{versus_best:.3f}x",
                f"{f['ttft_p50']:.1f}", f"{f['ttft_p99']:.1f}", f"{f['tpot_p50']:.2f}", f"{f['tpot_p99']:.2f}",
                f"{f['tokens_per_step']:.2f}", data=dict(load=load, policy=name, **f),
            )  # fmt: skip
    targets = Table(
        f"Serving targets ({setting}; per-round ratios on the same arrivals: median (lowest-highest))",
        ["load", "best fixed", "adaptive / best fixed", "adaptive / slot admission", "lowest p99 TPOT fixed",
         "adaptive p99 TPOT / its", "slot admission / best fixed"],
    )  # fmt: skip
    for load, runs in by_load.items():
        steadiest = min(fixed, key=lambda n: figures[load][n]["tpot_p99"])
        cells = [paired(runs["adaptive"], runs[best[load]], throughput),
                 paired(runs["adaptive"], runs["slot admission"], throughput),
                 paired(runs["adaptive"], runs[steadiest], p99_tpot),
                 paired(runs["slot admission"], runs[best[load]], throughput)]  # fmt: skip
        text = [f"{m:.3f}x ({lo:.2f}-{hi:.2f})" for m, lo, hi in cells]
        targets.add(f"{load:g}", best[load], text[0], text[1], steadiest, text[2], text[3],
                    data=dict(load=load, ratios=cells))  # fmt: skip
    table.write(args.out, "serving", extra=dict(costs=dict(batches=costs.batches, seconds=costs.seconds)))
    targets.write(args.out, "serving_targets")
    if args.out is not None:
        loads = [f"{load:g}X" for load in figures]
        for key, name, label in (("throughput", "serving_throughput.png", "TOK/S / PLAIN"),
                                 ("tpot_p99", "serving_tpot_p99.png", "P99 TPOT / PLAIN")):  # fmt: skip
            figure = throughput if key == "throughput" else p99_tpot
            series = {n: [paired(runs[n], runs["plain"], figure)[0] for runs in by_load.values()] for n in names}
            title = f"{'THROUGHPUT' if key == 'throughput' else 'P99 TPOT'} VS LOAD, EMBEDDED PAIR, CPU 1 THREAD"
            line_chart(args.out / name, title, loads, series, label, x_label="LOAD (X PLAIN CAPACITY)")


if __name__ == "__main__":
    main()
