"""Sampling from given weights by the keyed exponential race (``uniforms``), and the race pieces
every sampling op uses to turn one key into one token.

The race: with non-negative weights ``w`` and the key's clocks ``E_i`` (independent Exp(1)), the
token is ``argmax_i w_i / E_i`` among the entries with ``w_i > 0``, the lowest index on ties; it
has probability ``w_i / sum(w)``. Over vocabulary tiles it folds block by block: each block's
best score and its first column (``race_block_tl``), kept by a later block only when strictly
higher, so the lowest index wins a tie on every path. An entry with no weight scores -1 and
never wins; a row without positive weight draws -1.

``sample_probs`` is this sampler on probability rows the caller holds (a draft strategy's
``q``), so the draft token is drawn exactly from the row it hands to verification; with the
counter ``ROLE_TARGET`` its clocks are the target's at that position (a coupled draft).
"""

from __future__ import annotations

import torch

from specdec.kernels._checks import check_tensor
from specdec.kernels._op import register_op
from specdec.kernels._triton import INT32_MAX, cdiv, jit, next_power_of_2, tl
from specdec.kernels.sampling_params import SamplingParams, check_params
from specdec.kernels.top_k_top_p import FLOAT_DTYPES, row_load_tl, vocab_block
from specdec.kernels.tuning import TuningSpace, candidates, launch
from specdec.kernels.uniforms import race_clock_tl, race_clocks, race_key_tl

# ----------------------------------------------------------------------------- Triton


@jit
def race_block_tl(w, cols, e, best, arg):
    """Fold a block of weights ``w`` at columns ``cols`` (1-D, in the layout they were loaded in) with clocks ``e``
    (``race_clock_tl``) into the running race (best score, its column): the block's best replaces it only when
    strictly higher, so of equal scores the first folded (the lowest column, blocks folded in column order) stays."""
    score = tl.where(w > 0, tl.math.div_rn(w, e), -1.0)  # no weight: never wins
    top = tl.max(score, 0)
    at = tl.min(tl.where(score == top, cols, INT32_MAX), 0)
    take = top > best
    return tl.where(take, top, best), tl.where(take, at, arg)


@jit
def probs_tile_tl(row_ptr, start, V, BLOCK: tl.constexpr):
    """(cols, w) on one tile of a probability row: negative, NaN and infinite entries (and columns
    past V) count as 0."""
    cols = start + tl.arange(0, BLOCK)
    w = row_load_tl(row_ptr, cols, start + BLOCK <= V, V).to(tl.float32)
    return cols, tl.where((cols < V) & (w >= 0) & (w < float("inf")), w, 0.0)


@jit
def _race_tile_kernel(
    probs_ptr,  # [R, V] fp32/fp16/bf16, unit column stride
    seed_ptr,  # [R] int64
    offset_ptr,  # [R] int64
    counter_ptr,  # [R] int64
    score_ptr,  # [R, n_tiles] fp32 out: the tile's best w / E (-1: no weight)
    arg_ptr,  # [R, n_tiles] int32 out: its first column (-1: no weight)
    V,
    n_tiles,
    stride_row,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    tile = tl.program_id(1)
    key = race_key_tl(tl.load(seed_ptr + row), tl.load(offset_ptr + row), tl.load(counter_ptr + row))
    cols, w = probs_tile_tl(probs_ptr + row.to(tl.int64) * stride_row, tile * BLOCK, V, BLOCK)
    best, arg = race_block_tl(w, cols, race_clock_tl(key, cols), -1.0, -1)
    out = row.to(tl.int64) * n_tiles + tile
    tl.store(score_ptr + out, best)
    tl.store(arg_ptr + out, arg)


@jit
def _race_pick_kernel(
    score_ptr,  # [R, n_tiles] fp32 from _race_tile_kernel
    arg_ptr,  # [R, n_tiles] int32 from _race_tile_kernel
    out_ptr,  # [R] int32 out
    n_tiles,
    T_PAD: tl.constexpr,
):
    row = tl.program_id(0)
    t_idx = tl.arange(0, T_PAD)
    at = row.to(tl.int64) * n_tiles + tl.minimum(t_idx, n_tiles - 1)  # clamped: lanes past n_tiles stay in the row
    score = tl.where(t_idx < n_tiles, tl.load(score_ptr + at), -1.0)
    top = tl.max(score, 0)
    # tiles hold ascending columns: the lowest column among the best tiles is the lowest index overall
    arg = tl.min(tl.where((t_idx < n_tiles) & (score == top), tl.load(arg_ptr + at), INT32_MAX), 0)
    tl.store(out_ptr + row, tl.where(top >= 0, arg, -1))


# The two kernels share the tile (one writes per-tile winners, the other reads them): warps only.
RACE_TILE_SPACE = TuningSpace(candidates(num_warps=(2, 4, 8)), key=("V",))
RACE_PICK_SPACE = TuningSpace(candidates(num_warps=(2, 4, 8)), key=("n_tiles",))


def _sample_probs_triton(probs, seed, offset, counter, out) -> None:
    rows, vocab = probs.shape
    if rows == 0:
        return
    if probs.stride(-1) != 1:
        probs = probs.contiguous()
    block = vocab_block(vocab)
    n_tiles = cdiv(vocab, block)
    score = torch.empty(rows, n_tiles, dtype=torch.float32, device=probs.device)
    arg = torch.empty(rows, n_tiles, dtype=torch.int32, device=probs.device)
    tile_args = (probs, seed, offset, counter, score, arg, vocab, n_tiles, probs.stride(0))
    launch(_race_tile_kernel, (rows, n_tiles), tile_args, dict(BLOCK=block), dict(num_warps=4), RACE_TILE_SPACE)
    pick_meta = dict(T_PAD=next_power_of_2(n_tiles))
    launch(_race_pick_kernel, (rows,), (score, arg, out, n_tiles), pick_meta, dict(num_warps=4), RACE_PICK_SPACE)


def _sample_probs_torch(probs, seed, offset, counter, out) -> None:
    w = sanitize_probs(probs)
    out.copy_(race_reference(w, race_clocks(seed, offset, counter, w.shape[-1])))


# ----------------------------------------------------------------------------- registered op


@register_op("sample_probs", mutates_args=("out",), triton=_sample_probs_triton, torch=_sample_probs_torch)
def _sample_probs_op(
    probs: torch.Tensor, seed: torch.Tensor, offset: torch.Tensor, counter: torch.Tensor, out: torch.Tensor
) -> None:
    """Schema: probs ``[R, V]``; int64 ``[R]`` seed, offset, counter; writes int32 ``[R]`` out."""


# ----------------------------------------------------------------------------- public function


def sample_probs(
    probs: torch.Tensor,
    params: SamplingParams,
    *,
    counter: torch.Tensor | int,
    out: torch.Tensor | None = None,
    check: bool = True,
) -> torch.Tensor:
    """Draw one token per row from the given probabilities, by the exponential race on ``race_clocks``.

    Parameters
    ----------
    probs : fp32/fp16/bf16 ``[R, V]``; row r's (unnormalised) weights. Negative, NaN and infinite
        entries count as 0; rows need not sum to 1 (weights so large that ``w / E`` overflows, above
        about 1e31, tie at +inf and the lowest index among them wins).
    params : ``SamplingParams`` with one entry per row; only ``seed`` and ``offset`` are read (the
        distribution is given: temperature, top-k and top-p were applied by whoever built it).
    counter : int, or int32/int64 ``[R]``; row r draws ``argmax_i w_i / E_i`` with the clocks
        ``race_clocks(seed[r], offset[r], counter[r], V)``. With ``ROLE_TARGET`` and a request's seed and
        a position, these are the clocks of the target's own draw there (a coupled draft).
    out : optional int32 ``[R]`` contiguous buffer to write into.
    check : False skips every argument check, ``out``'s included (``specdec.kernels``): a ``counter``
        tensor must then be int64 and contiguous.

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
    if check:
        check_tensor("probs", probs, dtype=FLOAT_DTYPES, ndim=2)
        rows, device = probs.shape[0], probs.device
        if probs.shape[1] < 1:
            raise ValueError(f"probs must have at least one column, got shape {tuple(probs.shape)}")
        check_params(params, rows, device)
        if isinstance(counter, int) and not isinstance(counter, bool):
            counter = torch.full((rows,), counter, dtype=torch.int64, device=device)
        check_tensor("counter", counter, dtype=(torch.int32, torch.int64), shape=(rows,), device=device)
        counter = counter.to(torch.int64).contiguous()
        if out is None:
            out = torch.empty(rows, dtype=torch.int32, device=device)
        check_tensor("out", out, dtype=torch.int32, shape=(rows,), device=device, contiguous=True)
    else:
        rows, device = probs.shape[0], probs.device
        if isinstance(counter, int):
            counter = torch.full((rows,), counter, device=device)  # (a Python int fills int64)
        if out is None:
            out = torch.empty(rows, dtype=torch.int32, device=device)
    _sample_probs_op.run(probs, params.seed, params.offset, counter, out)
    return out


# ----------------------------------------------------------------------------- PyTorch reference


def sanitize_probs(probs: torch.Tensor) -> torch.Tensor:
    """fp32 weights as the samplers use them: negative, NaN and infinite entries become 0."""
    probs = probs.float()
    return torch.where((probs >= 0) & (probs < float("inf")), probs, 0.0)


def race_reference(weights: torch.Tensor, clocks: torch.Tensor) -> torch.Tensor:
    """int64 ``[R]``: per row of ``weights [R, V]`` (non-negative), ``argmax_i w_i / E_i`` over its positive
    entries with ``clocks [R, V]`` the E_i (the lowest index on ties, as ``torch.argmax``); -1 if none."""
    score = torch.where(weights > 0, weights / clocks, -1.0)
    top, arg = score.max(-1)
    return torch.where(top >= 0, arg, -1)


def sample_probs_reference(probs: torch.Tensor, params: SamplingParams, *, counter: torch.Tensor | int) -> torch.Tensor:
    """Readable PyTorch implementation of ``sample_probs`` (int32 ``[R]``)."""
    w = sanitize_probs(probs)
    return race_reference(w, race_clocks(params.seed, params.offset, counter, w.shape[-1])).to(torch.int32)
