"""The CPU body of greedy chain verification: the extension's C++ pass against the PyTorch body, as the vLLM
plugin calls it (``verify_chain_greedy(..., check=False)``: fresh result buffers, no argument checks).

    PYTHONPATH=. python bench/bench_chain_greedy_cpu.py [--vocab 4096] [--k 5] [--batches 1 6]

The default vocabulary is the embedded pair's. Each request drafts K tokens whose first few follow the
target's argmax (a drawn number accepted), fp32 logits; both bodies run interleaved, one call each in turn, on
one intra-op thread, timed with the thread's CPU time, and must give equal results.
"""

from __future__ import annotations

import sys

import torch
from common import Table, bench_args, cpu_threads, measure_many_us

from specdec import _backend
from specdec.kernels import verify_chain_greedy
from specdec.kernels.verify_greedy import _has_cpp_greedy


def chains(batch: int, k: int, vocab: int, dtype: torch.dtype, gen: torch.Generator):
    """K drafts per request, the first ``accepted`` of them the target's argmax, then a wrong one."""
    logits = torch.randn(batch * (k + 1), vocab, generator=gen).to(dtype)
    argmax = logits.float().argmax(-1).to(torch.int32).view(batch, k + 1)[:, :k]
    accepted = torch.randint(0, k + 1, (batch, 1), generator=gen)
    tokens = torch.where(torch.arange(k) < accepted, argmax, (argmax + 1) % vocab).flatten().contiguous()
    offsets = torch.arange(0, batch * k + 1, k, dtype=torch.int32)
    return logits, tokens, offsets


def main() -> None:
    def extra(parser):
        parser.add_argument("--vocab", type=int, default=4096, help="the embedded pair's vocabulary by default")
        parser.add_argument("--k", type=int, default=5)
        parser.add_argument("--batches", type=int, nargs="+", default=[1, 6])

    args = bench_args(__doc__.splitlines()[0], extra)
    if not _has_cpp_greedy():
        sys.exit(f"the C++ body is not available: {_backend.extension_status()[1]}")
    cpu_threads("cpu")
    gen = torch.Generator().manual_seed(0)
    table = Table(
        f"verify_chain_greedy(check=False) on the CPU, K={args.k}, vocab {args.vocab}, one thread, interleaved",
        ["batch", "dtype", "C++ us (p20-p80)", "PyTorch body us (p20-p80)", "PyTorch / C++"],
    )
    for batch in args.batches:
        for dtype in (torch.float32, torch.bfloat16):
            inputs = chains(batch, args.k, args.vocab, dtype, gen)

            def run(backend: str, inputs=inputs):
                with _backend.use_backend(backend):  # "auto": the C++ body; "torch": the PyTorch body
                    return verify_chain_greedy(*inputs, None, max_draft_len=args.k, check=False)

            for a, b in zip(run("auto"), run("torch")):
                assert torch.equal(a, b), "the two bodies disagree"
            budget = 0.05 if args.dry_run else 1.0
            (fast, f20, f80), (slow, s20, s80) = measure_many_us(
                [lambda: run("auto"), lambda: run("torch")], "cpu", budget_s=budget
            )
            table.add(batch, str(dtype).removeprefix("torch."), f"{fast:.1f} ({f20:.1f}-{f80:.1f})",
                      f"{slow:.1f} ({s20:.1f}-{s80:.1f})", f"{slow / fast:.1f}x")  # fmt: skip
    table.write(args.out, "chain_greedy_cpu")


if __name__ == "__main__":
    main()
