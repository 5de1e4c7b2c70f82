"""The filtered target distribution as per-tile statistics, which every sampling op combines
instead of holding a whole row.

For each row r and vocabulary tile t (``vocab_block`` columns), ``_row_stats_kernel`` writes

    max[r, t]  the largest s in the tile, NaN read as -inf (+inf counts as largest)
    sum[r, t]  sum of exp(s - max[r, t]) over the tile's kept entries (finite, s >= thr)
    arg[r, t]  the first column holding max[r, t]
    bad[r, t]  the number of NaN and +inf entries

``row_argmax_tl`` merges a row's tiles into (m, argmax, bad): the row maximum, its first
column (NaN read as -inf; column 0 when nothing is finite) and whether the row cannot be
sampled (any NaN or +inf, or no finite value). ``row_normaliser_tl`` adds
``Z = sum exp(s - m)`` over kept entries, and ``target_tile_tl`` / ``target_prob_tl`` evaluate
``p = exp(s - m) / Z`` on a tile or at one column. In a row that can be sampled the maximum
is always kept (no filter removes it), so a tile without kept entries adds 0 to Z whatever
its own maximum.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from specdec.kernels._triton import INT32_MAX, cdiv, jit, tl
from specdec.kernels.top_k_top_p import bad_rows, row_load_tl, scaled_tile_tl
from specdec.kernels.tuning import TuningSpace, candidates, launch

# ----------------------------------------------------------------------------- Triton


@jit
def _row_stats_kernel(
    logits_ptr,  # [R, V] fp32/fp16/bf16, unit column stride
    inv_row_ptr,  # [R] fp32 scale 1/T of the row (1 for greedy rows); unread with ARGMAX_ONLY
    thr_ptr,  # [R] fp32 filter threshold on s; unread with ARGMAX_ONLY
    max_ptr,  # [R, n_tiles] fp32 out
    sum_ptr,  # [R, n_tiles] fp32 out (not written with ARGMAX_ONLY)
    arg_ptr,  # [R, n_tiles] int32 out
    bad_ptr,  # [R, n_tiles] int32 out
    V,
    n_tiles,
    stride_row,
    ARGMAX_ONLY: tl.constexpr,  # raw logits, no filter, no exponentials (greedy verification)
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    tile = tl.program_id(1)
    if ARGMAX_ONLY:
        inv_t = 1.0
    else:
        inv_t = tl.load(inv_row_ptr + row)
    cols, inb, s = scaled_tile_tl(logits_ptr + row.to(tl.int64) * stride_row, tile * BLOCK, V, inv_t, BLOCK)
    bad = (s != s) | (s == float("inf"))
    clean = tl.where(s != s, float("-inf"), s)
    m = tl.max(clean, 0)
    out = row.to(tl.int64) * n_tiles + tile
    tl.store(max_ptr + out, m)
    tl.store(arg_ptr + out, tl.min(tl.where(inb & (clean == m), cols, INT32_MAX), 0))
    tl.store(bad_ptr + out, tl.sum(bad.to(tl.int32), 0))
    if not ARGMAX_ONLY:
        kept = (s >= tl.load(thr_ptr + row)) & (s > float("-inf")) & ~bad
        m_safe = tl.where(m > float("-inf"), m, 0.0)  # an all -inf tile: no (-inf) - (-inf)
        tl.store(sum_ptr + out, tl.sum(tl.where(kept, tl.exp(s - m_safe), 0.0), 0))


@jit
def row_argmax_tl(max_ptr, arg_ptr, bad_ptr, row, n_tiles, T_PAD: tl.constexpr):
    """(m, argmax, bad) of row ``row`` from its tile statistics."""
    c = tl.arange(0, T_PAD)
    ok = c < n_tiles
    at = row.to(tl.int64) * n_tiles + tl.minimum(c, n_tiles - 1)  # clamped: lanes past n_tiles stay in the row
    mc = tl.where(ok, tl.load(max_ptr + at), float("-inf"))
    m = tl.max(mc, 0)
    arg = tl.min(tl.where(ok & (mc == m), tl.load(arg_ptr + at), INT32_MAX), 0)
    bad = (tl.sum(tl.where(ok, tl.load(bad_ptr + at), 0), 0) > 0) | (m == float("-inf"))
    return m, arg, bad


@jit
def any_row_bad_tl(max_ptr, arg_ptr, bad_ptr, start, n, n_tiles, T_PAD: tl.constexpr):
    """Whether any of rows start .. start+n-1 cannot be sampled (no rows at all counts as invalid)."""
    invalid = n < 1
    for j in range(0, n):
        _m, _arg, bad = row_argmax_tl(max_ptr, arg_ptr, bad_ptr, start + j, n_tiles, T_PAD)
        invalid = invalid | bad
    return invalid


@jit
def row_normaliser_tl(max_ptr, sum_ptr, row, m, n_tiles, T_PAD: tl.constexpr):
    """Z = sum exp(s - m) over the kept entries of row ``row`` (m from ``row_argmax_tl``)."""
    c = tl.arange(0, T_PAD)
    at = row.to(tl.int64) * n_tiles + tl.minimum(c, n_tiles - 1)
    sc = tl.where(c < n_tiles, tl.load(sum_ptr + at), 0.0)
    return tl.sum(tl.where(sc > 0, sc * tl.exp(tl.load(max_ptr + at) - m), 0.0), 0)


@jit
def target_values_tl(logits, cols, V, inv_t, thr, m, z):
    """p from a row's raw ``logits`` at columns ``cols`` (loaded by the caller): exp(s - m) / z with s = l * inv_t
    on the kept entries (finite, s >= thr), 0 elsewhere and past V."""
    s = tl.where(cols < V, logits.to(tl.float32) * inv_t, float("-inf"))
    return tl.where((s >= thr) & (s > float("-inf")), tl.exp(s - m) / z, 0.0)


@jit
def target_tile_tl(row_ptr, start, V, inv_t, thr, m, z, BLOCK: tl.constexpr):
    """(cols, p) on the tile of ``row_ptr`` starting at column ``start``; p = 0 off the kept set and past V."""
    cols = start + tl.arange(0, BLOCK)
    return cols, target_values_tl(row_load_tl(row_ptr, cols, start + BLOCK <= V, V), cols, V, inv_t, thr, m, z)


@jit
def target_prob_tl(row_ptr, col, inv_t, thr, m, z):
    """p at one column ``col`` (which must lie in the row)."""
    s = tl.load(row_ptr + col).to(tl.float32) * inv_t
    return tl.where((s >= thr) & (s > float("-inf")), tl.exp(s - m) / z, 0.0)


# ----------------------------------------------------------------------------- launcher


# The vocabulary tile is shared with every later stage (they read per-tile results): warps only.
ROW_STATS_SPACE = TuningSpace(candidates(num_warps=(4, 8)), key=("V", "ARGMAX_ONLY"))  # 2 spills (sm_90, 3.6)


class TileStats(NamedTuple):
    """Per-tile statistics of every row, each ``[R, n_tiles]``: max fp32, sum fp32, arg int32, bad int32."""

    max: torch.Tensor
    sum: torch.Tensor
    arg: torch.Tensor
    bad: torch.Tensor


def row_stats_triton(logits, inv_row, thr, block: int, argmax_only: bool = False, out: TileStats | None = None
                     ) -> TileStats:  # fmt: skip
    """Tile statistics of ``logits [R, V]`` (unit column stride) scaled by ``inv_row [R]`` and filtered
    by ``thr [R]``; ``argmax_only``: raw logits (``inv_row`` / ``thr`` unread, ``sum`` not written).
    Written into ``out`` (contiguous ``[R, n_tiles]`` each) when given. Triton launcher, no checks."""
    rows, vocab = logits.shape
    n_tiles = cdiv(vocab, block)
    stats = out or TileStats(
        torch.empty(rows, n_tiles, dtype=torch.float32, device=logits.device),
        torch.empty(rows, n_tiles, dtype=torch.float32, device=logits.device),
        torch.empty(rows, n_tiles, dtype=torch.int32, device=logits.device),
        torch.empty(rows, n_tiles, dtype=torch.int32, device=logits.device),
    )
    if rows:
        unread = stats.max  # any fp32 tensor stands in for inv_row / thr when they are not read
        args = (logits, unread if argmax_only else inv_row, unread if argmax_only else thr, *stats, vocab, n_tiles,
                logits.stride(0))  # fmt: skip
        meta = _stats_meta(argmax_only, block)
        launch(_row_stats_kernel, (rows, n_tiles), args, meta, _STATS_CONFIG, ROW_STATS_SPACE)
    return stats


_STATS_CONFIG = dict(num_warps=4)  # (constants: launches read them, never change them)


@functools.cache
def _stats_meta(argmax_only: bool, block: int) -> dict:
    return dict(ARGMAX_ONLY=argmax_only, BLOCK=block)


# ----------------------------------------------------------------------------- PyTorch reference


def target_probs_reference(s: torch.Tensor, thr: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(p fp32 ``[R, V]``, argmax int64 ``[R]``, bad bool ``[R]``) from scaled logits ``s`` and thresholds.

    ``p = exp(s - max) / Z`` on kept entries (finite, ``s >= thr``), 0 elsewhere and on bad rows;
    argmax is the first maximum with NaN read as -inf.
    """
    bad = bad_rows(s)
    clean = torch.where(torch.isnan(s), float("-inf"), s)
    m = clean.max(-1, keepdim=True).values
    kept = (s >= thr[:, None]) & (s > float("-inf")) & ~bad[:, None]
    e = torch.where(kept, torch.exp(clean - torch.where(bad[:, None], 0.0, m)), 0.0)
    z = e.sum(-1, keepdim=True)
    p = e / torch.where(z > 0, z, 1.0)
    return p, clean.argmax(-1), bad
