"""Per-step rates against whole static-batch runs, for fixed draft depths (issue 16).

The adaptive controller drafts, each step, the depths with the most expected tokens per second of that step.
The batch sweep (``bench_e2e.py --sweep-only``) times whole static batches, which end with their last request.
This benchmark measures both views for each fixed chain depth d = 0 (plain) .. ``--max-depth`` on the embedded
pair (greedy, EOS ignored, the held-out prompts, ``max(1, 6 // B)`` batches of B as in the sweep), the decoders
interleaved round by round, thread time on one thread:

* **run**: tokens per second of whole ``generate`` calls, and over plain decoding's;
* **step**: the median time of the steps that ran the whole batch at depth d (the steady cost of the shape the
  controller prices), and the rate those costs give at the same text positions for every depth: the tokens a
  depth-d step would have emitted in the deepest decoder's whole-batch steps over depth d's step time. Greedy
  chains accept the same prefix whatever the depth, so that count is exact: 1 + min(accepted, d) per request;
* **tail**: the share of the run's step time spent after the batch's first request finished.

Where the run ranks the depths otherwise than the step rate does, the per-step objective and the batch's finish
disagree: deeper drafts spread the requests' progress, the ones that accept most finish first, and the batch
waits for the rest in steps of a few requests.

    python bench/bench_finish_effect.py --batches 8 16 --out OUT    # depths 0-4, 5 rounds
    python bench/bench_finish_effect.py --quick                     # a smoke run (tests/test_bench_finish_effect.py)
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

from common import Table, cpu_threads, positive_int
from forced_depths import ForcedDepths, StepRecord, full_batch_ms
from replay import sweep_groups

from specdec.decoding import DraftModelStrategy, SpeculativeDecoder
from specdec.testing import ASSETS, heldout_token_ids, load_pair


def tokens_at_depth(steps: Sequence[StepRecord], batch: int, depth: int) -> float | None:
    """Mean tokens a greedy chain of ``depth`` would have emitted per step in ``steps``' whole-batch steps (each
    drafted at least ``depth``): 1 + min(accepted, depth) per request. None without such steps."""
    counts = [
        sum(1 + min(a, depth) for a in s.accepted)
        for s in steps
        if s.running == batch and s.drafted >= depth and None not in s.accepted
    ]
    return sum(counts) / len(counts) if counts else None


def tail_share(steps: Sequence[StepRecord], batch: int) -> float:
    """The share of ``steps``' time spent with part of the batch finished."""
    total = sum(s.seconds for s in steps)
    return sum(s.seconds for s in steps if s.running < batch) / total if total > 0 else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=positive_int, nargs="+", default=[8, 16], help="batch sizes")
    parser.add_argument("--max-depth", type=positive_int, default=4, help="the deepest fixed chain (depths 0 .. this)")
    parser.add_argument("--rounds", type=positive_int, default=5, help="timed rounds (each runs every depth once)")
    parser.add_argument("--new-tokens", type=positive_int, default=48, help="tokens per request")
    parser.add_argument("--quick", action="store_true", help="a smoke run: batch 2, depths 0-2, one round, 16 tokens")
    parser.add_argument("--out", type=Path, help="directory for the table")
    args = parser.parse_args()
    batches, top, rounds, new_tokens = (
        ([2], 2, 1, 16) if args.quick else (args.batches, args.max_depth, args.rounds, args.new_tokens)
    )
    cpu_threads("cpu")
    target, draft, tokenizer = load_pair("cpu", assets=ASSETS)
    pool = heldout_token_ids(tokenizer)
    depths = range(top + 1)
    table = Table(
        f"Fixed chain depths, per step and per whole static batch, embedded pair, cpu, one thread, greedy, "
        f"{new_tokens} tokens per request, {rounds} rounds: run tokens/s (median round), whole-batch step ms "
        f"(median), tokens per step and step rate at the deepest decoder's positions, tail share of step time",
        ["batch", "depth", "run tok/s", "run / plain", "step ms", "tokens per step", "step rate / plain",
         "tail share"],
    )  # fmt: skip
    for batch in batches:
        groups = sweep_groups(pool, batch)
        controllers = [ForcedDepths(lambda k, d=d: d) for d in depths]
        decoders = [SpeculativeDecoder(target, DraftModelStrategy(draft, (1,) * top), adaptive=c.controller)
                    for c in controllers]  # fmt: skip
        for controller, decoder in zip(controllers, decoders):  # warm-up, not timed
            decoder.generate(groups[0], max_new_tokens=new_tokens, seed=0, eos_token_id=None)
            controller.steps.clear()
        run_seconds = [[0.0] * rounds for _ in depths]
        for r in range(rounds):
            order = list(depths)[r % len(depths) :] + list(depths)[: r % len(depths)]
            for d in order:
                for g, prompts in enumerate(groups):
                    start = time.thread_time()
                    decoders[d].generate(prompts, max_new_tokens=new_tokens, seed=g, eos_token_id=None)
                    run_seconds[d][r] += time.thread_time() - start
        tokens = len(groups) * batch * new_tokens
        run_rate = [tokens / statistics.median(seconds) for seconds in run_seconds]
        step_ms = [full_batch_ms(c.steps, batch, d) for d, c in zip(depths, controllers)]
        per_step = [tokens_at_depth(controllers[top].steps, batch, d) for d in depths]
        step_rate = [t / ms if t is not None and ms else None for t, ms in zip(per_step, step_ms)]
        for d, controller in zip(depths, controllers):
            table.add(
                batch, d, run_rate[d], f"{run_rate[d] / run_rate[0]:.3f}x",
                f"{step_ms[d]:.2f}" if step_ms[d] is not None else "-",
                f"{per_step[d]:.2f}" if per_step[d] is not None else "-",
                f"{step_rate[d] / step_rate[0]:.3f}x" if step_rate[d] is not None and step_rate[0] else "-",
                f"{tail_share(controller.steps, batch):.2f}",
            )  # fmt: skip
    table.write(args.out, "finish_effect")


if __name__ == "__main__":
    main()
