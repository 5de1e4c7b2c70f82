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

A live round moves by several percent either way on the same arrivals, more than the policies differ; ``--replay
TRACE`` runs the same loop on a recorded trace instead (``serving_replay.py``: recorded step and join costs, the
trace's acceptance, the controller's clock noisy as the machine's), ``--rounds`` workloads x ``--seeds`` clock
seeds, each exact.

    python bench/bench_serving.py --out OUT                       # 4 loads, every policy, 3 rounds
    python bench/bench_serving.py --replay TRACE --rounds 5 --out OUT    # the same on a trace (seconds, no timing)
    python bench/bench_serving.py --quick --out OUT               # a smoke run (tests/test_bench_serving.py)
"""

from __future__ import annotations

import argparse
import operator
import time
from collections.abc import Sequence
from pathlib import Path

from common import Table, cpu_threads, positive_int
from png_chart import line_chart
from replay import Trace
from serving_policies import Adaptive, CostTable, FixedDepth, SlotAdmission
from serving_replay import replay_rounds, trace_costs
from serving_workload import Served, Workload, p99_tpot, paired, served, summarise, workload

from specdec.decoding import DraftModelStrategy, NgramStrategy, SpeculativeDecoder
from specdec.testing import ASSETS, heldout_token_ids, load_pair


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
            engine.add_request(list(work.prompts[waiting]), request_id=waiting, max_new_tokens=work.lengths[waiting],
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
    return served(work, first, last, emitted, per_step)


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
    parser.add_argument("--replay", type=Path, help="replay the policies on this recorded trace instead of running "
                        "them (serving_replay.py; a draft chain, greedy)")  # fmt: skip
    parser.add_argument("--seeds", type=positive_int, default=10, help="with --replay: noise seeds of the "
                        "controller's clock per round")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2 loads, 8 requests, depths 0-2, 1 round")
    parser.add_argument("--out", type=Path, help="directory for the tables and charts")
    args = parser.parse_args()
    if args.quick:
        args.loads, args.requests, args.slots, args.max_depth, args.rounds = [0.5, 2.0], 8, 4, 2, 1
        args.min_tokens, args.max_tokens = 8, 24
    if args.replay is not None and (args.strategy != "chain" or args.temperature != 0):
        parser.error("--replay replays a greedy draft chain: leave --strategy and --temperature at their defaults")
    batches = sorted({1, *(2**k for k in range(1, args.slots.bit_length()) if 2**k < args.slots), args.slots})
    lengths, top = (args.min_tokens, args.max_tokens), args.max_depth
    if args.replay is not None:
        trace = Trace.load(args.replay)
        costs = trace_costs(trace, batches, top)
        how = f"replayed on {args.replay.name}, {args.rounds} rounds x {args.seeds} clock seeds"
    else:
        cpu_threads("cpu")
        target, draft, tokenizer = load_pair("cpu", assets=ASSETS)
        pool = heldout_token_ids(tokenizer)

        def make_decoder(controller) -> SpeculativeDecoder:
            chain = args.strategy == "chain"
            strategy = DraftModelStrategy(draft, (1,) * top) if chain else NgramStrategy(num_draft=top)
            return SpeculativeDecoder(target, strategy, adaptive=controller)

        started = time.thread_time()
        costs = CostTable.profile(make_decoder, pool, batches, top)
        how = f"{args.rounds} rounds, cost table timed in {time.thread_time() - started:.1f} s"
    capacity = costs.capacity(args.slots, (args.min_tokens + args.max_tokens) / 2)
    policies = [FixedDepth(d) for d in range(top + 1)] + [Adaptive(), SlotAdmission(costs, top)]
    by_load: dict[float, dict[str, list[Served]]] = {}
    if args.replay is not None:
        for load in args.loads:
            by_load[load] = replay_rounds(trace, policies, load * capacity, args.rounds, args.seeds, args.requests,
                                          lengths, args.slots, top)  # fmt: skip
    else:
        # A short run per policy first, untimed: one-off costs (weight packs, the first allocations) go there.
        warm = workload(pool, max(2, args.slots), capacity, (args.min_tokens, args.min_tokens), seed=0)
        for policy in policies:
            serve(make_decoder(policy.controller()), warm, args.slots, args.temperature)
        for load in args.loads:
            by_load[load] = serve_rounds(policies, make_decoder, pool, load * capacity, args.rounds, args.requests,
                                         lengths, args.slots, args.temperature)  # fmt: skip
    report(args, by_load, costs, capacity, how)


def report(args, by_load: dict[float, dict[str, list[Served]]], costs: CostTable, capacity: float,
           how: str) -> None:  # fmt: skip
    """The per-policy table, the targets table (ratios paired round by round), the charts; ``how``: the runs'
    count and source."""
    figures = {load: {name: summarise(served) for name, served in runs.items()} for load, runs in by_load.items()}
    names = list(next(iter(by_load.values())))
    fixed = [n for n in names if n == "plain" or n.startswith("K=")]
    what = "draft chain" if args.strategy == "chain" else "n-gram"
    setting = (f"embedded pair, {what} up to {args.max_depth}, cpu, one thread, T={args.temperature:g}, {args.slots} "
               f"slots, {args.requests} requests of {args.min_tokens}-{args.max_tokens} tokens, {how} (median); load 1 "
               f"= {capacity:.2f} requests/s, plain decoding's capacity at full batch")  # fmt: skip
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
