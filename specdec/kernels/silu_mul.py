"""SwiGLU activation (Shazeer 2020) of a fused gate/up projection: ``silu(gate) * up``.

A LLaMA MLP computes ``down(silu(gate(x)) * up(x))``. With the gate and up weights
concatenated (``cat([gate_proj.weight, up_proj.weight])``, one GEMM), each row of the
projection output ``gate_up [T, 2I]`` holds the gate in its first I columns and the up
projection in the last I. silu is computed in float32 and rounded to the model dtype
before the product, which is rounded again, as ``F.silu(gate) * up`` rounds them. The
Triton kernel reads both halves and writes the ``[T, I]`` result in one launch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specdec.kernels._checks import FLOAT_DTYPES, check_rows, check_tensor
from specdec.kernels._op import register_op
from specdec.kernels._triton import cdiv, jit, next_power_of_2, tl
from specdec.kernels.tuning import TuningSpace, candidates, launch

_MAX_BLOCK = 1024


# --------------------------------------------------------------------------------------------
# Triton kernel
# --------------------------------------------------------------------------------------------


@jit
def _silu_mul_kernel(
    gate_up_ptr,  # [T, 2I] (last dim contiguous): gate | up
    out_ptr,  # [T, I] (last dim contiguous)
    I,
    stride_in,
    stride_out,
    BLOCK: tl.constexpr,
    EVEN: tl.constexpr,  # I % BLOCK == 0
):
    t = tl.program_id(0).to(tl.int64)
    lane = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = lane < I
    if EVEN:  # the tiles cover the row exactly: no lane past it, contiguous (vectorised) accesses
        j = lane
    else:  # masked lanes address the last column, never past the row
        j = tl.minimum(lane, I - 1)
    row = gate_up_ptr + t * stride_in
    gate = tl.load(row + j, mask=mask, other=0.0)
    up = tl.load(row + I + j, mask=mask, other=0.0).to(tl.float32)
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)  # silu, rounded as F.silu rounds it
    tl.store(out_ptr + t * stride_out + j, (act * up).to(gate.dtype), mask=mask)


# --------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------


# The tile (BLOCK) follows the row (EVEN: the tiles cover it exactly, no clamped lanes); only the warps are tuned.
SILU_MUL_SPACE = TuningSpace(candidates(num_warps=(4, 8)), key=("I",))


def _silu_mul_triton(gate_up, out) -> None:
    T, I = out.shape
    if T == 0:
        return
    block = min(next_power_of_2(I), _MAX_BLOCK)
    meta = dict(BLOCK=block, EVEN=I % block == 0)
    grid = (T, cdiv(I, block))
    launch(_silu_mul_kernel, grid, (gate_up, out, I, gate_up.stride(0), out.stride(0)), meta, dict(num_warps=4),
           SILU_MUL_SPACE)  # fmt: skip


def _silu_mul_torch(gate_up, out) -> None:
    silu_mul_reference(gate_up, out=out)


# --------------------------------------------------------------------------------------------
# Registered op
# --------------------------------------------------------------------------------------------


@register_op("silu_mul", mutates_args=("out",), triton=_silu_mul_triton, torch=_silu_mul_torch)
def silu_mul_op(gate_up: torch.Tensor, out: torch.Tensor) -> None: ...


# --------------------------------------------------------------------------------------------
# Public op
# --------------------------------------------------------------------------------------------


def silu_mul(gate_up: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate_up[:, :I]) * gate_up[:, I:]``: the SwiGLU activation of a fused gate/up projection.

    Parameters
    ----------
    gate_up : ``[T, 2I]`` float16, bfloat16 or float32, last dim contiguous; the gate in the
        first I columns, the up projection in the last I.
    out : optional ``[T, I]`` dtype of ``gate_up``, last dim contiguous.

    Returns
    -------
    ``out`` (allocated when not given): ``[T, I]`` dtype of ``gate_up``.

    Example
    -------
    >>> gate_up = torch.tensor([[0.0, 100.0, 3.0, 2.0]])        # gate [0, 100], up [3, 2]
    >>> silu_mul(gate_up).tolist()                              # silu(0) = 0, silu(100) = 100
    [[0.0, 200.0]]
    """
    check_tensor("gate_up", gate_up, dtype=FLOAT_DTYPES, ndim=2)
    check_rows("gate_up", gate_up)
    T, two_i = gate_up.shape
    if two_i % 2:
        raise ValueError(f"gate_up must have an even last dim (gate | up), got {two_i}")
    if out is None:
        out = torch.empty(T, two_i // 2, dtype=gate_up.dtype, device=gate_up.device)
    check_tensor("out", out, dtype=gate_up.dtype, shape=(T, two_i // 2), device=gate_up.device)
    check_rows("out", out)
    silu_mul_op.run(gate_up, out)
    return out


# --------------------------------------------------------------------------------------------
# PyTorch reference
# --------------------------------------------------------------------------------------------


def silu_mul_reference(gate_up, *, out=None) -> torch.Tensor:
    """Readable PyTorch ``silu(gate) * up``; writes ``out`` when given."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.mul(F.silu(gate), up, out=out)
