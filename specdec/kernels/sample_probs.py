"""Sampling from given probabilities by a two-level inverse CDF; the pieces every sampling op
uses to turn one uniform into one token.

Inverse CDF: with unnormalised non-negative mass ``w`` and ``u`` uniform in [0, 1), the token
is the first index whose running sum of ``w`` exceeds ``u * sum(w)``; it has probability
``w_i / sum(w)``. Over vocabulary tiles this takes two levels: the tile whose running tile
mass passes the target (``pick_tile_tl``), then the column inside it (``pick_in_tile_tl``).
Only entries with positive mass can be picked; when rounding leaves a running sum short of
the target, the last positive entry is taken, so no id past the vocabulary ever comes out.

``sample_probs`` is this sampler on probability rows the caller holds (a draft strategy's
``q``), so the draft token is drawn exactly from the row it hands to verification.
"""

from __future__ import annotations

import torch

from specdec.kernels._checks import check_tensor
from specdec.kernels._op import register_op
from specdec.kernels._triton import INT32_MAX, cdiv, jit, next_power_of_2, tl
from specdec.kernels.sampling_params import SamplingParams, check_params
from specdec.kernels.top_k_top_p import FLOAT_DTYPES, vocab_block
from specdec.kernels.tuning import TuningSpace, candidates, launch
from specdec.kernels.uniforms import counter_uniform_reference, counter_uniform_tl

# ----------------------------------------------------------------------------- Triton


@jit
def pick_tile_tl(tile_mass, t_idx, target):
    """Level 1: (tile, mass of the tiles before it) for the first tile, among tiles with mass, whose
    running mass exceeds ``target``; the last tile with mass when rounding leaves the total short."""
    cum = tl.cumsum(tile_mass, 0)
    first = tl.min(tl.where((cum > target) & (tile_mass > 0), t_idx, INT32_MAX), 0)
    tile = tl.where(first < INT32_MAX, first, tl.max(tl.where(tile_mass > 0, t_idx, 0), 0))
    return tile, tl.sum(tl.where(t_idx == tile, cum - tile_mass, 0.0), 0)


@jit
def pick_in_tile_tl(mass, cols, before, target):
    """Level 2: the first column, among those with mass, whose running mass (``before`` + the tile's
    own) exceeds ``target``; else the tile's last column with mass; -1 when the tile has none."""
    hit = ((before + tl.cumsum(mass, 0)) > target) & (mass > 0)
    found = tl.min(tl.where(hit, cols, INT32_MAX), 0)
    return tl.where(found < INT32_MAX, found, tl.max(tl.where(mass > 0, cols, -1), 0))


@jit
def probs_tile_tl(row_ptr, start, V, BLOCK: tl.constexpr):
    """(cols, w) on one tile of a probability row: negative, NaN and infinite entries (and columns
    past V) count as 0."""
    cols = start + tl.arange(0, BLOCK)
    w = tl.load(row_ptr + tl.minimum(cols, V - 1)).to(tl.float32)  # clamped: no lane leaves the row
    return cols, tl.where((cols < V) & (w >= 0) & (w < float("inf")), w, 0.0)


@jit
def _tile_mass_kernel(
    probs_ptr,  # [R, V] fp32/fp16/bf16, unit column stride
    mass_ptr,  # [R, n_tiles] fp32 out: sum of w per tile
    V,
    n_tiles,
    stride_row,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    tile = tl.program_id(1)
    _cols, w = probs_tile_tl(probs_ptr + row * stride_row, tile * BLOCK, V, BLOCK)
    tl.store(mass_ptr + row * n_tiles + tile, tl.sum(w, 0))


@jit
def _pick_token_kernel(
    probs_ptr,  # [R, V]
    mass_ptr,  # [R, n_tiles] fp32 from _tile_mass_kernel
    seed_ptr,  # [R] int64
    offset_ptr,  # [R] int64
    counter_ptr,  # [R] int64
    out_ptr,  # [R] int32 out
    V,
    n_tiles,
    stride_row,
    BLOCK: tl.constexpr,
    T_PAD: tl.constexpr,
):
    row = tl.program_id(0)
    t_idx = tl.arange(0, T_PAD)
    at = row.to(tl.int64) * n_tiles + tl.minimum(t_idx, n_tiles - 1)
    tiles = tl.where(t_idx < n_tiles, tl.load(mass_ptr + at), 0.0)
    u = counter_uniform_tl(tl.load(seed_ptr + row), tl.load(offset_ptr + row), tl.load(counter_ptr + row))
    target = u * tl.sum(tiles, 0)
    tile, before = pick_tile_tl(tiles, t_idx, target)
    cols, w = probs_tile_tl(probs_ptr + row.to(tl.int64) * stride_row, tile * BLOCK, V, BLOCK)
    tl.store(out_ptr + row, pick_in_tile_tl(w, cols, before, target))


# The two kernels share the tile (one writes per-tile mass, the other reads it): warps only.
TILE_MASS_SPACE = TuningSpace(candidates(num_warps=(2, 4, 8)), key=("V",))
PICK_TOKEN_SPACE = TuningSpace(candidates(num_warps=(2, 4, 8)), key=("V",))


def _sample_probs_triton(probs, seed, offset, counter, out) -> None:
    rows, vocab = probs.shape
    if rows == 0:
        return
    if probs.stride(-1) != 1:
        probs = probs.contiguous()
    block = vocab_block(vocab)
    n_tiles = cdiv(vocab, block)
    mass = torch.empty(rows, n_tiles, dtype=torch.float32, device=probs.device)
    mass_args = (probs, mass, vocab, n_tiles, probs.stride(0))
    launch(_tile_mass_kernel, (rows, n_tiles), mass_args, dict(BLOCK=block), dict(num_warps=4), TILE_MASS_SPACE)
    pick_args = (probs, mass, seed, offset, counter, out, vocab, n_tiles, probs.stride(0))
    pick_meta = dict(BLOCK=block, T_PAD=next_power_of_2(n_tiles))
    launch(_pick_token_kernel, (rows,), pick_args, pick_meta, dict(num_warps=4), PICK_TOKEN_SPACE)


def _sample_probs_torch(probs, seed, offset, counter, out) -> None:
    w = sanitize_probs(probs)
    out.copy_(inverse_cdf_reference(w, counter_uniform_reference(seed, offset, counter) * w.sum(-1)))


# ----------------------------------------------------------------------------- registered op


@register_op("sample_probs", mutates_args=("out",), triton=_sample_probs_triton, torch=_sample_probs_torch)
def _sample_probs_op(
    probs: torch.Tensor, seed: torch.Tensor, offset: torch.Tensor, counter: torch.Tensor, out: torch.Tensor
) -> None:
    """Schema: probs ``[R, V]``; int64 ``[R]`` seed, offset, counter; writes int32 ``[R]`` out."""


# ----------------------------------------------------------------------------- public function


def sample_probs(
    probs: torch.Tensor, params: SamplingParams, *, counter: torch.Tensor | int, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Draw one token per row from the given probabilities, by inverse CDF on ``counter_uniform``.

    Parameters
    ----------
    probs : fp32/fp16/bf16 ``[R, V]``; row r's (unnormalised) weights. Negative, NaN and infinite
        entries count as 0; rows need not sum to 1 (the target is ``u * sum``).
    params : ``SamplingParams`` with one entry per row; only ``seed`` and ``offset`` are read (the
        distribution is given: temperature, top-k and top-p were applied by whoever built it).
    counter : int, or int32/int64 ``[R]``; row r uses ``u = counter_uniform(seed[r], offset[r], counter[r])``.
    out : optional int32 ``[R]`` contiguous buffer to write into.

    Returns
    -------
    int32 ``[R]``: the sampled column of each row; -1 for a row without positive mass.

    Example
    -------
    >>> probs = torch.tensor([[0.0, 1.0, 0.0], [0.5, 0.0, 0.5]])
    >>> tokens = sample_probs(probs, SamplingParams.make(2, seed=[3, 4]), counter=0)
    >>> int(tokens[0]), int(tokens[1]) in (0, 2)
    (1, True)
    """
    check_tensor("probs", probs, dtype=FLOAT_DTYPES, ndim=2)
    rows, device = probs.shape[0], probs.device
    if probs.shape[1] < 1:
        raise ValueError(f"probs must have at least one column, got shape {tuple(probs.shape)}")
    check_params(params, rows, device)
    if isinstance(counter, int) and not isinstance(counter, bool):
        counter = torch.full((rows,), counter, dtype=torch.int64, device=device)
    check_tensor("counter", counter, dtype=(torch.int32, torch.int64), shape=(rows,), device=device)
    if out is None:
        out = torch.empty(rows, dtype=torch.int32, device=device)
    check_tensor("out", out, dtype=torch.int32, shape=(rows,), device=device, contiguous=True)
    _sample_probs_op.run(probs, params.seed, params.offset, counter.to(torch.int64).contiguous(), out)
    return out


def run_sample_probs(probs: torch.Tensor, params: SamplingParams, *, counter: int) -> torch.Tensor:
    """``sample_probs`` without its argument checks or the dispatcher, for one host ``counter`` shared by every
    row: the hot path of a strategy that made ``probs [R, V]`` and ``params`` (``[R]``, same device) itself."""
    rows, device = probs.shape[0], probs.device
    out = torch.empty(rows, dtype=torch.int32, device=device)
    _sample_probs_op.run(probs, params.seed, params.offset, torch.full((rows,), counter, device=device), out)
    return out


# ----------------------------------------------------------------------------- PyTorch reference


def sanitize_probs(probs: torch.Tensor) -> torch.Tensor:
    """fp32 weights as the samplers use them: negative, NaN and infinite entries become 0."""
    probs = probs.float()
    return torch.where((probs >= 0) & (probs < float("inf")), probs, 0.0)


def inverse_cdf_reference(mass: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """int64 ``[R]``: per row of ``mass [R, V]``, the first index, among positive entries, whose running
    sum exceeds ``target [R]``; the last positive entry when rounding leaves the sum short; -1 if none."""
    positive = mass > 0
    hit = (mass.cumsum(-1) > target[:, None]) & positive
    idx = torch.arange(mass.shape[-1], device=mass.device)
    first = torch.where(hit, idx, mass.shape[-1]).min(-1).values
    last = torch.where(positive, idx, -1).max(-1).values
    return torch.where(first < mass.shape[-1], first, last)


def sample_probs_reference(probs: torch.Tensor, params: SamplingParams, *, counter: torch.Tensor | int) -> torch.Tensor:
    """Readable PyTorch implementation of ``sample_probs`` (int32 ``[R]``)."""
    w = sanitize_probs(probs)
    u = counter_uniform_reference(params.seed, params.offset, counter)
    return inverse_cdf_reference(w, u * w.sum(-1)).to(torch.int32)
