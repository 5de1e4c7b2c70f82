"""The final token of a verification: one draw from the distribution where the walk stopped
(``tree_walk`` derives which one), by the two-level inverse CDF of ``sample_probs``.

The distribution is never written out: ``_final_tile`` recomputes any tile of it from the
logits, the tile statistics and, for a residual, the draft row -- p itself, max(0, p - C q),
or p without the rejected children, as the walk's ``FINAL_*`` mode says. ``_final_mass_kernel``
(requests x tiles) sums every tile of it and of p; ``_final_sample_kernel`` (one program per
request) draws ``u = counter_uniform(seed, offset, 2 * node + 1)``, picks the tile whose running
mass passes ``u * total`` and then the token inside it. A residual whose summed mass is below
``RESIDUAL_EPS`` (p == q up to rounding) falls back to p. The draft row is read only for a
residual, i.e. only after a rejection, so a request whose drafts were all accepted (or that
drafted nothing) never touches ``draft_probs``.
"""

from __future__ import annotations

import torch

from specdec.kernels._triton import jit, next_power_of_2, tl
from specdec.kernels.sample_probs import pick_in_tile_tl, pick_tile_tl
from specdec.kernels.target_stats import row_argmax_tl, row_normaliser_tl, target_tile_tl
from specdec.kernels.tree_walk import (
    FINAL_DONE,
    FINAL_EXCLUDED,
    FINAL_RESIDUAL,
    FINAL_TARGET,
    RESIDUAL_EPS,
    residual_tile_tl,
)
from specdec.kernels.tuning import TuningSpace, candidates, launch
from specdec.kernels.uniforms import counter_uniform_tl


@jit
def _rejected_children(cols, tokens_ptr, parents_ptr, b, row, cur, n, CHAIN: tl.constexpr):
    # Columns holding a child of node cur (deterministic rule, FINAL_EXCLUDED: all were rejected).
    if CHAIN:  # its one child is draft offsets[b] + cur = row - b
        hit = cols == tl.load(tokens_ptr + row - b)
    else:
        start = row - cur
        hit = cols < 0
        for i in range(cur + 1, n):
            if tl.load(parents_ptr + start + i) == cur:
                hit = hit | (cols == tl.load(tokens_ptr + start + i))
    return hit


@jit
def _final_tile(
    logits_ptr, tokens_ptr, parents_ptr, q_ptr, thr_ptr, inv_row_ptr, max_ptr, sum_ptr, arg_ptr, bad_ptr,
    fin_i_ptr, fin_f_ptr, b, mode, start_col, V, n_tiles, stride_l, stride_q,
    RULE: tl.constexpr, CHAIN: tl.constexpr, BLOCK: tl.constexpr, T_PAD: tl.constexpr,
):  # fmt: skip
    # (cols, p, w) on the tile at start_col of request b's final node: the target p and the mass w
    # the token is drawn from under `mode`.
    row = tl.load(fin_i_ptr + 4 * b).to(tl.int64)
    m, _argmax, _bad = row_argmax_tl(max_ptr, arg_ptr, bad_ptr, row, n_tiles, T_PAD)
    z = row_normaliser_tl(max_ptr, sum_ptr, row, m, n_tiles, T_PAD)
    inv_t = tl.load(inv_row_ptr + row)
    cols, p = target_tile_tl(logits_ptr + row * stride_l, start_col, V, inv_t, tl.load(thr_ptr + row), m, z, BLOCK)
    w = p
    if RULE == "stochastic":
        if mode == FINAL_RESIDUAL:  # the draft row of the final node's children: after a rejection, it exists
            q_row = q_ptr + (row - b if CHAIN else row) * stride_q
            w = residual_tile_tl(p, q_row, cols, V, tl.load(fin_f_ptr + 2 * b))
    else:
        if mode == FINAL_EXCLUDED:
            cur, n = tl.load(fin_i_ptr + 4 * b + 2), tl.load(fin_i_ptr + 4 * b + 3)
            w = tl.where(_rejected_children(cols, tokens_ptr, parents_ptr, b, row, cur, n, CHAIN), 0.0, p)
    return cols, p, w


@jit
def _final_mass_kernel(
    logits_ptr, tokens_ptr, parents_ptr, q_ptr, thr_ptr, inv_row_ptr, max_ptr, sum_ptr, arg_ptr, bad_ptr,
    fin_i_ptr,  # [B, 4] int32 from the walk: final row, mode, final node, node count
    fin_f_ptr,  # [B, 2] fp32 from the walk: C, mass
    mass_ptr,  # [B, n_tiles] fp32 out: mass w of the final distribution per tile
    p_ptr,  # [B, n_tiles] fp32 out: mass of p per tile (the fallback when a residual is ~0)
    V, n_tiles, stride_l, stride_q,
    RULE: tl.constexpr, CHAIN: tl.constexpr, BLOCK: tl.constexpr, T_PAD: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    tile = tl.program_id(1)
    mode = tl.load(fin_i_ptr + 4 * b + 1)
    if mode != FINAL_DONE:
        _cols, p, w = _final_tile(
            logits_ptr, tokens_ptr, parents_ptr, q_ptr, thr_ptr, inv_row_ptr, max_ptr, sum_ptr, arg_ptr, bad_ptr,
            fin_i_ptr, fin_f_ptr, b, mode, tile * BLOCK, V, n_tiles, stride_l, stride_q, RULE, CHAIN, BLOCK, T_PAD,
        )  # fmt: skip
        at = b.to(tl.int64) * n_tiles + tile
        tl.store(mass_ptr + at, tl.sum(w, 0))
        tl.store(p_ptr + at, tl.sum(p, 0))


@jit
def _final_sample_kernel(
    logits_ptr, tokens_ptr, parents_ptr, q_ptr, thr_ptr, inv_row_ptr, max_ptr, sum_ptr, arg_ptr, bad_ptr,
    fin_i_ptr, fin_f_ptr, mass_ptr, p_ptr,
    seed_ptr,  # [B] int64
    offset_ptr,  # [B] int64
    out_tok_ptr,  # [B, W] int32: the drawn token goes after the accepted ones
    num_acc_ptr,  # [B] int32 from the walk
    V, n_tiles, stride_l, stride_q, stride_tok,
    RULE: tl.constexpr, CHAIN: tl.constexpr, BLOCK: tl.constexpr, T_PAD: tl.constexpr, EPS: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    mode = tl.load(fin_i_ptr + 4 * b + 1)
    if mode != FINAL_DONE:
        t_idx = tl.arange(0, T_PAD)
        at = b.to(tl.int64) * n_tiles + tl.minimum(t_idx, n_tiles - 1)  # clamped: lanes past n_tiles stay in
        w_tiles = tl.where(t_idx < n_tiles, tl.load(mass_ptr + at), 0.0)
        p_tiles = tl.where(t_idx < n_tiles, tl.load(p_ptr + at), 0.0)
        total = tl.load(fin_f_ptr + 2 * b + 1)
        total = tl.where(mode == FINAL_RESIDUAL, tl.sum(w_tiles, 0), total)
        use_p = total <= EPS  # a residual of rounding noise (p == q): draw from p
        w_tiles = tl.where(use_p, p_tiles, w_tiles)
        total = tl.where(use_p, 1.0, total)
        mode = tl.where(use_p, FINAL_TARGET, mode)
        node = tl.load(fin_i_ptr + 4 * b + 2)
        target = counter_uniform_tl(tl.load(seed_ptr + b), tl.load(offset_ptr + b), 2 * node + 1) * total
        tile, before = pick_tile_tl(w_tiles, t_idx, target)
        cols, _p, w = _final_tile(
            logits_ptr, tokens_ptr, parents_ptr, q_ptr, thr_ptr, inv_row_ptr, max_ptr, sum_ptr, arg_ptr, bad_ptr,
            fin_i_ptr, fin_f_ptr, b, mode, tile * BLOCK, V, n_tiles, stride_l, stride_q, RULE, CHAIN, BLOCK, T_PAD,
        )  # fmt: skip
        token = pick_in_tile_tl(w, cols, before, target)
        tl.store(out_tok_ptr + b.to(tl.int64) * stride_tok + tl.load(num_acc_ptr + b), token)


# The vocabulary tile is the statistics' own (shared by every stage): warps only.
FINAL_MASS_SPACE = TuningSpace(candidates(num_warps=(8, 2)), key=("V", "RULE", "CHAIN"))  # 4 spills (sm_80, 3.6)
FINAL_SAMPLE_SPACE = TuningSpace(candidates(num_warps=(2, 4, 8)), key=("V", "RULE", "CHAIN"))


def final_sample_triton(logits, tokens, parents, q, thr, inv_row, stats, params, fin_i, fin_f, out_tok, num_acc, *,
                        rule: str, chain: bool, block: int, mass=None) -> None:  # fmt: skip
    """Draw every request's final token after ``tree_walk_triton`` (the walk's hand-off ``fin_i`` /
    ``fin_f``) into ``out_tok [B, W]`` at column ``num_acc [B]``; ``mass`` = two fp32 ``[B, n_tiles]``
    scratch tensors (else fresh). Triton launcher, no checks."""
    batch, n_tiles = fin_i.shape[0], stats.max.shape[1]
    _temperature, _top_k, _top_p, seed, offset = params
    if mass is None:
        mass = (torch.empty(batch, n_tiles, dtype=torch.float32, device=logits.device),
                torch.empty(batch, n_tiles, dtype=torch.float32, device=logits.device))  # fmt: skip
    w_mass, p_mass = mass
    common = (logits, tokens, parents, q, thr, inv_row, *stats, fin_i, fin_f)
    meta = dict(RULE=rule, CHAIN=chain, BLOCK=block, T_PAD=next_power_of_2(n_tiles))
    vocab = logits.shape[1]
    mass_args = (*common, w_mass, p_mass, vocab, n_tiles, logits.stride(0), q.stride(0))
    launch(_final_mass_kernel, (batch, n_tiles), mass_args, meta, dict(num_warps=8), FINAL_MASS_SPACE)
    sample_args = (*common, w_mass, p_mass, seed, offset, out_tok, num_acc, vocab, n_tiles, logits.stride(0),
                   q.stride(0), out_tok.stride(0))  # fmt: skip
    sample_meta = dict(meta, EPS=RESIDUAL_EPS)
    launch(_final_sample_kernel, (batch,), sample_args, sample_meta, dict(num_warps=4), FINAL_SAMPLE_SPACE)
