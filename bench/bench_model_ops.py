"""Per-layer model ops: specdec's fused RMSNorm, add + RMSNorm, RoPE and SwiGLU against the eager
PyTorch composites of HuggingFace's LLaMA (written out below), measured in one run.

Peers: RMSNorm (6 ATen ops); ``residual + x`` then RMSNorm; cos/sin from the positions then
``x * cos + rotate_half(x) * sin`` on q and on k (the op computes its angles itself, so the peer
computes cos/sin too); ``F.silu(gate) * up`` on the halves of a fused gate/up output. specdec is timed twice:
the public function (argument checks + custom-op dispatch, what outside callers pay; CUDA events,
host time included) and the op body the model's planned forward calls directly, inside a CUDA graph
from a cold L2 like the composite (``common.measure_many_us``). Bytes that must move: every input
read once and every output written once; GB/s is that over the body's time, "% copy" that over the
device-to-device copy bandwidth measured in the same run. A fixed cost and a streaming rate are
fitted per op over the token counts.

    python bench/bench_model_ops.py --quick        # CPU smoke run: embedded-target shapes, fp32, one thread
    python bench/bench_model_ops.py --dry-run      # the GPU check's rehearsal: tiny shapes
    python bench/bench_model_ops.py --out OUT      # GPU: LLaMA-3-8B shapes (hidden 4096, 32/8 heads of 128,
                                                   # intermediate 14336), bf16, decode T=1, 8 and prefill T=512

On the CPU the body is the PyTorch reference, written to equal the composite bit for bit, so
the CPU ratio mostly measures dispatch overhead: that run checks the script, not the kernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from common import Table, bench_args, copy_bandwidth_gbs, cpu_threads, fit_table, measure_many_us

from specdec import _backend
from specdec.kernels import add_rms_norm, apply_rotary, rms_norm, silu_mul
from specdec.kernels.rms_norm import add_rms_norm_op, rms_norm_op
from specdec.kernels.rotary import apply_rotary_op
from specdec.kernels.silu_mul import silu_mul_op

EPS = 1e-5


def hf_rms_norm(x, weight):
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)


def hf_rope(x, positions, inv_freq):
    angles = positions.float()[:, None] * inv_freq[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = angles.cos().to(x.dtype)[:, None], angles.sin().to(x.dtype)[:, None]
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def cases(T, shape, dtype, device, backend):
    """{op: (public call, body call, eager composite, bytes moved, first run)}; the first run calls the body
    once on fresh inputs and returns (what it wrote, what the composite computes) for the check."""
    hidden, hq, hkv, d, inner = shape
    size = torch.empty(0, dtype=dtype).element_size()
    x = torch.randn(T, hidden, device=device).to(dtype)
    residual = torch.randn(T, hidden, device=device).to(dtype)
    weight = torch.randn(hidden, device=device).to(dtype)
    norm = lambda h: hf_rms_norm(h, weight)  # noqa: E731
    out = torch.empty_like(x)
    qkv = torch.randn(T, hq + 2 * hkv, d, device=device).to(dtype)
    q, k = qkv[:, :hq], qkv[:, hq : hq + hkv]
    positions = torch.arange(1000, 1000 + T, device=device)
    inv_freq = 1.0 / 500000.0 ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d)
    gate_up = torch.randn(T, 2 * inner, device=device).to(dtype)
    act = torch.empty(T, inner, device=device, dtype=dtype)
    rms, add_rms, rope, silu = (op.body(backend) for op in (rms_norm_op, add_rms_norm_op, apply_rotary_op, silu_mul_op))

    def eager_rope():
        return hf_rope(q, positions, inv_freq), hf_rope(k, positions, inv_freq)

    def first_rms():
        rms(x, weight, EPS, out)
        return out, norm(x)

    def first_add_rms():
        expected = norm(residual + x)
        add_rms(x, residual, weight, EPS, out)
        return out, expected

    def first_rope():
        expected = torch.cat(eager_rope(), dim=1)
        rope(q, k, positions, inv_freq)
        return qkv[:, : hq + hkv], expected

    def first_silu():
        silu(gate_up, act)
        return act, F.silu(gate_up[:, :inner]) * gate_up[:, inner:]

    return {
        "rms_norm": (
            lambda: rms_norm(x, weight, EPS, out=out),
            lambda: rms(x, weight, EPS, out),
            lambda: norm(x),
            (2 * T * hidden + hidden) * size,
            first_rms,
        ),
        "add_rms_norm": (
            lambda: add_rms_norm(x, residual, weight, EPS, out=out),
            lambda: add_rms(x, residual, weight, EPS, out),
            lambda: norm(residual + x),
            (4 * T * hidden + hidden) * size,
            first_add_rms,
        ),
        "apply_rotary": (
            lambda: apply_rotary(q, k, positions, inv_freq),
            lambda: rope(q, k, positions, inv_freq),
            eager_rope,
            2 * T * (hq + hkv) * d * size + T * 8 + d * 2,
            first_rope,
        ),
        "silu_mul": (
            lambda: silu_mul(gate_up, out=act),
            lambda: silu(gate_up, act),
            lambda: F.silu(gate_up[:, :inner]) * gate_up[:, inner:],
            3 * T * inner * size,
            first_silu,
        ),
    }


def check(name: str, T: int, ours: torch.Tensor, expected: torch.Tensor, exact: bool) -> None:
    """The body's first result against the composite's: bit for bit for the CPU's PyTorch body."""
    tol = 0.0 if exact else {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}[ours.dtype]
    if not torch.allclose(ours.float(), expected.float(), atol=tol, rtol=tol):
        raise AssertionError(f"{name} (T={T}): specdec and the eager composite disagree")


def main():
    args = bench_args(__doc__.splitlines()[0])
    device = args.device
    cpu_threads(device)
    if args.dry_run:
        shape, dtype, tokens = (96, 4, 2, 32, 160), torch.float32, (1, 5)
    elif args.quick:
        shape, dtype, tokens = (256, 8, 4, 32, 768), torch.float32, (1, 8, 64)
    else:
        shape, dtype, tokens = (4096, 32, 8, 128, 14336), torch.bfloat16, (1, 8, 512)
    backend = _backend.select_backend(torch.empty(0, device=device))
    bandwidth = copy_bandwidth_gbs(device)
    hidden, hq, hkv, d, inner = shape
    table = Table(
        f"model ops, hidden {hidden}, {hq}/{hkv} heads of {d}, intermediate {inner}, {str(dtype)[6:]}, {device} "
        f"(specdec backend: {backend}; copy bandwidth {bandwidth:.0f} GB/s)",
        [
            "op",
            "T",
            "KB moved",
            "specdec op µs",
            "specdec body µs (p20-p80)",
            "eager µs (p20-p80)",
            "speedup",
            "body GB/s",
            "% copy",
            "x copy time",
            "timing",
        ],
        configs=True,
    )
    fits: dict[str, list[tuple[float, float]]] = {}
    for T in tokens:
        for name, (public, body, eager, nbytes, first_run) in cases(T, shape, dtype, device, backend).items():
            check(name, T, *first_run(), exact=backend == "torch")
            methods = ["events", "graph", "graph"]  # the public call with its host time, the bodies in graphs
            t_public, t_body, t_eager = measure_many_us([public, body, eager], device, method=methods)
            copy_us = nbytes / (bandwidth * 1e9) * 1e6
            gbs = nbytes / (t_body[0] * 1e-6) / 1e9
            fits.setdefault(name, []).append((nbytes, t_body[0]))
            table.add(
                name,
                T,
                f"{nbytes / 1e3:.1f}",
                f"{t_public[0]:.1f}",
                f"{t_body[0]:.1f} ({t_body[1]:.1f}-{t_body[2]:.1f})",
                f"{t_eager[0]:.1f} ({t_eager[1]:.1f}-{t_eager[2]:.1f})",
                f"{t_eager[0] / t_body[0]:.2f}x",
                f"{gbs:.1f}",
                f"{100 * gbs / bandwidth:.0f}%",
                f"{t_body[0] / copy_us:.1f}",
                t_body.method,
                data=dict(op=name, tokens=T, bytes=nbytes, public_us=t_public[0], body_us=t_body[0],
                          eager_us=t_eager[0], pct_copy=100 * gbs / bandwidth),
            )  # fmt: skip
    fitted = fit_table(f"Fixed cost and streaming rate of the bodies, fitted over T ({device})", fits, bandwidth)
    table.write(args.out, "bench_model_ops", dict(copy_gbs=bandwidth, fits=fitted))


if __name__ == "__main__":
    main()
