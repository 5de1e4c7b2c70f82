"""Sampled decoding's host paths, each against the path it replaced, in one run with identical tokens checked.

1. Roots alone: ``specdec.decoding.verification.verify`` sends a sampled batch without drafts (plain decoding,
   a step whose controller drafts nothing, the prefill) to the ``sample`` op, verify_tree without drafts by
   construction; the peer routes that call through ``verify_tree`` on the same roots (plain decoding, T=1).
2. The draft's token sampling: a draft chain draws each token through ``filtered_probs`` and ``sample_probs``
   with ``check=False`` (no argument checks, no dispatcher); the peer through the same ops checked (a fixed
   draft chain K=5, T=1).

Embedded pair, one thread on the CPU, per-thread CPU time; ratios are medians of paired rounds (the order
alternates every round).

    python bench/bench_sampled_paths.py --out OUT     # batch 1, 2, 6; 9 rounds of 64 tokens
    python bench/bench_sampled_paths.py --dry-run     # one round of 4 tokens at batch 2 (tests the script)
"""

from __future__ import annotations

import statistics

import torch
from common import Table, bench_args, clock, cpu_threads

from specdec.decoding import DraftModelStrategy, NoDraft, SpeculativeDecoder, draft_model, verification
from specdec.kernels import SampleResult, filtered_probs, sample_probs, verify_tree
from specdec.testing import heldout_token_ids, load_pair


def through_verify_tree(logits: torch.Tensor, params, *, check: bool) -> SampleResult:
    """The general path on roots alone (unchecked, as ``verify`` calls ``sample``): what it ran before the sample
    route."""
    rows, device = logits.shape[0], logits.device
    roots = torch.full((rows,), -1, dtype=torch.int32, device=device)
    offsets = torch.arange(rows + 1, dtype=torch.int32, device=device)
    result = verify_tree(logits, torch.zeros(rows, dtype=torch.int32, device=device), roots, offsets, params,
                         rule="deterministic", max_depth=0, check=check)  # fmt: skip
    return SampleResult(result.output_tokens[:, 0], result.invalid)


def checked_filtered_probs(logits, params, *, check: bool):
    return filtered_probs(logits, params)  # (``check`` is the hot path's False: checked regardless)


def checked_sample_probs(probs, params, *, counter, check: bool):
    return sample_probs(probs, params, counter=counter)


# title -> (module whose names are swapped, {name: (new, old)}, decoder(target, draft), (new label, old label))
COMPARISONS = {
    "roots alone, plain decoding": (
        verification, {"sample": (verification.sample, through_verify_tree)},
        lambda target, draft: SpeculativeDecoder(target, NoDraft()), ("sample", "verify_tree"),
    ),
    "the draft's token sampling, draft chain K=5": (
        draft_model,
        {"filtered_probs": (draft_model.filtered_probs, checked_filtered_probs),
         "sample_probs": (draft_model.sample_probs, checked_sample_probs)},
        lambda target, draft: SpeculativeDecoder(target, DraftModelStrategy(draft, (1,) * 5), adaptive=False),
        ("check=False", "checked"),
    ),
}  # fmt: skip


def main() -> None:
    args = bench_args(__doc__.splitlines()[0])
    cpu_threads(args.device)
    now = clock(args.device)
    target, draft, tokenizer = load_pair(device=args.device)
    pool = heldout_token_ids(tokenizer)
    batches, rounds, new_tokens = ((2,), 1, 4) if args.dry_run else ((1, 2, 6), 9, 64)
    kwargs = dict(max_new_tokens=new_tokens, eos_token_id=None, temperature=1.0, seed=1)
    table = Table(
        f"Sampled decoding (T=1), embedded pair, {args.device}, {new_tokens} tokens per request, median of "
        f"{rounds} paired rounds",
        ["path", "batch", "new ms", "old ms", "speed-up (median)", "rounds", "identical"],
    )
    for title, (module, swaps, make, (new, old)) in COMPARISONS.items():
        try:
            for batch in batches:
                decoder = make(target, draft)
                decoder.generate(pool[:batch], **kwargs)  # warm-up
                seconds, tokens = {new: [], old: []}, {}
                for r in range(rounds):
                    for i in (0, 1) if r % 2 == 0 else (1, 0):  # alternate which goes first
                        for name, pair in swaps.items():
                            setattr(module, name, pair[i])
                        start = now()
                        tokens[(new, old)[i]] = decoder.generate(pool[:batch], **kwargs).tokens
                        seconds[(new, old)[i]].append(now() - start)
                ratios = [o / n for n, o in zip(seconds[new], seconds[old])]
                same = tokens[new] == tokens[old]
                table.add(f"{title}: {new} vs {old}", batch, f"{1e3 * statistics.median(seconds[new]):.1f}",
                          f"{1e3 * statistics.median(seconds[old]):.1f}", f"{statistics.median(ratios):.3f}x",
                          f"{min(ratios):.2f}-{max(ratios):.2f}", "yes" if same else "NO")  # fmt: skip
                if not same:
                    raise SystemExit(f"{title}, batch {batch}: the two paths gave different tokens")
        finally:
            for name, pair in swaps.items():
                setattr(module, name, pair[0])
    table.write(args.out, "sampled_paths")


if __name__ == "__main__":
    main()
