"""Rotary position embedding (Su et al. 2021) applied in place to the queries and keys of a layer.

For a head vector x of size D, position p and frequencies ``inv_freq [D/2]``, the angle of
pair i is ``a_i = p * inv_freq[i]`` (float32) and the pair (x_i, x_{i+D/2}) -- HuggingFace's
half-rotation layout of the q/k projection weights -- becomes

    x_i       <- x_i * cos a_i - x_{i+D/2} * sin a_i
    x_{i+D/2} <- x_{i+D/2} * cos a_i + x_i * sin a_i

with cos and sin rounded to the model dtype and every product and sum rounded to it, as
the HuggingFace composite (``x * cos + rotate_half(x) * sin``) rounds them. The Triton
kernel computes the angles itself (no cos/sin tensors) and rotates q and k in one launch:
program (t, g) takes token t's g-th block of query heads and its g-th block of KV heads.
q and k may be strided views of one fused QKV projection output.
"""

from __future__ import annotations

import torch

from specdec.kernels._checks import FLOAT_DTYPES, check_rows, check_tensor
from specdec.kernels._op import register_op
from specdec.kernels._triton import cdiv, jit, next_power_of_2, tl
from specdec.kernels.tuning import TuningSpace, candidates, launch

INDEX_DTYPES = (torch.int32, torch.int64)
_MAX_TILE = 256  # heads x pairs per program


# --------------------------------------------------------------------------------------------
# Triton kernel
# --------------------------------------------------------------------------------------------


@jit
def _rotate_heads(ptr, heads, first_head, stride_h, cos, sin, i, pair_mask, HALF, HEAD_BLOCK: tl.constexpr):
    # rotate heads first_head .. first_head + HEAD_BLOCK - 1 (those < heads) of one token, in place;
    # masked lanes address the last head / pair (clamped), never past the tensor
    head = first_head + tl.arange(0, HEAD_BLOCK)
    mask = (head < heads)[:, None] & pair_mask[None, :]
    h = tl.minimum(head, heads - 1)
    lo = ptr + h[:, None] * stride_h + i[None, :]
    x1 = tl.load(lo, mask=mask, other=0.0)
    x2 = tl.load(lo + HALF, mask=mask, other=0.0)
    dtype = x1.dtype
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    # each product and sum rounded to the model dtype, as the composite rounds them
    new1 = (x1 * cos).to(dtype).to(tl.float32) - (x2 * sin).to(dtype).to(tl.float32)
    new2 = (x2 * cos).to(dtype).to(tl.float32) + (x1 * sin).to(dtype).to(tl.float32)
    tl.store(lo, new1.to(dtype), mask=mask)
    tl.store(lo + HALF, new2.to(dtype), mask=mask)


@jit
def _rotary_kernel(
    # q [T, Hq, D], k [T, Hkv, D] (last dim contiguous), rotated in place
    q_ptr,
    k_ptr,
    positions_ptr,  # [T] int32 or int64
    inv_freq_ptr,  # [D/2] float32
    # sizes
    Hq,
    Hkv,
    HALF,  # D / 2
    # strides (elements)
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    # meta-parameters
    HEAD_BLOCK: tl.constexpr,
    HALF_BLOCK: tl.constexpr,
    EVEN_PAIRS: tl.constexpr,  # HALF == HALF_BLOCK
):
    t = tl.program_id(0).to(tl.int64)
    first_head = tl.program_id(1) * HEAD_BLOCK

    # ---- the token's angles, cos and sin rounded to the model dtype
    pair = tl.arange(0, HALF_BLOCK)
    pair_mask = pair < HALF
    if EVEN_PAIRS:  # the pairs fill the tile: contiguous (vectorised) accesses
        i = pair
    else:  # masked lanes address the last pair, never past the head
        i = tl.minimum(pair, HALF - 1)
    position = tl.load(positions_ptr + t).to(tl.float32)
    angle = position * tl.load(inv_freq_ptr + i, mask=pair_mask, other=0.0)
    dtype = q_ptr.dtype.element_ty
    cos = tl.cos(angle).to(dtype).to(tl.float32)[None, :]
    sin = tl.sin(angle).to(dtype).to(tl.float32)[None, :]

    # ---- this program's block of query heads and of KV heads (masked off past the last head)
    _rotate_heads(q_ptr + t * stride_qt, Hq, first_head, stride_qh, cos, sin, i, pair_mask, HALF, HEAD_BLOCK)
    _rotate_heads(k_ptr + t * stride_kt, Hkv, first_head, stride_kh, cos, sin, i, pair_mask, HALF, HEAD_BLOCK)


# --------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------


# Heads per program and warps are tuned; the pair dimension is one tile (HALF_BLOCK). In place on
# q and k: restored between autotuning trials.
ROTARY_SPACE = TuningSpace(
    tuple(c for c in candidates(HEAD_BLOCK=(2, 4, 8), num_warps=(2, 4)) if c != dict(HEAD_BLOCK=8, num_warps=4)),
    key=("Hq", "Hkv", "HALF"),
    restore=("q_ptr", "k_ptr"),
)  # 8 heads x 64 pairs on 4 warps spills a few bytes on sm_90


def _default_heads(heads: int, half_block: int) -> dict:
    head_block = min(next_power_of_2(heads), max(_MAX_TILE // half_block, 1))
    return dict(HEAD_BLOCK=head_block, num_warps=4)


def _apply_rotary_triton(q, k, positions, inv_freq) -> None:
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    if T == 0:
        return
    heads, half_block = max(Hq, Hkv), next_power_of_2(D // 2)
    args = (q, k, positions, inv_freq, Hq, Hkv, D // 2, q.stride(0), q.stride(1), k.stride(0), k.stride(1))
    grid = lambda c: (T, cdiv(heads, c["HEAD_BLOCK"]))
    meta = dict(HALF_BLOCK=half_block, EVEN_PAIRS=half_block == D // 2)
    launch(_rotary_kernel, grid, args, meta, _default_heads(heads, half_block), ROTARY_SPACE)


def _apply_rotary_torch(q, k, positions, inv_freq) -> None:
    cos, sin = rotary_tables(positions, inv_freq, q.dtype)
    q.copy_(rotate(q, cos, sin))
    k.copy_(rotate(k, cos, sin))


def rotary_tables(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """``(cos, sin)``, each ``[T, 1, D]`` in ``dtype``, for ``rotate``: computed once per forward, shared by
    every layer. The sign of the half rotation is folded into ``sin`` (its first half negated), which
    changes no bit: ``(-x) * s == x * (-s)`` exactly."""
    angles = positions.float()[:, None] * inv_freq[None, :]  # [T, D/2], float32 as the reference
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    return torch.cat((cos, cos), dim=-1)[:, None], torch.cat((-sin, sin), dim=-1)[:, None]


def rotary_table(num_positions: int, inv_freq: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[P, 2, 1, D]``: ``rotary_tables`` of positions 0 .. P-1 (cos in ``[:, 0]``, sin in ``[:, 1]``), so a
    forward gathers its rows (one ``index_select``) instead of computing them; the same bits."""
    positions = torch.arange(num_positions, device=inv_freq.device)
    return torch.stack(rotary_tables(positions, inv_freq, dtype), dim=1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [T, H, D]`` rotated by ``rotary_tables`` (a new tensor): the reference's ``x * cos +
    rotate_half(x) * sin`` in four ops, bitwise equal (``roll`` by D/2 swaps the halves; the sign is in
    ``sin``). q and k of a fused QKV projection rotate as one ``[T, Hq + Hkv, D]`` view."""
    return torch.roll(x, x.shape[-1] // 2, -1).mul_(sin).add_(x * cos)


# --------------------------------------------------------------------------------------------
# Registered op
# --------------------------------------------------------------------------------------------


@register_op("apply_rotary", mutates_args=("q", "k"), triton=_apply_rotary_triton, torch=_apply_rotary_torch)
def apply_rotary_op(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> None: ...


# --------------------------------------------------------------------------------------------
# Public op
# --------------------------------------------------------------------------------------------


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> None:
    """Rotate the queries and keys of ``T`` tokens by their positions, in place (HuggingFace layout).

    Parameters
    ----------
    q : ``[T, Hq, D]`` float16, bfloat16 or float32, last dim contiguous (any token/head
        strides: a view of a fused QKV projection output is fine); D even.
    k : ``[T, Hkv, D]`` dtype of ``q``, last dim contiguous; must not overlap ``q``.
    positions : ``[T]`` int32 or int64, contiguous; the RoPE position of each token.
    inv_freq : ``[D/2]`` float32, contiguous; the rotation frequency of each pair (i, i + D/2),
        scaling (llama3, linear) already applied.

    Example
    -------
    >>> q = torch.tensor([[[1.0, 0.0]]]); k = torch.tensor([[[0.0, 2.0]]])   # T=1, one head, D=2
    >>> apply_rotary(q, k, torch.tensor([1]), torch.tensor([torch.pi / 2]))  # a quarter turn
    >>> torch.allclose(q, torch.tensor([[[0.0, 1.0]]]), atol=1e-6)
    True
    >>> torch.allclose(k, torch.tensor([[[-2.0, 0.0]]]), atol=1e-6)
    True
    """
    check_tensor("q", q, dtype=FLOAT_DTYPES, ndim=3)
    check_rows("q", q)
    T, _, D = q.shape
    if D % 2:
        raise ValueError(f"q must have an even head dim (pairs i, i + D/2), got {D}")
    check_tensor("k", k, dtype=q.dtype, shape=(T, None, D), device=q.device)
    check_rows("k", k)
    check_tensor("positions", positions, dtype=INDEX_DTYPES, shape=(T,), device=q.device, contiguous=True)
    check_tensor("inv_freq", inv_freq, dtype=torch.float32, shape=(D // 2,), device=q.device, contiguous=True)
    apply_rotary_op.run(q, k, positions, inv_freq)


# --------------------------------------------------------------------------------------------
# PyTorch reference
# --------------------------------------------------------------------------------------------


def apply_rotary_reference(q, k, positions, inv_freq) -> tuple[torch.Tensor, torch.Tensor]:
    """Readable PyTorch RoPE: the rotated ``(q, k)`` as new tensors (HuggingFace's composite)."""
    angles = positions.float()[:, None] * inv_freq[None, :]  # [T, D/2]
    angles = torch.cat((angles, angles), dim=-1)  # [T, D]: cos/sin of both halves of each pair
    cos, sin = angles.cos().to(q.dtype)[:, None, :], angles.sin().to(q.dtype)[:, None, :]

    def rotate(x):
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

    return rotate(q), rotate(k)
