"""What the row-invariant CPU forward (``SPECDEC_ROW_INVARIANT=1``) costs end to end, on the embedded pair.

Plain decoding (``NoDraft``) and the draft chain of K = 5 (coupled, fixed depths), seeded sampling at T = 1.0, each
prompt alone (batch 1) and the prompts in batches; every (method, mode) on the same prompts, interleaved batch by
batch, each keeping its fastest of ``--repeats`` runs. One intra-op thread, thread CPU time (``common.clock``); the
CPU path only (Triton's interpreter refused). The last column counts the tokens a method emits alike in both modes
(the default forward is not row-invariant: a few may differ).

    python bench/bench_row_invariant.py --quick          # seconds
    python bench/bench_row_invariant.py --out OUT        # 6 prompts x 96 tokens, batches 1 and 6
"""

from __future__ import annotations

from common import Table, bench_args, clock, cpu_path_only, positive_int

import specdec
from specdec.decoding import DraftModelStrategy, NoDraft, SpeculativeDecoder
from specdec.testing import heldout_token_ids, load_pair

SEED = 2**40 + 17


def main() -> None:
    def extra(parser):
        parser.add_argument("--prompts", type=positive_int, default=6)
        parser.add_argument("--tokens", type=positive_int, default=96, help="new tokens per prompt")
        parser.add_argument("--batches", type=positive_int, nargs="+", default=[1, 6])
        parser.add_argument("--repeats", type=positive_int, default=3)

    args = bench_args(__doc__.splitlines()[0], extra)
    cpu_path_only(args)
    prompts, tokens, repeats = (2, 8, 1) if args.quick else (args.prompts, args.tokens, args.repeats)
    target, draft, tokenizer = load_pair()
    pool = heldout_token_ids(tokenizer)[:prompts]
    seeds = [SEED + i for i in range(prompts)]
    decoders = {
        "NoDraft": SpeculativeDecoder(target, NoDraft()),
        "chain K=5": SpeculativeDecoder(target, DraftModelStrategy(draft, (1,) * 5), adaptive=False),
    }
    now = clock("cpu")
    table = Table(
        f"Row-invariant forward: tokens/s with the mode off (default) and on, embedded pair, CPU float32, one "
        f"thread, {prompts} prompts x {tokens} tokens, seeded T=1.0, fastest of {repeats}, interleaved",
        ["method", "batch", "off tok/s", "on tok/s", "on / off", "tokens equal off vs on"],
    )
    for batch in args.batches if not args.quick else [1, 2]:
        groups = [list(range(i, min(prompts, i + batch))) for i in range(0, prompts, batch)]
        best: dict[tuple[str, bool], list[float]] = {}
        out: dict[tuple[str, bool], list[list[int]]] = {}
        for _ in range(repeats):
            for g, group in enumerate(groups):
                for name, decoder in decoders.items():
                    for mode in (False, True):
                        specdec.set_row_invariant(mode)
                        start = now()
                        requests, request_seeds = [pool[i] for i in group], [seeds[i] for i in group]
                        result = decoder.generate(requests, max_new_tokens=tokens, seed=request_seeds,
                                                  eos_token_id=None, temperature=1.0)  # fmt: skip
                        seconds = now() - start
                        times = best.setdefault((name, mode), [float("inf")] * len(groups))
                        times[g] = min(times[g], seconds)
                        out.setdefault((name, mode), [None] * len(groups))[g] = result.tokens
        specdec.set_row_invariant(None)
        for name in decoders:
            rate = {mode: prompts * tokens / sum(best[name, mode]) for mode in (False, True)}
            flat = {mode: [t for group in out[name, mode] for row in group for t in row] for mode in (False, True)}
            equal = sum(a == b for a, b in zip(flat[False], flat[True]))
            table.add(name, batch, f"{rate[False]:.0f}", f"{rate[True]:.0f}", f"{rate[True] / rate[False]:.2f}x",
                      f"{equal}/{len(flat[False])}")  # fmt: skip
    table.write(args.out, "row_invariant_cost")


if __name__ == "__main__":
    main()
