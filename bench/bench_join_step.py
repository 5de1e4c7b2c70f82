"""Where a joining request's prompt runs (issue 36): in the step's one target forward, or in a forward of its own.

A step whose running trees are all chains takes the joining prompts as more causal rows of its forward
(``specdec.decoding.joining``); a step with tree masks prefills them in a forward of their own first. This benchmark
serves the same work both ways on chain steps, the second by forcing the tree steps' order (the prompts' own
forward, then the step's): requests join by step number, not by time, so both ways run exactly the same steps, and
each step's time is its per-thread CPU time (one intra-op thread). Per step index the median over the rounds is
taken, then summed over the steps that admitted a request beside running ones, and over the others (the same work
either way: the control).

    python bench/bench_join_step.py --out OUT            # plain decoding and a draft chain K=2, 5 rounds
    python bench/bench_join_step.py --quick --out OUT    # a smoke run (tests/test_bench_serving.py)
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

from common import Table, cpu_threads, positive_int
from serving_policies import FixedDepth

from specdec.decoding import DraftModelStrategy, SpeculativeDecoder
from specdec.decoding.run import DecodeRun
from specdec.testing import ASSETS, heldout_token_ids, load_pair

MERGED_DECODE = DecodeRun._decode


def own_forward_decode(run: DecodeRun, joining):
    """``DecodeRun._decode`` with the joining prompts in a forward of their own before the step (a tree step's way)."""
    joined = run._prefill(joining) if joining is not None else None
    decoded, _ = MERGED_DECODE(run, None)
    return decoded, joined


def serve(decoder: SpeculativeDecoder, pool, lengths: list[int], slots: int, every: int):
    """Request i arrives at step ``i * every`` (or later, while an earlier one still waits for a slot); per step its
    thread time and whether it admitted a request while others ran."""
    engine = decoder.engine(max_batch=slots, max_len=max(map(len, pool)) + max(lengths) + 8)
    step, added, times, joins, in_slots = 0, 0, [], [], set()
    while added < len(lengths) or engine.has_unfinished():
        if added < len(lengths) and step >= added * every and engine.num_waiting == 0:
            engine.add_request(pool[added % len(pool)], request_id=added, max_new_tokens=lengths[added],
                               eos_token_id=None)  # fmt: skip
            added += 1
        waiting, running = engine.num_waiting, bool(in_slots)
        start = time.thread_time()
        out = engine.step()
        times.append(time.thread_time() - start)
        joins.append(running and engine.num_waiting < waiting)
        in_slots = (in_slots | set(out.requests)) - set(out.finished)
        step += 1
    return times, joins


def measure(target, draft, pool, lengths, slots: int, depth: int, every: int, rounds: int):
    """Both ways, interleaved round by round: which steps admitted a request beside running ones, and per way the
    summed per-step medians over those steps and over the others, {(way, joined): seconds}."""
    times = {"merged": [], "own": []}
    for r in range(rounds):
        for way in ("merged", "own") if r % 2 else ("own", "merged"):
            DecodeRun._decode = MERGED_DECODE if way == "merged" else own_forward_decode
            try:
                decoder = SpeculativeDecoder(target, DraftModelStrategy(draft, (1,) * 2),
                                             adaptive=FixedDepth(depth).controller())  # fmt: skip
                step_times, joins = serve(decoder, pool, lengths, slots, every)
            finally:
                DecodeRun._decode = MERGED_DECODE
            times[way].append(step_times)
    if len({len(t) for ts in times.values() for t in ts}) != 1:
        raise SystemExit("the two ways ran different steps: the comparison needs the same work")
    totals = {}
    for way, runs in times.items():
        median = [statistics.median(step) for step in zip(*runs)]
        for joined in (True, False):
            totals[way, joined] = sum(t for t, j in zip(median, joins) if j == joined)
    return joins, totals


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=positive_int, default=48)
    parser.add_argument("--slots", type=positive_int, default=8)
    parser.add_argument("--rounds", type=positive_int, default=5)
    parser.add_argument("--quick", action="store_true", help="a smoke run: 6 requests, 2 rounds, plain only")
    parser.add_argument("--out", type=Path, help="directory for the table")
    args = parser.parse_args()
    cpu_threads("cpu")
    target, draft, tokenizer = load_pair("cpu", assets=ASSETS)
    pool = heldout_token_ids(tokenizer)
    requests, rounds, depths = (6, 2, [0]) if args.quick else (args.requests, args.rounds, [0, 2])
    rng = random.Random(5)
    lengths = [rng.randint(8, 24) if args.quick else rng.randint(16, 96) for _ in range(requests)]
    table = Table(
        f"Joining prompts: in the step's forward or in their own (embedded pair, cpu, one thread, {args.slots} slots, "
        f"{requests} requests of {min(lengths)}-{max(lengths)} tokens, greedy, per-step medians of {rounds} rounds)",
        ["policy", "a request joins every", "steps", "join steps", "join steps: own forward ms", "in the step's",
         "ratio", "other steps: ratio (control)", "all steps: ratio"],
    )  # fmt: skip
    for depth in depths:
        for every in (1, 4):
            joins, totals = measure(target, draft, pool, lengths, args.slots, depth, every, rounds)
            join_ratio = totals["merged", True] / totals["own", True]
            other_ratio = totals["merged", False] / totals["own", False]
            merged, own = (totals[way, True] + totals[way, False] for way in ("merged", "own"))
            all_ratio = merged / own
            name = FixedDepth(depth).name
            table.add(
                name, f"{every} step{'s' if every > 1 else ''}", len(joins), sum(joins),
                f"{totals['own', True] * 1e3:.0f}", f"{totals['merged', True] * 1e3:.0f}", f"{join_ratio:.3f}x",
                f"{other_ratio:.3f}x", f"{all_ratio:.3f}x",
                data=dict(policy=name, every=every, join_ratio=join_ratio, other_ratio=other_ratio,
                          all_ratio=all_ratio),
            )  # fmt: skip
    table.write(args.out, "join_step")


if __name__ == "__main__":
    main()
