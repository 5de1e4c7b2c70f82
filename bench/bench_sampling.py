"""Sampling microbenchmark: specdec's fused ``sample`` / ``filtered_probs`` and the K/V write
``kv_append`` against what a plain PyTorch serving loop runs for the same result, in one run.

- "sample": temperature, top-k, top-p and one draw per row. The peer divides by the temperature,
  masks below the k-th largest logit, sorts for the top-p cut, softmaxes and calls
  ``torch.multinomial`` (the eager recipe; it draws other random numbers, so only the cost is
  compared, not the tokens).
- "filtered probs": the same filter, probabilities out (what draft strategies feed verification).
- "kv append": a decode step's new K/V rows written after each request's prefix, one layer; the
  peer is an ``index_put_`` per K and V with the positions built on the device.

Bytes floor: the logits read once (and for "filtered probs" the probabilities written once);
for "kv append" the K/V rows read and written once.

    python bench/bench_sampling.py --quick          # CPU smoke run (small shapes, one thread)
    python bench/bench_sampling.py --out OUT_DIR    # GPU: batch {1, 8, 64}, vocab {32000, 128256}
    python bench/bench_sampling.py --dry-run        # tiny shapes, checks the script (bench/gpu_check.py)

On the CPU specdec runs its PyTorch bodies (what dispatch picks there): the ratio measures those
bodies against the eager recipe, not the Triton kernels.
"""

from __future__ import annotations

import torch
from common import Table, bench_args, copy_bandwidth_gbs, cpu_threads, measure_many_us

from specdec.kernels import SamplingParams, filtered_probs, kv_append, sample

TEMPERATURE, TOP_K, TOP_P = 0.8, 50, 0.9


def eager_filtered_probs(logits: torch.Tensor, top_k: int, top_p: float, temperature: float) -> torch.Tensor:
    """The textbook recipe: scale, keep the top k, keep the smallest prefix of mass >= top_p, softmax."""
    scaled = logits.float() / temperature
    kth = scaled.topk(top_k, dim=-1).values[:, -1:]
    scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    cumulative = sorted_logits.softmax(-1).cumsum(-1)
    drop_sorted = cumulative - sorted_logits.softmax(-1) >= top_p  # mass before this token already >= top_p
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return scaled.masked_fill(drop, float("-inf")).softmax(-1)


def sampling_rows(table: Table, batch: int, vocab: int, dtype: torch.dtype, device: str, floor_gbs: float) -> None:
    logits = (torch.randn(batch, vocab, device=device) * 3).to(dtype)
    params = SamplingParams.make(
        batch, temperature=TEMPERATURE, top_k=TOP_K, top_p=TOP_P, seed=torch.arange(batch), device=device
    )
    read = logits.numel() * logits.element_size()
    cases = {
        "sample": (
            lambda: sample(logits, params),
            lambda: torch.multinomial(eager_filtered_probs(logits, TOP_K, TOP_P, TEMPERATURE), 1),
            read,
        ),
        "filtered probs": (
            lambda: filtered_probs(logits, params),
            lambda: eager_filtered_probs(logits, TOP_K, TOP_P, TEMPERATURE),
            read + batch * vocab * 4,
        ),
    }
    for kind, (ours, peer, nbytes) in cases.items():
        (fast, f20, f80), (eager, _, _) = measure_many_us([ours, peer], device)
        floor_us = nbytes / (floor_gbs * 1e9) * 1e6
        table.add(
            kind,
            batch,
            vocab,
            str(dtype).removeprefix("torch."),
            fast,
            f"{f20:.1f}-{f80:.1f}",
            eager,
            f"{eager / fast:.2f}x",
            f"{fast / floor_us:.1f}",
        )


def kv_append_row(
    table: Table, batch: int, heads: int, dim: int, dtype: torch.dtype, device: str, floor_gbs: float
) -> None:
    """One decode token per request, written after prefixes of random length."""
    max_len = 1024 if batch <= 8 else 256
    data = torch.randn(1, 2, batch, max_len, heads, dim, device=device).to(dtype)
    k = torch.randn(batch, heads, dim, device=device).to(dtype)
    v = torch.randn_like(k)
    seq_lens = torch.randint(0, max_len - 1, (batch,), device=device, dtype=torch.int32)
    q_offsets = torch.arange(batch + 1, device=device, dtype=torch.int32)
    rows = torch.arange(batch, device=device)

    def eager():
        positions = seq_lens.long()
        data[0, 0].index_put_((rows, positions), k)
        data[0, 1].index_put_((rows, positions), v)

    ours = lambda: kv_append(data, 0, k, v, seq_lens, q_offsets, check_bounds=False)
    (fast, f20, f80), (peer, _, _) = measure_many_us([ours, eager], device)
    floor_us = 2 * 2 * k.numel() * k.element_size() / (floor_gbs * 1e9) * 1e6
    table.add(
        "kv append",
        batch,
        f"{heads}x{dim}",
        str(dtype).removeprefix("torch."),
        fast,
        f"{f20:.1f}-{f80:.1f}",
        peer,
        f"{peer / fast:.2f}x",
        f"{fast / floor_us:.1f}",
    )


def main() -> None:
    args = bench_args(__doc__.splitlines()[0])
    cpu_threads(args.device)
    floor_gbs = copy_bandwidth_gbs(args.device)
    table = Table(
        f"Sampling and K/V append ({args.device}; floor bandwidth {floor_gbs:.0f} GB/s)",
        ["op", "batch", "vocab / heads x dim", "dtype", "specdec µs", "p20-p80", "eager µs", "speedup", "x floor"],
        configs=True,
    )
    quick = args.quick or not args.device.startswith("cuda")
    batches = (2,) if args.dry_run else (1, 8) if quick else (1, 8, 64)
    vocabs = (300,) if args.dry_run else (32000,) if quick else (32000, 128256)
    dtypes = (torch.float32,) if quick else (torch.float32, torch.bfloat16)
    for dtype in dtypes:
        for vocab in vocabs:
            for batch in batches:
                sampling_rows(table, batch, vocab, dtype, args.device, floor_gbs)
        for batch in batches:
            kv_append_row(table, batch, *((2, 32) if args.dry_run else (8, 128)), dtype, args.device, floor_gbs)
    table.write(args.out, "sampling")


if __name__ == "__main__":
    main()
