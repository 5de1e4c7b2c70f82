"""CPU GEMMs: the model's linear layers through ``F.linear``, ``packed_linear`` (oneDNN, the weight packed
once) and ``skinny_linear`` (the extension's kernel for a few rows; ``specdec.model.cpu_linear``),
interleaved in one run, one thread, float32.

Shapes: the embedded target's qkv, o, fused gate/up, down and LM head, at the row counts of a decode
(1), a chain or tree verification or a small batch (2, 6, 8, 12, 16, 24) and prefills (64, 128, 256). The
last column is the function ``linear_for`` picks for the shape (what the model runs). When vLLM's CPU
build is importable (its own environment), its prepacked oneDNN GEMM (``onednn_mm``) is one more
column: the engine peer's GEMM.

    python bench/bench_cpu_linear.py                 # CPU, the embedded target's shapes
    python bench/bench_cpu_linear.py --dry-run       # one timed run per shape (tests the script)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from common import Table, bench_args, cpu_threads, measure_many_us

from specdec.model.cpu_linear import (
    PACK_MIN_ELEMENTS,
    linear_for,
    packed_linear,
    skinny_available,
    skinny_linear,
)

# (layer, in features, out features) of the embedded target (hidden 256, 8 + 2 x 4 heads of 32, MLP 768, vocab 4096)
SHAPES = (("qkv", 256, 512), ("o", 256, 256), ("gate/up", 256, 1536), ("down", 768, 256), ("LM head", 256, 4096))


def vllm_gemm():
    """vLLM's prepacked oneDNN GEMM as ``(pack(weight) -> handle, run(handle, x))``, or None without vLLM."""
    try:
        from vllm import _custom_ops as ops
    except ImportError:
        return None
    if not getattr(ops, "_supports_onednn", False):
        return None
    return (lambda weight: ops.create_onednn_mm(weight.t(), 32)), (lambda handle, x: ops.onednn_mm(handle, x, None))


def model_runs(x: torch.Tensor, weight: torch.Tensor) -> str:
    """The GEMM the model runs for this layer at this row count (``linear_for``'s choice, then its own)."""
    chosen, large = linear_for(x), weight.numel() >= PACK_MIN_ELEMENTS
    if chosen is skinny_linear:
        return "skinny"
    return "packed" if chosen is packed_linear and large else "F.linear"


def main() -> None:
    args = bench_args(__doc__.splitlines()[0])
    cpu_threads("cpu")
    peer = vllm_gemm()
    skinny = skinny_available()
    rows_list = (1, 6) if args.quick else (1, 2, 6, 8, 12, 16, 24, 64, 128, 256)
    columns = ["layer", "K x N", "rows", "F.linear us", "packed us", "F.linear / packed"]
    columns += ["skinny us", "F.linear / skinny", "packed / skinny", "float32 pack / skinny"] if skinny else []
    columns += ["vLLM onednn_mm us", "F.linear / vLLM"] if peer else []
    version = torch.ops.specdec.skinny_linear_version() if skinny else "not built"
    title = f"CPU linear layers, float32, one thread (median of interleaved calls; skinny kernel version: {version})"
    table = Table(title, columns + ["model runs"])
    gen = torch.Generator().manual_seed(0)
    # Ordinary tensors (packs need a version) of bfloat16 values, as the embedded target's checkpoint holds: the
    # skinny kernel runs them from a bfloat16 pack; "float32 pack" is the same kernel on a float32 pack of them.
    weights = [torch.randn(n, k, generator=gen).bfloat16().float() for _, k, n in SHAPES]
    with torch.inference_mode():
        for (name, k, n), weight in zip(SHAPES, weights):
            handle = peer[0](weight) if peer else None
            float_pack = torch.ops.specdec.skinny_linear_pack(weight) if skinny else None
            for rows in rows_list:
                x = torch.randn(rows, k, generator=gen)
                fns = [lambda x=x, w=weight: F.linear(x, w), lambda x=x, w=weight: packed_linear(x, w)]
                if skinny:
                    fns += [lambda x=x, w=weight: skinny_linear(x, w)]
                    fns += [lambda x=x, p=float_pack, n=n: torch.ops.specdec.skinny_linear(x, p, n)]
                fns += [lambda x=x, h=handle: peer[1](h, x)] if peer else []
                times = [t[0] for t in measure_many_us(fns, "cpu", min_runs=20, budget_s=0.3)]
                cells = [name, f"{k}x{n}", rows, times[0], times[1], f"{times[0] / times[1]:.2f}x"]
                if skinny:
                    cells += [times[2], f"{times[0] / times[2]:.2f}x", f"{times[1] / times[2]:.2f}x"]
                    cells += [f"{times[3] / times[2]:.2f}x"]
                cells += [times[-1], f"{times[0] / times[-1]:.2f}x"] if peer else []
                table.add(*cells, model_runs(x, weight))
    table.write(args.out, "cpu_linear")


if __name__ == "__main__":
    main()
