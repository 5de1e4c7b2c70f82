"""Step times when plain and drafting steps mix, against the same steps in runs of their own (issue 16).

The adaptive controller prices a step by its shape alone. On a CPU whose caches hold most of a small model
that is not the whole story: plain steps run the target's few-row kernel on its packed weights, drafting
steps the draft model and oneDNN on other copies of the weights, so a step after steps of the other kind
finds its working set evicted. This benchmark decodes the embedded pair's held-out prompts at a fixed
pattern of depths per step (greedy, EOS ignored), one decoder per pattern, the patterns interleaved round by
round, and reports each kind of step's median thread time within each pattern:

* ``plain``: every step plain; ``K=D``: every step drafts D tokens per request (the peers: each kind alone);
* ``mostly plain``: 2 drafting steps in every 6; ``mostly drafting``: 2 plain steps in every 6.

Only steps that run every request of the batch count (a batch's last steps run fewer).

    python bench/bench_step_mixing.py --out OUT              # batches 8 and 32, depth 2, 5 rounds (~2 min)
    python bench/bench_step_mixing.py --quick                # a smoke run (tests/test_bench_step_mixing.py)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
from common import Table, cpu_threads  # noqa: E402

from specdec.cli.demo import ASSETS, heldout_prompts, load_pair  # noqa: E402
from specdec.decoding import AdaptiveSpeculation, DraftModelStrategy, SpeculativeDecoder  # noqa: E402


class PatternedDepths(AdaptiveSpeculation):
    """Not adaptive: step k of each stream drafts ``pattern(k)`` tokens per request (within its limit); records each
    step's thread time and depth when every request of the batch ran."""

    def __init__(self, pattern, batch: int):
        super().__init__(clock=time.thread_time)
        self.pattern, self.batch, self.step, self.times = pattern, batch, 0, []

    def start(self) -> None:
        super().start()
        self.step = 0

    def choose(self, running, limits, contexts):
        depth = self.pattern(self.step)
        self.step += 1
        self._started = self.clock()
        return [max(0, min(depth, limit)) for limit in limits]

    def observe(self, running, nodes, depths, accepted, contexts):
        if len(running) == self.batch:
            self.times.append((max(depths), self.clock() - self._started))


def patterns(depth: int) -> dict:
    return {
        "plain": lambda k: 0,
        f"K={depth}": lambda k: depth,
        "mostly plain": lambda k: depth if k % 6 in (3, 4) else 0,
        "mostly drafting": lambda k: 0 if k % 6 in (3, 4) else depth,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 32], help="batch sizes")
    parser.add_argument("--depth", type=int, default=2, help="the drafting steps' chain length")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (each runs every pattern once)")
    parser.add_argument("--new-tokens", type=int, default=48, help="tokens per request")
    parser.add_argument("--quick", action="store_true", help="a smoke run: batch 2, one round, 24 tokens")
    parser.add_argument("--out", type=Path, help="directory for the table")
    args = parser.parse_args()
    for name in ("batches", "rounds", "new_tokens"):
        values = getattr(args, name)
        if min(values if isinstance(values, list) else [values]) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.depth < 1:
        parser.error("--depth must be >= 1")
    batches, rounds, new_tokens = ([2], 1, 24) if args.quick else (args.batches, args.rounds, args.new_tokens)
    cpu_threads("cpu")
    target, draft, tokenizer = load_pair("cpu", assets=ASSETS)
    pool = [tokenizer.encode(p["text"]).ids for p in heldout_prompts(ASSETS)]
    table = Table(
        f"Step times, plain and drafting steps mixed, embedded pair, cpu, one thread, greedy, depth {args.depth}, "
        f"{new_tokens} tokens per request, {rounds} rounds: median ms per kind of step, and over the same kind's "
        f"median in a run of its own",
        ["batch", "pattern", "plain step ms", "drafting step ms", "plain / alone", "drafting / alone"],
    )  # fmt: skip
    for batch in batches:
        prompts = [pool[i % len(pool)] for i in range(batch)]
        plan = {name: PatternedDepths(p, batch) for name, p in patterns(args.depth).items()}
        decoders = [(c, SpeculativeDecoder(target, DraftModelStrategy(draft, (1,) * args.depth), adaptive=c))
                    for c in plan.values()]  # fmt: skip
        for controller, decoder in decoders:  # warm-up, not timed
            decoder.generate(prompts, max_new_tokens=new_tokens, seed=0, eos_token_id=None)
            controller.times.clear()
        for r in range(rounds):
            for _, decoder in decoders[r % len(decoders) :] + decoders[: r % len(decoders)]:
                decoder.generate(prompts, max_new_tokens=new_tokens, seed=0, eos_token_id=None)

        def median_ms(controller, drafting: bool) -> float | None:
            times = [t for depth, t in controller.times if (depth > 0) == drafting]
            return statistics.median(times) * 1e3 if times else None

        alone = (median_ms(plan["plain"], False), median_ms(plan[f"K={args.depth}"], True))
        for name, controller in plan.items():
            own = (median_ms(controller, False), median_ms(controller, True))
            cells = [f"{v:.2f}" if v is not None else "-" for v in own]
            ratios = [f"{v / a:.2f}x" if v is not None and a else "-" for v, a in zip(own, alone)]
            table.add(batch, name, *cells, *ratios)
    table.write(args.out, "step_mixing")


if __name__ == "__main__":
    main()
