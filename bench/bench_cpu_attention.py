"""CPU tree attention on the padded batch: SDPA (torch's CPU flash-attention kernel) against the extension's kernel
(``specdec.kernels.cpu_attention``), both through ``tree_attention(..., plan=, check=False)`` with one plan,
interleaved, one thread, float32.

Shapes: the embedded target's heads (8 query heads, 4 KV heads, head dim 32) at batch 1 and 6, 1 query per
request (decode) and 6 (a K=5 chain's verification), contexts of 64, 256 and 512 positions, and an 8B-like head
shape (32 / 8 / 128) at batch 1. The model's layout: uniform query counts, q a slice of a fused qkv, the contiguous
cache read as a view. "warm": the operands stay in the caches between calls; "cold": a 64 MiB copy between calls
(not timed) evicts them, as a model's other layers do between two calls of one layer.

    python bench/bench_cpu_attention.py              # CPU, the shapes above
    python bench/bench_cpu_attention.py --dry-run    # tiny shapes, one timed run (tests the script)
"""

from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "0"  # the PyTorch body (a CPU user's default), not Triton's interpreter

import common
import torch
from common import Table, bench_args, clock, cpu_threads

from specdec import use_backend
from specdec.kernels import cpu_attention, plan_attention, tree_attention

# (batch, queries per request, context, query heads, KV heads, head dim)
EMBEDDED = [(b, n, c, 8, 4, 32) for b in (1, 6) for n in (1, 6) for c in (64, 256, 512)]
LARGE_HEADS = [(1, n, c, 32, 8, 128) for n in (1, 6) for c in (256, 512)]
DRY = [(2, 1, 20, 8, 4, 32), (1, 3, 19, 4, 2, 20)]


def setup(batch, n, context, heads, kv_heads, head_dim, gen):
    """The operands and plan of one layer's call, laid out as the model's forward lays them out."""
    qkv = torch.randn(batch * n, (heads + 2 * kv_heads) * head_dim, generator=gen)
    q = qkv[:, : heads * head_dim].view(batch * n, heads, head_dim)
    shape = (batch, context + 64, kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    plan = plan_attention(
        torch.arange(0, batch * n + 1, n, dtype=torch.int32), torch.full((batch,), context - n, dtype=torch.int32),
        num_tokens=batch * n, num_heads=heads, cache_shape=shape, dtype=torch.float32, causal=True,
        uniform_queries=True, finite_cache=True,
    )  # fmt: skip
    return q, k_cache, v_cache, plan, torch.empty(batch * n, heads, head_dim)


def measure(fns, cold: tuple[torch.Tensor, torch.Tensor] | None, min_runs: int, budget_s: float):
    """(median, p20, p80) microseconds of each function, interleaved; with ``cold`` a copy between calls."""
    if common.DRY_RUN:
        min_runs, budget_s = 1, 0.0
    now = clock("cpu")
    for fn in fns:
        fn()
    times = [[] for _ in fns]
    start = now()
    while len(times[0]) < min_runs or (now() - start < budget_s * len(fns) and len(times[0]) < 1000):
        for fn, samples in zip(fns, times):
            if cold is not None:
                cold[1].copy_(cold[0])
            t0 = now()
            fn()
            samples.append(1e6 * (now() - t0))
    return [common._quantiles(s) for s in times]


def planned(q, k_cache, v_cache, plan, out):
    """One layer's attention under ``plan``, unchecked (as a model's forward runs it)."""
    tree_attention(q, k_cache, v_cache, plan=plan, out=out, check=False)


def main() -> None:
    args = bench_args(__doc__.splitlines()[0])
    if not cpu_attention.available():
        sys.exit("the extension's padded_attention op is not built (python setup.py build_ext --inplace)")
    cpu_threads("cpu")
    gen = torch.Generator().manual_seed(0)
    shapes = DRY if args.dry_run else EMBEDDED + LARGE_HEADS
    flush = torch.randn((1 << 24) if not args.dry_run else 1 << 10)
    cold = (flush, torch.empty_like(flush))
    columns = ["B", "n", "context", "Hq/Hkv/D", "state", "SDPA us (p20-p80)", "kernel us (p20-p80)", "SDPA / kernel"]
    table = Table("CPU tree attention, float32, one thread (median of interleaved calls)", columns + ["GFLOP/s kernel"])
    with torch.inference_mode():
        for batch, n, context, heads, kv_heads, head_dim in shapes:
            operands = setup(batch, n, context, heads, kv_heads, head_dim, gen)
            out = operands[-1]

            def sdpa(operands=operands):
                with use_backend("torch"):  # the PyTorch backend forced: SDPA
                    planned(*operands)

            def kernel(operands=operands):
                planned(*operands)

            expected = torch.empty_like(out)
            sdpa()
            expected.copy_(out)
            kernel()
            torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
            flops = 4 * batch * n * heads * context * head_dim
            for state in ("warm", "cold"):
                s, k = measure([sdpa, kernel], cold if state == "cold" else None, min_runs=20, budget_s=0.3)
                shape = f"{heads}/{kv_heads}/{head_dim}"
                spread = [f"{t[0]:.1f} ({t[1]:.0f}-{t[2]:.0f})" for t in (s, k)]
                table.add(batch, n, context, shape, state, *spread, f"{s[0] / k[0]:.2f}x", f"{flops / k[0] / 1e3:.1f}")
    table.write(args.out, "cpu_attention")


if __name__ == "__main__":
    main()
