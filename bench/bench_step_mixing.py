"""Step times when steps of two depths mix, against the same steps in runs of their own (issue 16).

The adaptive controller prices a step by its shape alone. On a CPU whose caches hold most of a small model
that is not the whole story: plain steps run the target's few-row kernel on its packed weights, drafting
steps the draft model and oneDNN on other copies of the weights, so a step after steps of the other kind
finds its working set evicted. This benchmark decodes the embedded pair's held-out prompts at a fixed
pattern of depths per step (greedy, EOS ignored), one decoder per pattern, the patterns interleaved round by
round, and reports each depth's median step thread time within each pattern. With ``--against 0`` (plain
decoding, the default) and ``--depth D``:

* ``plain``: every step plain; ``K=D``: every step drafts D tokens per request (the peers: each depth alone);
* ``mostly plain``: 2 steps of depth D in every 6, the rest plain; ``mostly K=D``: 2 plain steps in every 6.

``--against E`` mixes depth D with depth E instead of plain (two drafting depths whose row counts may take
different GEMM paths). Only steps that run every request of the batch at the pattern's depth count.

    python bench/bench_step_mixing.py --out OUT              # batches 8 and 32, depth 2 against plain, 5 rounds
    python bench/bench_step_mixing.py --batches 2 --depth 5 --against 2   # two drafting depths
    python bench/bench_step_mixing.py --quick                # a smoke run (tests/test_bench_step_mixing.py)
"""

from __future__ import annotations

import argparse
from pathlib import Path

from common import Table, cpu_threads, positive_int
from forced_depths import ForcedDepths, full_batch_ms

from specdec.decoding import DraftModelStrategy, SpeculativeDecoder
from specdec.testing import ASSETS, heldout_token_ids, load_pair


def label(depth: int) -> str:
    return "plain" if depth == 0 else f"K={depth}"


def patterns(depth: int, against: int) -> dict:
    """Pattern name -> the depth of step k of a stream."""
    return {
        label(against): lambda k: against,
        label(depth): lambda k: depth,
        f"mostly {label(against)}": lambda k: depth if k % 6 in (3, 4) else against,
        f"mostly {label(depth)}": lambda k: against if k % 6 in (3, 4) else depth,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=positive_int, nargs="+", default=[8, 32], help="batch sizes")
    parser.add_argument("--depth", type=positive_int, default=2, help="the drafting steps' chain length")
    parser.add_argument("--against", type=int, default=0, help="the depth mixed with --depth (0: plain decoding)")
    parser.add_argument("--rounds", type=positive_int, default=5, help="timed rounds (each runs every pattern once)")
    parser.add_argument("--new-tokens", type=positive_int, default=48, help="tokens per request")
    parser.add_argument("--quick", action="store_true", help="a smoke run: batch 2, one round, 24 tokens")
    parser.add_argument("--out", type=Path, help="directory for the table")
    args = parser.parse_args()
    if not 0 <= args.against != args.depth:
        parser.error("--against must be >= 0 and differ from --depth")
    batches, rounds, new_tokens = ([2], 1, 24) if args.quick else (args.batches, args.rounds, args.new_tokens)
    cpu_threads("cpu")
    target, draft, tokenizer = load_pair("cpu", assets=ASSETS)
    pool = heldout_token_ids(tokenizer)
    depths = (args.against, args.depth)
    chain = (1,) * max(depths)  # one strategy length for every pattern, so only the depths differ
    a, d = label(args.against), label(args.depth)
    table = Table(
        f"Step times, steps of depth {args.against} and {args.depth} mixed, embedded pair, cpu, one thread, greedy, "
        f"{new_tokens} tokens per request, {rounds} rounds: median ms per depth's step, and over the same depth's "
        f"median in a run of its own",
        ["batch", "pattern", f"{a} step ms", f"{d} step ms", f"{a} / alone", f"{d} / alone"],
    )  # fmt: skip
    for batch in batches:
        prompts = [pool[i % len(pool)] for i in range(batch)]
        plan = {name: ForcedDepths(p) for name, p in patterns(args.depth, args.against).items()}
        decoders = [(c, SpeculativeDecoder(target, DraftModelStrategy(draft, chain), adaptive=c.controller))
                    for c in plan.values()]  # fmt: skip
        for controller, decoder in decoders:  # warm-up, not timed
            decoder.generate(prompts, max_new_tokens=new_tokens, seed=0, eos_token_id=None)
            controller.steps.clear()
        for r in range(rounds):
            for _, decoder in decoders[r % len(decoders) :] + decoders[: r % len(decoders)]:
                decoder.generate(prompts, max_new_tokens=new_tokens, seed=0, eos_token_id=None)

        alone = [full_batch_ms(plan[label(depth)].steps, batch, depth) for depth in depths]
        for name, controller in plan.items():
            own = [full_batch_ms(controller.steps, batch, depth) for depth in depths]
            cells = [f"{v:.2f}" if v is not None else "-" for v in own]
            ratios = [f"{v / ref:.2f}x" if v is not None and ref else "-" for v, ref in zip(own, alone)]
            table.add(batch, name, *cells, *ratios)
    table.write(args.out, "step_mixing")


if __name__ == "__main__":
    main()
