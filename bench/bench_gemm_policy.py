"""The CPU GEMM policy end to end: decodes and prefills of the embedded pair under two values of
``cpu_linear.SKINNY_MAX_ROWS`` (the row count up to which every layer runs the skinny kernel), paired.

A GEMM timed alone runs hot in cache; a forward streams every layer's weight from beyond L2, so the
policy is chosen here, on whole decodes. Each case runs under both values back to back (the order
alternated), once per held-out prompt and round, in one process; the table gives the median and quartiles
of the speed ratio (per-thread CPU time of the first value / the second) over the pairs. Cases: greedy
decodes at batch 1 (autoregressive, the draft chain K=5, EAGLE-2's top-1 chain of 8 and its 12-node tree,
the draft tree 3,2,1,1,1) and batch 4 and 8 (the draft chain), and target prefills of 24, 90 and 300 rows.

    python bench/bench_gemm_policy.py --out OUT                    # 8 against 128 rows, 4 rounds
    python bench/bench_gemm_policy.py --rows 16 64 --rounds 2
    python bench/bench_gemm_policy.py --dry-run                    # one pair per case (tests the script)
"""

from __future__ import annotations

import statistics
import time

import torch
from common import Table, bench_args, cpu_path_only, positive_int

from specdec.cli.demo import CHAIN, TREE, eagle_row
from specdec.decoding import DraftModelStrategy, NoDraft, SpeculativeDecoder
from specdec.model import causal_positions, cpu_linear
from specdec.model.attention_metadata import AttentionMetadata
from specdec.testing import ASSETS, heldout_token_ids, load_pair


def decode_case(target, strategy, batch: int, new_tokens: int):
    """A function of (prompts, i): greedy decode of ``batch`` prompts from the i-th."""
    decoder = SpeculativeDecoder(target, strategy, adaptive=False)

    def run(pool, i):
        prompts = [pool[(i + j) % len(pool)] for j in range(batch)]
        decoder.generate(prompts, max_new_tokens=new_tokens, temperature=0.0, eos_token_id=None)

    return run


def prefill_case(target, rows: int):
    """A function of (prompts, i): the target's causal forward over ``rows`` tokens of the prompts from the i-th."""

    def run(pool, i):
        tokens = [t for j in range(len(pool)) for t in pool[(i + j) % len(pool)]][:rows]
        meta = AttentionMetadata(torch.tensor([0, rows], dtype=torch.int32))
        cache = target.new_cache(batch_size=1, max_len=rows)
        target(torch.tensor(tokens), causal_positions(meta.q_offsets, cache.seq_lens, rows), meta, cache)

    return run


def paired_ratios(run, pool, settings: tuple[int, int], rounds: int, prompts: int) -> list[float]:
    """Speed ratios time(settings[0]) / time(settings[1]) of ``run`` over prompts x rounds pairs, back to back."""
    ratios = []
    for r in range(rounds):
        for i in range(prompts):
            seconds = {}
            for value in settings if (r + i) % 2 == 0 else settings[::-1]:
                cpu_linear.SKINNY_MAX_ROWS = value
                start = time.thread_time()
                run(pool, i)
                seconds[value] = time.thread_time() - start
            ratios.append(seconds[settings[0]] / seconds[settings[1]])
    return ratios


def main() -> None:
    def extra(parser):
        parser.add_argument("--rows", type=positive_int, nargs=2, default=(8, 128), metavar=("OLD", "NEW"),
                            help="the two SKINNY_MAX_ROWS values compared (ratios: OLD's time / NEW's)")  # fmt: skip
        parser.add_argument("--rounds", type=positive_int, default=4, help="passes over the prompts")

    args = bench_args(__doc__.splitlines()[0], extra)
    cpu_path_only(args)
    if not cpu_linear.skinny_serves():
        raise SystemExit("the extension's skinny kernel is not available: build it (pip install -e .)")
    target, draft, tokenizer = load_pair("cpu", assets=ASSETS)
    pool = heldout_token_ids(tokenizer)
    prompts, rounds, new_tokens = (1, 1, 8) if args.dry_run else (6, args.rounds, 64)
    chain, tree = DraftModelStrategy(draft, (1,) * CHAIN), DraftModelStrategy(draft, TREE, rule="deterministic")
    eagle_chain = eagle_row(target, top_k=1, tree_budget=9, depth=8)[1]
    cases = [
        ("autoregressive, batch 1", decode_case(target, NoDraft(), 1, new_tokens)),
        (f"draft chain K={CHAIN}, batch 1", decode_case(target, chain, 1, new_tokens)),
        ("EAGLE-2 top-1 chain of 8, batch 1", decode_case(target, eagle_chain, 1, new_tokens)),
        ("EAGLE-2 12 nodes, batch 1", decode_case(target, eagle_row(target)[1], 1, new_tokens)),
        ("draft tree " + ",".join(map(str, TREE)) + ", batch 1", decode_case(target, tree, 1, new_tokens)),
        (f"draft chain K={CHAIN}, batch 4", decode_case(target, chain, 4, new_tokens)),
        (f"draft chain K={CHAIN}, batch 8", decode_case(target, chain, 8, new_tokens)),
    ] + [(f"target prefill, {n} rows", prefill_case(target, n)) for n in (24, 90, 300)]
    old, new = args.rows
    table = Table(
        f"CPU GEMM policy end to end: SKINNY_MAX_ROWS {old} against {new}, embedded pair, greedy, one thread, "
        f"{prompts} held-out prompts x {rounds} rounds, pairs back to back (order alternated)",
        ["case", "pairs", f"speed {new} / {old}: median", "quartiles"],
    )
    default = cpu_linear.SKINNY_MAX_ROWS
    try:
        with torch.inference_mode():
            for label, run in cases:
                for value in (old, new):  # warm-up: packs, caches' first allocations
                    cpu_linear.SKINNY_MAX_ROWS = value
                    run(pool, 0)
                ratios = paired_ratios(run, pool, (old, new), rounds, prompts)
                quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
                table.add(label, len(ratios), f"{statistics.median(ratios):.3f}x",
                          f"{quartiles[0]:.3f}-{quartiles[2]:.3f}")  # fmt: skip
    finally:
        cpu_linear.SKINNY_MAX_ROWS = default
    table.write(args.out, "gemm_policy")


if __name__ == "__main__":
    main()
