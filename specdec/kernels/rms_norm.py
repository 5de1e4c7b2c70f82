"""RMSNorm, alone and fused with the residual add in front of it (Zhang & Sennrich 2019).

    rms_norm(x, weight, eps)                  out = RMSNorm(x)
    add_rms_norm(x, residual, weight, eps)    residual += x;  out = RMSNorm(residual)

Numerics are HuggingFace's LlamaRMSNorm: the row h is normalised in float32,
``h * rsqrt(mean(h^2) + eps)``, rounded to the model dtype, then multiplied by the weight
in the model dtype. The residual sum is rounded to the model dtype before it is
normalised, exactly as ``residual + x`` is, so the fused form changes no bit of the
residual stream. The Triton kernel runs one token row per program with the whole row in
registers (hidden sizes up to MAX_HIDDEN): the add, the norm and both stores in one launch.
"""

from __future__ import annotations

import numbers

import torch

from specdec.kernels._checks import FLOAT_DTYPES, check_rows, check_tensor
from specdec.kernels._op import register_op
from specdec.kernels._triton import jit, next_power_of_2, tl
from specdec.kernels.tuning import TuningSpace, candidates, launch

MAX_HIDDEN = 16384  # a whole row lives in one program's registers


# --------------------------------------------------------------------------------------------
# Triton kernel
# --------------------------------------------------------------------------------------------


@jit
def _rms_norm_kernel(
    # x, residual, out: [T, H] (last dim contiguous); weight: [H]; all of the model dtype
    x_ptr,
    residual_ptr,  # read, summed with x and written back (ADD_RESIDUAL only)
    weight_ptr,
    out_ptr,
    # sizes
    H,
    eps,
    # strides (elements)
    stride_xt,
    stride_rt,
    stride_ot,
    # meta-parameters
    ADD_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    EVEN: tl.constexpr,  # H == BLOCK
):
    t = tl.program_id(0).to(tl.int64)
    lane = tl.arange(0, BLOCK)
    mask = lane < H
    if EVEN:  # the row fills the tile: no lane past it, contiguous (vectorised) accesses
        i = lane
    else:  # masked lanes address the row's last element, never past the row
        i = tl.minimum(lane, H - 1)
    h = tl.load(x_ptr + t * stride_xt + i, mask=mask, other=0.0)
    if ADD_RESIDUAL:
        r = tl.load(residual_ptr + t * stride_rt + i, mask=mask, other=0.0)
        h = (r.to(tl.float32) + h.to(tl.float32)).to(r.dtype)  # rounded as `residual + x` is
        tl.store(residual_ptr + t * stride_rt + i, h, mask=mask)

    # ---- normalise in float32, round to the model dtype, scale by the weight in the model dtype
    hf = h.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(hf * hf, axis=0) / H + eps)
    normed = (hf * rstd).to(h.dtype).to(tl.float32)
    w = tl.load(weight_ptr + i, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_ot + i, (normed * w).to(h.dtype), mask=mask)


# --------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------


# The whole row is one tile (BLOCK); only the warps are tuned. In place on the residual: restored
# between autotuning trials.
RMS_NORM_SPACE = TuningSpace(candidates(num_warps=(4, 8, 16)), key=("H", "ADD_RESIDUAL"), restore=("residual_ptr",))


def _default_warps(block: int, even: bool) -> dict:
    # a row that fills no tile (clamped lanes) needs more threads: at 8 and 16 warps hidden 5120 spilled on sm_80
    return dict(num_warps=min(max(block // 512, 4), 16) if even else min(max(block // 256, 4), 32))


def _launch(x, residual, weight, eps, out) -> None:
    T, H = x.shape
    if T == 0:
        return
    add = residual is not None
    block = next_power_of_2(H)
    args = (x, residual if add else x, weight, out, H, eps, x.stride(0), residual.stride(0) if add else 0,
            out.stride(0))  # fmt: skip
    even = block == H
    launch(_rms_norm_kernel, (T,), args, dict(ADD_RESIDUAL=add, BLOCK=block, EVEN=even), _default_warps(block, even),
           RMS_NORM_SPACE)  # fmt: skip


def _rms_norm_triton(x, weight, eps, out) -> None:
    _launch(x, None, weight, eps, out)


def _add_rms_norm_triton(x, residual, weight, eps, out) -> None:
    _launch(x, residual, weight, eps, out)


def _rms_norm_torch(x, weight, eps, out) -> None:
    """The reference's arithmetic, op for op (so bit for bit), with its no-op casts skipped in float32
    and its temporaries updated in place: a model calls this twice per layer."""
    h = x if x.dtype == torch.float32 else x.float()
    normed = h * h.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()
    torch.mul(weight, normed if x.dtype == torch.float32 else normed.to(x.dtype), out=out)


def _add_rms_norm_torch(x, residual, weight, eps, out) -> None:
    residual += x
    _rms_norm_torch(residual, weight, eps, out)


# --------------------------------------------------------------------------------------------
# Registered ops
# --------------------------------------------------------------------------------------------


@register_op("rms_norm", mutates_args=("out",), triton=_rms_norm_triton, torch=_rms_norm_torch)
def rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor) -> None: ...


@register_op("add_rms_norm", mutates_args=("residual", "out"), triton=_add_rms_norm_triton, torch=_add_rms_norm_torch)
def add_rms_norm_op(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor
) -> None: ...


# --------------------------------------------------------------------------------------------
# Public ops
# --------------------------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm of each row: ``weight * (h * rsqrt(mean(h^2) + eps))``, normalised in float32.

    Parameters
    ----------
    x : ``[T, H]`` float16, bfloat16 or float32, last dim contiguous; H <= MAX_HIDDEN (16384).
    weight : ``[H]`` dtype of ``x``, contiguous.
    eps : float >= 0, added to the mean square.
    out : optional ``[T, H]`` dtype of ``x``, last dim contiguous (may be ``x`` itself).

    Returns
    -------
    ``out`` (allocated when not given): ``[T, H]`` dtype of ``x``.

    Example
    -------
    >>> x = torch.tensor([[2.0, -2.0, 2.0, -2.0]])                  # root mean square 2
    >>> rms_norm(x, torch.tensor([1.0, 2.0, 3.0, 4.0]), 0.0).tolist()
    [[1.0, -2.0, 3.0, -4.0]]
    """
    out = _check(x, weight, eps, out)
    rms_norm_op.run(x, weight, float(eps), out)
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``residual += x`` in place, then ``rms_norm(residual, weight, eps)``: one launch on a GPU.

    Parameters
    ----------
    x : ``[T, H]`` float16, bfloat16 or float32, last dim contiguous (e.g. an attention or MLP output).
    residual : ``[T, H]`` dtype of ``x``, last dim contiguous; the residual stream, updated in
        place to ``residual + x`` rounded to its dtype.
    weight : ``[H]`` dtype of ``x``, contiguous.
    eps : float >= 0.
    out : optional ``[T, H]`` dtype of ``x``, last dim contiguous.

    Returns
    -------
    ``out`` (allocated when not given): ``[T, H]``, the normalised updated residual.

    Example
    -------
    >>> residual = torch.tensor([[1.0, -1.0, 1.0, -1.0]])
    >>> out = add_rms_norm(torch.tensor([[1.0, -1.0, 1.0, -1.0]]), residual, torch.ones(4), 0.0)
    >>> residual.tolist(), out.tolist()
    ([[2.0, -2.0, 2.0, -2.0]], [[1.0, -1.0, 1.0, -1.0]])
    """
    out = _check(x, weight, eps, out)
    check_tensor("residual", residual, dtype=x.dtype, shape=tuple(x.shape), device=x.device)
    check_rows("residual", residual)
    add_rms_norm_op.run(x, residual, weight, float(eps), out)
    return out


def _check(x, weight, eps, out) -> torch.Tensor:
    """Check the arguments every form shares; returns ``out`` (allocated when None)."""
    check_tensor("x", x, dtype=FLOAT_DTYPES, ndim=2)
    check_rows("x", x)
    T, H = x.shape
    if not 0 < H <= MAX_HIDDEN:
        raise ValueError(f"x must have a hidden size in [1, {MAX_HIDDEN}], got {H}")
    check_tensor("weight", weight, dtype=x.dtype, shape=(H,), device=x.device, contiguous=True)
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not eps >= 0:
        raise ValueError(f"eps must be a real number >= 0, got {eps!r}")
    if out is None:
        return torch.empty(T, H, dtype=x.dtype, device=x.device)
    check_tensor("out", out, dtype=x.dtype, shape=(T, H), device=x.device)
    return check_rows("out", out)


# --------------------------------------------------------------------------------------------
# PyTorch references
# --------------------------------------------------------------------------------------------


def rms_norm_reference(x, weight, eps, *, out=None) -> torch.Tensor:
    """Readable PyTorch RMSNorm (HuggingFace's LlamaRMSNorm numerics); writes ``out`` when given."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return torch.mul(weight, h.to(x.dtype), out=out)


def add_rms_norm_reference(x, residual, weight, eps, *, out=None) -> torch.Tensor:
    """Readable PyTorch ``add_rms_norm``: ``residual += x`` in place, then its RMSNorm."""
    residual += x
    return rms_norm_reference(residual, weight, eps, out=out)
