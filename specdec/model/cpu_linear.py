"""Linear layers of multi-row forwards on the CPU: oneDNN with each weight packed once.

On the 2-core AMD EPYC this policy was chosen on, PyTorch's ``F.linear`` runs one row (decode at
batch 1) well but a few rows poorly: at 6 rows the embedded target's fused gate/up GEMM takes 1.5x,
and its LM head 2x, the time oneDNN takes with the weight reordered ("packed") for it. The gain is
machine-dependent (bench/RESULTS.md, "CPU GEMMs": on an Intel Xeon with AVX-512 only the LM head
gains, from 6 rows). Multi-row forwards are every verification of a chain or tree, a batch's decode and
the prefill. One packed layout serves every row count from 2 up (packs made for 2 to 32 rows ran
alike), and one row runs best unpacked, so ``linear_for`` picks, once per forward, either
``F.linear`` or ``packed_linear``, which packs a weight on its first use and keeps the pack on the
weight tensor itself: it lives as long as the weight and costs a second copy of it. The pack
records the weight's version and storage, so a weight changed in place or swapped by loading is
packed again, never served stale. Weights below ``PACK_MIN_ELEMENTS`` (there the call's own cost
wins), float16/bfloat16, inference-mode weights (no version counter), autograd and
``torch.compile`` (its graph keeps ``F.linear``) stay on ``F.linear``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

# Measured at 6 rows, one thread, AMD EPYC: 256 x 256 to 768 x 256 weights ran alike or slower packed,
# 256 x 1536 (the fused gate/up) 1.3-1.5x and 256 x 4096 (an LM head) 1.6-2x faster.
PACK_MIN_ELEMENTS = 1 << 18
PACK_ROWS = 32  # the row count the layout is packed for (any count >= 2 runs alike)
AVAILABLE = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` through oneDNN with ``weight`` packed (float32 CPU tensors, no autograd)."""
    if weight.numel() < PACK_MIN_ELEMENTS or weight.is_inference():
        return F.linear(x, weight, bias)
    stamp = (weight._version, weight.data_ptr())
    entry = getattr(weight, "_specdec_onednn", None)
    if entry is None or entry[0] != stamp:
        entry = (stamp, torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS))
        weight._specdec_onednn = entry
    return torch.ops.mkldnn._linear_pointwise(x, entry[1], bias, "none", [], "")


def linear_for(x: torch.Tensor) -> Callable[..., torch.Tensor]:
    """The linear function for a forward whose activations are ``x [rows, features]`` (a host decision)."""
    if (
        AVAILABLE
        and x.shape[0] > 1
        and x.dtype == torch.float32
        and x.device.type == "cpu"
        and not torch.is_grad_enabled()
        and not torch.compiler.is_compiling()
    ):
        return packed_linear
    return F.linear
