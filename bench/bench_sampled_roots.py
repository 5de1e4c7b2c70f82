"""Sampled plain decoding: a step of roots alone through ``sample`` against the general ``verify_tree`` path.

``specdec.decoding.verification.verify`` sends a sampled batch without drafts (plain decoding, a step whose
controller drafts nothing, the prefill) to the ``sample`` op, verify_tree without drafts by construction. This
runs plain decoding at temperature 1 on the embedded pair both ways in one run -- the peer is the same engine
with that call routed through ``run_verify_tree`` on the same roots -- rounds interleaved, and checks the tokens
are identical. Ratios are medians of paired rounds (per-thread CPU time, one thread on the CPU).

    python bench/bench_sampled_roots.py --out OUT     # batch 1, 2, 6; 9 rounds of 64 tokens
    python bench/bench_sampled_roots.py --dry-run     # one round of 4 tokens at batch 2 (tests the script)
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Table, bench_args, clock, cpu_threads  # noqa: E402

from specdec.cli.demo import ASSETS, heldout_prompts, load_pair  # noqa: E402
from specdec.decoding import NoDraft, SpeculativeDecoder, verification  # noqa: E402
from specdec.kernels import SampleResult, run_verify_tree  # noqa: E402


def through_verify_tree(logits: torch.Tensor, params) -> SampleResult:
    """The general path on roots alone: what ``verify`` ran before the sample route."""
    rows, device = logits.shape[0], logits.device
    roots = torch.full((rows,), -1, dtype=torch.int32, device=device)
    offsets = torch.arange(rows + 1, dtype=torch.int32, device=device)
    result = run_verify_tree(logits, torch.zeros(rows, dtype=torch.int32, device=device), roots, offsets, params,
                             rule="deterministic", draft_probs=None, max_depth=0)  # fmt: skip
    return SampleResult(result.output_tokens[:, 0], result.invalid)


def main() -> None:
    args = bench_args(__doc__.splitlines()[0])
    cpu_threads(args.device)
    now = clock(args.device)
    target, _, tokenizer = load_pair(device=args.device)
    pool = [tokenizer.encode(p["text"]).ids for p in heldout_prompts(ASSETS)]
    batches, rounds, new_tokens = ((2,), 1, 4) if args.dry_run else ((1, 2, 6), 9, 64)
    paths = {"sample": verification.run_sample, "verify_tree": through_verify_tree}
    table = Table(
        f"Sampled plain decoding (T=1), embedded pair, {args.device}, {new_tokens} tokens per request, "
        f"median of {rounds} paired rounds",
        ["batch", "sample ms", "verify_tree ms", "speed-up (median)", "rounds", "identical"],
    )
    try:
        for batch in batches:
            decoder = SpeculativeDecoder(target, NoDraft())
            kwargs = dict(max_new_tokens=new_tokens, eos_token_id=None, temperature=1.0, seed=1)
            decoder.generate(pool[:batch], **kwargs)  # warm-up
            seconds, tokens = {name: [] for name in paths}, {}
            for r in range(rounds):
                for name in paths if r % 2 == 0 else reversed(list(paths)):  # alternate which goes first
                    verification.run_sample = paths[name]
                    start = now()
                    tokens[name] = decoder.generate(pool[:batch], **kwargs).tokens
                    seconds[name].append(now() - start)
            ratios = [v / s for s, v in zip(seconds["sample"], seconds["verify_tree"])]
            same = tokens["sample"] == tokens["verify_tree"]
            median = {name: f"{1e3 * statistics.median(s):.1f}" for name, s in seconds.items()}
            table.add(batch, median["sample"], median["verify_tree"], f"{statistics.median(ratios):.3f}x",
                      f"{min(ratios):.2f}-{max(ratios):.2f}", "yes" if same else "NO")  # fmt: skip
            if not same:
                raise SystemExit(f"batch {batch}: the two paths gave different tokens")
    finally:
        verification.run_sample = paths["sample"]
    table.write(args.out, "sampled_roots")


if __name__ == "__main__":
    main()
