"""Tree attention's padded batch on the CPU through the extension's kernel (``csrc/padded_attention_cpu.cpp``).

``tree_attention_torch`` runs one masked ``scaled_dot_product_attention`` over the padded batch. On the CPU
that is torch's flash-attention kernel, built for long blocks of queries: a decode step (1 query per
request) or a chain's verification (K + 1) with a few small heads ran it at under 2 GFLOP/s. The
extension's ``padded_attention`` takes the same operands (q ``[B * n, Hq, D]``, the caches, the additive
mask ``[B, 1, n, L]``) and writes ``out`` in place: per request it reads each K and V row once for all
the queries and query heads that use it, and never reads the positions the mask hides from every query
of the request.

``applies`` says when the kernel runs: float32 CPU tensors, the extension built with the op, an x86
CPU with AVX2 + FMA (``vector_cpu``), the backend not forced to ``torch`` (``SPECDEC_BACKEND=torch``
keeps plain PyTorch, as for the skinny GEMMs), and eager mode (a ``torch.compile`` graph keeps SDPA).
``tree_attention_torch`` asks it when the plan reads a finite contiguous cache as a view (what decoding, chains
and trees run; ragged query counts are gathered into their padded slots first); gathered caches and the
log-sum-exp stay on SDPA.
Results agree with SDPA up to float32 rounding.

In the row-invariant mode (``SPECDEC_ROW_INVARIANT=1``, ``specdec.set_row_invariant``) the kernel serves every
float32 CPU attention of a forward outside ``torch.compile`` (gathered caches too, the backend forced to ``torch``
too, the generic version where AVX2 is missing) one query row at a time: a row's sums run over exactly the
positions it sees, in order, so its output has the same bits in a decode step, a chain or a tree.
"""

from __future__ import annotations

import functools

import torch

from specdec import _backend


@functools.cache
def available() -> bool:
    """The loaded extension has the op (one built before it was added has not)."""
    return _backend.extension_has_op("padded_attention")


if available():  # for torch.compile and torch.library.opcheck: the op only writes ``out``

    @torch.library.register_fake("specdec::padded_attention")
    def _(q, k_cache, v_cache, attn_bias, scale, out, row_invariant=False):
        return None


@functools.cache
def vector_cpu() -> bool:
    """This CPU runs the kernel's AVX2 + FMA version (torch's CPU capability is AVX2 or AVX-512). Elsewhere the
    extension runs its generic version, slower than SDPA on the embedded target's shapes (forced with
    SPECDEC_ATTENTION_GENERIC=1; ``bench/bench_cpu_attention.py`` compares them), so SDPA stays."""
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def applies(q: torch.Tensor) -> bool:
    """The kernel runs for queries ``q`` (the caches and mask share its dtype and device in a plan); not inside
    ``torch.compile`` (its graph keeps SDPA), so nothing here is traced."""
    if torch.compiler.is_compiling() or q.dtype != torch.float32 or q.device.type != "cpu":
        return False
    if _backend.row_invariant():
        if not available():
            raise RuntimeError(
                f"{_backend.ROW_INVARIANT_ENV}=1 (set_row_invariant) needs the extension's padded_attention op: "
                "build it with `pip install --no-build-isolation -e .`"
            )
        return True
    return _backend.forced_backend() != "torch" and available() and vector_cpu()


def row_invariant() -> bool:
    """The row-invariant mode is on (``specdec.set_row_invariant``): gathered caches run the kernel too."""
    return _backend.row_invariant()


def padded_attention(q, k_cache, v_cache, attn_bias, scale: float, out) -> None:
    """Row ``b * n + i`` of ``out [B * n, Hq, D]``: ``softmax(scale q.k^T + attn_bias[b, 0, i]) v`` over positions
    ``0 .. L-1`` of cache row b, per query head (KV head ``h // (Hq / Hkv)``); q ``[B * n, Hq, D]``, caches
    ``[rows >= B, max_len >= L, Hkv, D]``, attn_bias ``[B, 1, n, L]`` (-inf hides), float32 CPU, last dims
    contiguous. A query that sees nothing gets 0. In the row-invariant mode, one query row at a time."""
    torch.ops.specdec.padded_attention(q, k_cache, v_cache, attn_bias, scale, out, _backend.row_invariant())
