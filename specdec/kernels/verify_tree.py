"""Token-tree verification: acceptance tests, residual resampling and the bonus token, fused.

Math (design.md, "The math that must hold exactly"). At a node with target
distribution p (after temperature / top-k / top-p, see ``sampling``) the children
c_1, c_2, ... are tried in index order.

* Stochastic rule (children drawn i.i.d. from the node's draft row q): accept c_j
  with probability min(1, p_j(c_j) / q(c_j)); on rejection
  p_{j+1} = norm(max(0, p_j - q)). With q >= 0 the nested residuals collapse to
  ``p_j = max(0, p - C_j q) / S_j``, where S_j is that numerator's mass and
  ``C_{j+1} = C_j + S_j`` (C_0 = 0, S_0 = 1): two scalars per node; S costs a pass
  over the row only when another sibling follows a rejection (never in a chain).
* Deterministic rule (no draft rows; q one-hot at each child): accept c_j with
  probability p(c_j) / (1 - X_j), X_j the target mass of the distinct rejected
  siblings; those are excluded from the final sample.
* Greedy (temperature <= 0): follow the first child equal to argmax p; else emit it.

When every child is rejected (or there are none) one token is sampled from the
node's current distribution by inverse CDF over vocabulary tiles, and the walk
stops. The acceptance test of node j uses ``u = counter_uniform(seed, offset, 2j)``,
the final sample at node j uses counter ``2j + 1``; u lies in [0, 1) and the tests
are ``u * q * S < max(0, p - C q)`` and ``u * (1 - X) < p``, so p = 0 is never
accepted and p >= q always is.

Kernels (no host synchronisation; the vocabulary is always split into tiles):
``sampling._filter_threshold_kernel`` (one program per row, only filtered rows work) finds
the top-k/top-p threshold; ``sampling._row_stats_kernel`` (rows x tiles) reduces each tile
of each row to (max, sum exp, argmax, bad count); ``_tree_walk_kernel`` (one program per request)
combines a row's tiles, walks the tree with scalar loads and writes the accepted path and
greedy tokens; it streams a row only to find S before trying another sibling after a
stochastic rejection. ``_final_mass_kernel`` (requests x tiles) sums the final
distribution per tile, and ``_final_sample_kernel`` (one program per request) picks the tile
whose running mass passes ``u * total`` and then the token inside it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from specdec import _backend
from specdec.kernels._checks import check_offsets, check_tensor
from specdec.kernels._triton import jit, tl, triton
from specdec.kernels.sampling import (
    combine_row_tl,
    counter_uniform_tl,
    filter_thresholds_reference,
    filter_thresholds_triton,
    inverse_cdf_reference,
    request_key,
    row_stats_triton,
    sanitize_draft_probs,
    scaled_logits,
    target_probs_reference,
    tile_mass_tl,
    uniform_from_key,
)

RESIDUAL_EPS = 1e-5  # a residual with less mass is rounding noise: sample from p instead
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class TreeVerifyResult(NamedTuple):
    output_tokens: torch.Tensor
    num_accepted: torch.Tensor
    accepted_path: torch.Tensor
    invalid: torch.Tensor


# ----------------------------------------------------------------------------- Triton kernels


@jit
def _tree_walk_kernel(
    logits_ptr,  # [R, V] target logits, one row per node
    tokens_ptr,  # [R] int32 node tokens (root's ignored); CHAIN: [T] draft tokens
    parents_ptr,  # [R] int32 local parents, -1 at each root (unused with CHAIN: parent = node - 1)
    offsets_ptr,  # [B+1] int32 node offsets; CHAIN: draft offsets (node offsets are offsets[b] + b)
    q_ptr,  # [Q, V] draft probabilities (unused without HAS_Q)
    q_row_ptr,  # [R] int32 draft row of each node's children (unused without HAS_Q; CHAIN: offsets[b] + node)
    thr_ptr,  # [R] fp32 filter thresholds
    max_ptr,  # [R, n_tiles] tile partials from sampling.row_stats_triton
    sum_ptr,
    arg_ptr,
    bad_ptr,
    temp_ptr,  # [B] fp32
    seed_ptr,  # [B] int64
    offset_ptr,  # [B] int64
    out_tok_ptr,  # [B, W] int32 out: accepted tokens, then the sampled one, -1 padded
    out_path_ptr,  # [B, W] int32 out: local nodes root(0), accepted..., -1 padded
    num_acc_ptr,  # [B] int32 out
    invalid_ptr,  # [B] bool out
    fin_i_ptr,  # [B, 4] int32 out: final node's row, mode (0 done, 1 sample, 2 sample excluding children), node, n
    fin_f_ptr,  # [B, 2] fp32 out: C and the mass of the final distribution (-1: sum the tiles)
    V,
    n_tiles,
    W,
    stride_l,
    stride_q,
    stride_tok,
    stride_path,
    HAS_Q: tl.constexpr,
    CHAIN: tl.constexpr,
    BLOCK: tl.constexpr,
    T_PAD: tl.constexpr,
    W_PAD: tl.constexpr,
    EPS: tl.constexpr,
):
    b = tl.program_id(0)
    if CHAIN:  # the chain's tree view, computed here: node j > 0 is draft offsets[b] + j - 1
        tok_base = tl.load(offsets_ptr + b) - 1
        start = tok_base + 1 + b
        n = tl.load(offsets_ptr + b + 1) - tok_base
    else:
        start = tl.load(offsets_ptr + b)
        n = tl.load(offsets_ptr + b + 1) - start
        tok_base = start
    t = tl.load(temp_ptr + b)
    greedy = t <= 0
    inv_t = tl.where(greedy, 1.0, tl.math.div_rn(1.0, tl.where(greedy, 1.0, t)))  # as torch rounds 1/T
    t = inv_t * 0.0  # an fp32 zero for loop-carried scalars
    seed = tl.load(seed_ptr + b)
    off = tl.load(offset_ptr + b)

    # ---- a request with any row that cannot be sampled emits nothing
    invalid = n < 1
    c = tl.arange(0, T_PAD)
    for j in range(0, n):  # (inline: nested jit calls are slow in the interpreter)
        part = (start + j).to(tl.int64) * n_tiles + c
        mc = tl.load(max_ptr + part, mask=c < n_tiles, other=float("-inf"))
        bc = tl.load(bad_ptr + part, mask=c < n_tiles, other=0)
        invalid = invalid | (tl.sum(bc, 0) > 0) | (tl.max(mc, 0) == float("-inf"))
    n_walk = tl.where(invalid, 1, n)

    # ---- walk: children come after their parent, so one ascending scan visits them in order
    lanes = tl.arange(0, W_PAD)
    toks = tl.full([W_PAD], -1, tl.int32)
    path = tl.where(lanes == 0, 0, toks)
    depth = n * 0
    cur = n * 0
    c_res = t  # stochastic: C and S of p_j = max(0, p - C q) / S
    s_res = 1.0 + t
    pending = n < 0  # S not yet computed for the current C (needed only if another sibling is tried)
    x_rej = t  # deterministic: target mass of distinct rejected siblings
    m, z, am, _bad = combine_row_tl(max_ptr, sum_ptr, arg_ptr, bad_ptr, start, n_tiles, T_PAD)
    for j in range(1, n_walk):
        if CHAIN:
            par = j - 1
        else:
            par = tl.load(parents_ptr + start + j)
        if (par == cur) & (depth < W - 1):
            row = (start + cur).to(tl.int64)
            tok = tl.load(tokens_ptr + tok_base + j)
            valid = (tok >= 0) & (tok < V)
            safe = tl.where(valid, tok, 0)  # never index with an out-of-range id
            s = tl.load(logits_ptr + row * stride_l + safe).to(tl.float32) * inv_t
            px = tl.where(valid & (s >= tl.load(thr_ptr + row)) & (s > float("-inf")), tl.exp(s - m) / z, 0.0)
            u = counter_uniform_tl(seed, off, off * 0 + 2 * j)
            dup = j < 0
            if HAS_Q:
                if CHAIN:
                    q_row = (tok_base + 1 + cur).to(tl.int64)
                else:
                    q_row = tl.load(q_row_ptr + row).to(tl.int64)
                if pending & ~greedy:
                    # one pass over the row: S = mass of max(0, p - C q) after earlier rejections
                    thr = tl.load(thr_ptr + row)
                    acc = tl.zeros([BLOCK], dtype=tl.float32)
                    for v0 in range(0, V, BLOCK):
                        cols = v0 + tl.arange(0, BLOCK)
                        _p, mass = tile_mass_tl(
                            logits_ptr + row * stride_l,
                            q_ptr + q_row * stride_q,
                            cols,
                            V,
                            inv_t,
                            thr,
                            m,
                            z,
                            c_res,
                            True,
                        )
                        acc += mass
                    s_res = tl.sum(acc, 0)
                    reset = s_res <= EPS  # p == q up to rounding: back to p
                    c_res = tl.where(reset, 0.0, c_res)
                    s_res = tl.where(reset, 1.0, s_res)
                    pending = n < 0
                qx = tl.load(q_ptr + q_row * stride_q + safe).to(tl.float32)
                qc = tl.where((qx >= 0) & (qx < float("inf")), qx, 0.0)
                res = tl.maximum(px - c_res * qc, 0.0)
                accept = valid & (qx > 0) & (qx <= 1) & (res > 0) & (u * qx * s_res < res)
            else:
                if not CHAIN:  # (a chain node has one child: no siblings)
                    for i in range(cur + 1, j):  # a token equal to a rejected sibling has p = 0 now
                        same = (tl.load(parents_ptr + start + i) == cur) & (tl.load(tokens_ptr + start + i) == tok)
                        dup = dup | same
                px = tl.where(dup, 0.0, px)
                accept = (px > 0) & (u * (1.0 - x_rej) < px)
            accept = tl.where(greedy, valid & (tok == am), accept)
            if accept:
                toks = tl.where(lanes == depth, tok, toks)
                depth += 1
                path = tl.where(lanes == depth, j, path)
                cur = j + n * 0
                c_res = t
                s_res = 1.0 + t
                x_rej = t
                m, z, am, _bad = combine_row_tl(max_ptr, sum_ptr, arg_ptr, bad_ptr, start + j, n_tiles, T_PAD)
                pending = n < 0
            elif not greedy:
                if HAS_Q:
                    c_res = c_res + s_res  # p_next = max(0, p - C q) / S; S is summed when needed
                    pending = n >= 0
                else:
                    x_rej = x_rej + px

    # ---- greedy requests are done; the others hand their final sample to the tile kernels
    if not invalid:
        if greedy:
            toks = tl.where(lanes == depth, am, toks)
    if HAS_Q:
        total = tl.where(pending, -1.0, 1.0)  # -1: the residual's mass is summed over the tiles
        mode = tl.where(invalid | greedy, 0, 1)
    else:
        total = 1.0 - x_rej
        exclude = (x_rej > 0) & (total > EPS)  # else the rejected mass is rounding noise: sample p
        total = tl.where(exclude, total, 1.0)
        mode = tl.where(invalid | greedy, 0, tl.where(exclude, 2, 1))
    tl.store(fin_i_ptr + 4 * b, start + cur)
    tl.store(fin_i_ptr + 4 * b + 1, mode)
    tl.store(fin_i_ptr + 4 * b + 2, cur)
    tl.store(fin_i_ptr + 4 * b + 3, n)
    tl.store(fin_f_ptr + 2 * b, c_res)
    tl.store(fin_f_ptr + 2 * b + 1, total)

    # ---- write back
    keep = lanes < W
    tl.store(out_tok_ptr + b.to(tl.int64) * stride_tok + lanes, toks, mask=keep)
    tl.store(out_path_ptr + b.to(tl.int64) * stride_path + lanes, path, mask=keep)
    tl.store(num_acc_ptr + b, depth)
    tl.store(invalid_ptr + b, invalid)


@jit
def _final_tile(
    logits_ptr, tokens_ptr, parents_ptr, q_ptr, q_row_ptr, thr_ptr, max_ptr, sum_ptr, arg_ptr, bad_ptr,
    b, row, cur, n, mode, c, inv_t, cols, V, n_tiles, stride_l, stride_q,
    HAS_Q: tl.constexpr, CHAIN: tl.constexpr, T_PAD: tl.constexpr,
):  # fmt: skip
    # (p, mass) of the final distribution on one tile, rejected children excluded in mode 2.
    m, z, _a, _b = combine_row_tl(max_ptr, sum_ptr, arg_ptr, bad_ptr, row, n_tiles, T_PAD)
    start = row - cur  # the request's first node
    q_row = row * 0
    if HAS_Q:
        if CHAIN:
            q_row = row - b  # node cur's child is draft offsets[b] + cur = row - b
        else:
            q_row = tl.load(q_row_ptr + row).to(tl.int64)
    p, mass = tile_mass_tl(
        logits_ptr + row * stride_l, q_ptr + q_row * stride_q, cols, V, inv_t, tl.load(thr_ptr + row), m, z, c, HAS_Q
    )
    if mode == 2:  # deterministic rule: every child of this node was rejected
        if CHAIN:  # its one child, node cur + 1, is draft offsets[b] + cur = row - b
            mass = tl.where(cols == tl.load(tokens_ptr + row - b), 0.0, mass)
        else:
            for i in range(cur + 1, n):
                if tl.load(parents_ptr + start + i) == cur:
                    mass = tl.where(cols == tl.load(tokens_ptr + start + i), 0.0, mass)
    return p, mass


@jit
def _final_mass_kernel(
    logits_ptr, tokens_ptr, parents_ptr, offsets_ptr, q_ptr, q_row_ptr, thr_ptr,
    max_ptr, sum_ptr, arg_ptr, bad_ptr, temp_ptr,
    fin_i_ptr,  # [B, 4] int32 from the walk
    fin_f_ptr,  # [B, 2] fp32 from the walk
    mass_ptr,  # [B, n_tiles] fp32 out: mass of the final distribution per tile
    p_ptr,  # [B, n_tiles] fp32 out: mass of p per tile (the fallback when the residual is ~0)
    V, n_tiles, stride_l, stride_q,
    HAS_Q: tl.constexpr, CHAIN: tl.constexpr, BLOCK: tl.constexpr, T_PAD: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    tile = tl.program_id(1)
    mode = tl.load(fin_i_ptr + 4 * b + 1)
    if mode > 0:
        row = tl.load(fin_i_ptr + 4 * b).to(tl.int64)
        cols = tile * BLOCK + tl.arange(0, BLOCK)
        inv_t = tl.math.div_rn(1.0, tl.load(temp_ptr + b))  # mode > 0: a sampled request, T > 0
        p, mass = _final_tile(
            logits_ptr, tokens_ptr, parents_ptr, q_ptr, q_row_ptr, thr_ptr, max_ptr, sum_ptr, arg_ptr, bad_ptr,
            b, row, tl.load(fin_i_ptr + 4 * b + 2), tl.load(fin_i_ptr + 4 * b + 3), mode,
            tl.load(fin_f_ptr + 2 * b), inv_t, cols, V, n_tiles, stride_l, stride_q, HAS_Q, CHAIN, T_PAD,
        )  # fmt: skip
        out = b.to(tl.int64) * n_tiles + tile
        tl.store(mass_ptr + out, tl.sum(mass, 0))
        tl.store(p_ptr + out, tl.sum(p, 0))


@jit
def _final_sample_kernel(
    logits_ptr, tokens_ptr, parents_ptr, offsets_ptr, q_ptr, q_row_ptr, thr_ptr,
    max_ptr, sum_ptr, arg_ptr, bad_ptr, temp_ptr, seed_ptr, offset_ptr,
    fin_i_ptr, fin_f_ptr, mass_ptr, p_ptr,
    out_tok_ptr,  # [B, W] int32: the sampled token goes after the accepted ones
    num_acc_ptr,  # [B] int32
    V, n_tiles, stride_l, stride_q, stride_tok,
    HAS_Q: tl.constexpr, CHAIN: tl.constexpr, BLOCK: tl.constexpr, T_PAD: tl.constexpr, EPS: tl.constexpr,
):  # fmt: skip
    # Inverse CDF in two levels: the tile whose running mass passes u * total, then the entry in it.
    b = tl.program_id(0)
    mode = tl.load(fin_i_ptr + 4 * b + 1)
    if mode > 0:
        row = tl.load(fin_i_ptr + 4 * b).to(tl.int64)
        cur = tl.load(fin_i_ptr + 4 * b + 2)
        c = tl.load(fin_f_ptr + 2 * b)
        total = tl.load(fin_f_ptr + 2 * b + 1)
        t_idx = tl.arange(0, T_PAD)
        ok = t_idx < n_tiles
        res_tiles = tl.load(mass_ptr + b.to(tl.int64) * n_tiles + t_idx, mask=ok, other=0.0)
        p_tiles = tl.load(p_ptr + b.to(tl.int64) * n_tiles + t_idx, mask=ok, other=0.0)
        total = tl.where(total < 0, tl.sum(res_tiles, 0), total)
        use_p = total <= EPS  # residual mass zero (p == q up to rounding): sample from p
        tiles = tl.where(use_p, p_tiles, res_tiles)
        total = tl.where(use_p, 1.0, total)
        c = tl.where(use_p, 0.0, c)
        mode = tl.where(use_p, 1, mode)
        target = counter_uniform_tl(tl.load(seed_ptr + b), tl.load(offset_ptr + b), 2 * cur + 1) * total
        cum = tl.cumsum(tiles, 0)
        first = tl.min(tl.where((cum > target) & (tiles > 0), t_idx, 2147483647), 0)
        tile = tl.where(first < 2147483647, first, tl.max(tl.where(tiles > 0, t_idx, 0), 0))
        run = tl.sum(tl.where(t_idx == tile, cum - tiles, 0.0), 0)
        cols = tile * BLOCK + tl.arange(0, BLOCK)
        p, mass = _final_tile(
            logits_ptr, tokens_ptr, parents_ptr, q_ptr, q_row_ptr, thr_ptr, max_ptr, sum_ptr, arg_ptr, bad_ptr,
            b, row, cur, tl.load(fin_i_ptr + 4 * b + 3), mode,
            c, tl.math.div_rn(1.0, tl.load(temp_ptr + b)), cols, V, n_tiles, stride_l, stride_q, HAS_Q, CHAIN, T_PAD,
        )  # fmt: skip
        hit = ((run + tl.cumsum(mass, 0)) > target) & (mass > 0)
        found = tl.min(tl.where(hit, cols, 2147483647), 0)
        token = tl.where(found < 2147483647, found, tl.max(tl.where(mass > 0, cols, -1), 0))
        tl.store(out_tok_ptr + b.to(tl.int64) * stride_tok + tl.load(num_acc_ptr + b), token)


# ----------------------------------------------------------------------------- launcher


def _pick_block(vocab: int) -> int:
    # About four tiles for small vocabularies (so tile edges are exercised), 1024 for large ones.
    return max(16, min(1024, triton.next_power_of_2(max(vocab, 1)) // 4))


def verify_tree_triton(
    logits, tokens, parents, offsets, draft_probs, q_rows, temperature, top_k, top_p, seed, offset, width, out,
    chain=False,
):  # fmt: skip
    """Launch filter, tile statistics, walk and the two-level final sample.

    ``out`` = (tokens, path, num_accepted, invalid) buffers, written in place. With ``chain``,
    ``tokens`` and ``offsets`` are a chain batch's draft tokens and draft offsets, and the
    kernels derive the tree view themselves (``parents`` and ``q_rows`` are not read).
    """
    rows, vocab = logits.shape
    batch = offsets.numel() - 1
    device = logits.device
    block = _pick_block(vocab)
    n_tiles = triton.cdiv(vocab, block)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    thr, inv_row = filter_thresholds_triton(logits, offsets, temperature, top_k, top_p, block, chain)
    part_max, part_sum, part_arg, part_bad = row_stats_triton(logits, inv_row, thr, block)
    out_tok, out_path, num_acc, invalid = out
    has_q = draft_probs is not None
    q = draft_probs if has_q else logits
    if has_q and q.stride(-1) != 1:
        q = q.contiguous()
    q_rows = q_rows if has_q else tokens
    t_pad = triton.next_power_of_2(n_tiles)
    fin_i = torch.empty(batch, 4, dtype=torch.int32, device=device)
    fin_f = torch.empty(batch, 2, dtype=torch.float32, device=device)
    tile_mass = torch.empty(batch, n_tiles, dtype=torch.float32, device=device)
    tile_p = torch.empty_like(tile_mass)
    if batch:
        _tree_walk_kernel[(batch,)](
            logits, tokens, parents, offsets, q, q_rows, thr,
            part_max, part_sum, part_arg, part_bad, temperature, seed, offset,
            out_tok, out_path, num_acc, invalid, fin_i, fin_f,
            vocab, n_tiles, width, logits.stride(0), q.stride(0), out_tok.stride(0), out_path.stride(0),
            HAS_Q=has_q, CHAIN=chain, BLOCK=block, T_PAD=t_pad, W_PAD=triton.next_power_of_2(width),
            EPS=RESIDUAL_EPS,
        )  # fmt: skip
        common = (logits, tokens, parents, offsets, q, q_rows, thr, part_max, part_sum, part_arg, part_bad, temperature)
        _final_mass_kernel[(batch, n_tiles)](
            *common, fin_i, fin_f, tile_mass, tile_p, vocab, n_tiles, logits.stride(0), q.stride(0),
            HAS_Q=has_q, CHAIN=chain, BLOCK=block, T_PAD=t_pad,
        )  # fmt: skip
        _final_sample_kernel[(batch,)](
            *common, seed, offset, fin_i, fin_f, tile_mass, tile_p, out_tok, num_acc,
            vocab, n_tiles, logits.stride(0), q.stride(0), out_tok.stride(0),
            HAS_Q=has_q, CHAIN=chain, BLOCK=block, T_PAD=t_pad, EPS=RESIDUAL_EPS,
        )  # fmt: skip
    return out


@torch.library.custom_op("specdec::verify_tree", mutates_args=("out_tokens", "out_path", "num_accepted", "invalid"))
def _verify_tree_op(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    parents: torch.Tensor,
    offsets: torch.Tensor,
    draft_probs: torch.Tensor | None,
    q_rows: torch.Tensor | None,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seed: torch.Tensor,
    offset: torch.Tensor,
    width: int,
    chain: bool,
    out_tokens: torch.Tensor,
    out_path: torch.Tensor,
    num_accepted: torch.Tensor,
    invalid: torch.Tensor,
) -> None:
    """The Triton path as torch.compile and CUDA graphs see it: writes the four outputs in place."""
    verify_tree_triton(
        logits, tokens, parents, offsets, draft_probs, q_rows, temperature, top_k, top_p, seed, offset, width,
        (out_tokens, out_path, num_accepted, invalid), chain,
    )  # fmt: skip


@_verify_tree_op.register_fake
def _(
    logits, tokens, parents, offsets, draft_probs, q_rows, temperature, top_k, top_p, seed, offset, width, chain, *outs
):
    return None


# ----------------------------------------------------------------------------- public op


def verify_tree(
    target_logits: torch.Tensor,
    node_tokens: torch.Tensor,
    parents: torch.Tensor,
    node_offsets: torch.Tensor,
    draft_probs: torch.Tensor | None,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seed: torch.Tensor,
    offset: torch.Tensor,
    *,
    max_depth: int | None = None,
    out: TreeVerifyResult | None = None,
) -> TreeVerifyResult:
    """Verify a batch of draft token trees against the target and emit the accepted path plus one token.

    Parameters
    ----------
    target_logits : fp32/fp16/bf16 ``[N, V]``; row i is the target's prediction after node i
        (it scores node i's children; for a node without children it gives the bonus token).
    node_tokens : int32 ``[N]``; each node's draft token (the root's is ignored).
    parents : int32 ``[N]``; local parent index, -1 for each tree's root (node 0), parents
        before children (as in ``build_tree_metadata``). Children are tried in index order.
    node_offsets : int32 ``[B+1]``; tree b owns nodes ``node_offsets[b] .. node_offsets[b+1]-1``.
    draft_probs : float ``[N, V]`` or None. Row i is the distribution node i's children were
        drawn from, i.i.d. (stochastic rule, SpecInfer). None selects the deterministic rule
        (children chosen without sampling, e.g. top-k of a draft head).
    temperature : fp32 ``[B]``; 0 (or below) = greedy: follow the child equal to argmax, no softmax.
    top_k : int32 ``[B]``; 0 = off. top_p : fp32 ``[B]``; 1 = off. Applied to the target only.
    seed, offset : int64 ``[B]``; every uniform is ``counter_uniform(seed, offset, counter)``
        (counter 2j for the test of node j, 2j+1 for the sample at node j). Advance ``offset``
        each step; the same seed gives the same tokens alone, in any batch, in any row order.
    max_depth : host int, the output width minus one. Passing it avoids reading the trees
        back to the host (one synchronisation); nodes deeper than it are ignored (the tree is
        truncated, which keeps the output exact). On CUDA with it given, offsets and parents
        are trusted (not read back); CPU inputs are always checked.
    out : optional TreeVerifyResult of tensors to write into (shapes and dtypes as returned).

    Returns
    -------
    TreeVerifyResult(output_tokens int32 ``[B, max_depth+1]``: accepted tokens then the sampled
    one, -1 padded; num_accepted int32 ``[B]`` (emitted = accepted + 1); accepted_path int32
    ``[B, max_depth+1]``: local node indices root 0, accepted nodes..., -1 padded, length
    num_accepted + 1 (what the KV compaction consumes); invalid bool ``[B]``).

    Edge cases (specified)
    ----------------------
    * A request with any row holding NaN or +inf, or no finite logit, is flagged ``invalid``:
      tokens all -1, num_accepted 0, path ``[0, -1, ...]``. Never an out-of-range id.
    * A child token outside ``[0, V)`` (e.g. -1) is rejected and never used as an index.
    * p(x) = 0 (including a token removed by top-k/top-p) is never accepted; q(x) = 0, NaN,
      inf or > 1 is never accepted. In the residual, negative or non-finite q count as 0.
    * A residual whose mass is below ``RESIDUAL_EPS`` (p == q up to rounding) is replaced by p.
    * Deterministic rule: a child equal to an already rejected sibling has p = 0 (rejected).
    * Vocabulary tiles need not divide V: lanes >= V carry no mass and are never returned.

    Example
    -------
    >>> logits = torch.randn(3, 10)                       # root and two children, V = 10
    >>> r = verify_tree(logits, torch.tensor([0, 4, 7], dtype=torch.int32),
    ...                 torch.tensor([-1, 0, 0], dtype=torch.int32), torch.tensor([0, 3], dtype=torch.int32),
    ...                 None, torch.ones(1), torch.zeros(1, dtype=torch.int32), torch.ones(1),
    ...                 torch.tensor([7]), torch.tensor([0]), max_depth=1)
    >>> r.output_tokens.shape, int(r.num_accepted[0]) in (0, 1)
    (torch.Size([1, 2]), True)
    """
    device = _check_common(
        target_logits, "node_offsets", node_offsets, draft_probs, temperature, top_k, top_p, seed, offset
    )
    n, vocab = target_logits.shape
    check_tensor("node_tokens", node_tokens, dtype=torch.int32, shape=(n,), device=device)
    check_tensor("parents", parents, dtype=torch.int32, shape=(n,), device=device)
    if draft_probs is not None:
        _check_draft_rows("draft_probs", draft_probs, n, vocab)
    if max_depth is None or device.type == "cpu":
        depth = _tree_depth(parents, check_offsets("node_offsets", node_offsets, total=n))
        if max_depth is None:
            max_depth = depth
    if not isinstance(max_depth, int) or max_depth < 0:
        raise ValueError(f"max_depth must be a non-negative int, got {max_depth!r}")
    batch = node_offsets.numel() - 1
    out = _check_out(out, batch, max_depth + 1, device)
    if _backend.select_backend(target_logits) == "triton":
        _verify_tree_op(
            target_logits, node_tokens.contiguous(), parents.contiguous(), node_offsets.contiguous(), draft_probs,
            None if draft_probs is None else torch.arange(n, dtype=torch.int32, device=device),
            temperature, top_k, top_p, seed, offset, max_depth + 1, False, *out,
        )  # fmt: skip
        return TreeVerifyResult(out[0], out[2], out[1], out[3])
    ref = verify_tree_reference(
        target_logits, node_tokens, parents, node_offsets, draft_probs, temperature, top_k, top_p, seed, offset,
        max_depth=max_depth,
    )  # fmt: skip
    for dst, src in zip((out[0], out[2], out[1], out[3]), ref):
        dst.copy_(src)
    return TreeVerifyResult(out[0], out[2], out[1], out[3])


def _check_common(target_logits, name, offsets, draft_probs, temperature, top_k, top_p, seed, offset) -> torch.device:
    check_tensor("target_logits", target_logits, dtype=_FLOAT_DTYPES, ndim=2)
    device = target_logits.device
    if target_logits.shape[1] < 1:
        raise ValueError(f"target_logits must have a vocabulary of at least 1, got shape {tuple(target_logits.shape)}")
    check_tensor(name, offsets, dtype=torch.int32, ndim=1, device=device)
    if offsets.numel() < 1:
        raise ValueError(f"{name} must hold B+1 >= 1 entries, got none")
    batch = offsets.numel() - 1
    if draft_probs is not None:
        check_tensor("draft_probs", draft_probs, dtype=_FLOAT_DTYPES, ndim=2, device=device)
    check_tensor("temperature", temperature, dtype=torch.float32, shape=(batch,), device=device)
    check_tensor("top_k", top_k, dtype=torch.int32, shape=(batch,), device=device)
    check_tensor("top_p", top_p, dtype=torch.float32, shape=(batch,), device=device)
    check_tensor("seed", seed, dtype=torch.int64, shape=(batch,), device=device)
    check_tensor("offset", offset, dtype=torch.int64, shape=(batch,), device=device)
    return device


def _check_draft_rows(name: str, draft_probs: torch.Tensor, rows: int, vocab: int) -> None:
    if draft_probs.shape[1] != vocab:
        raise ValueError(
            f"{name} has vocabulary {draft_probs.shape[1]} but target_logits has {vocab}: "
            "draft and target must share one vocabulary"
        )
    if draft_probs.shape[0] != rows:
        raise ValueError(f"{name} must have {rows} rows, got shape {tuple(draft_probs.shape)}")


def _check_out(out, batch: int, width: int, device: torch.device):
    """(tokens, path, num_accepted, invalid) buffers: the caller's, checked, or fresh ones."""
    if out is None:
        return (
            torch.empty(batch, width, dtype=torch.int32, device=device),
            torch.empty(batch, width, dtype=torch.int32, device=device),
            torch.empty(batch, dtype=torch.int32, device=device),
            torch.empty(batch, dtype=torch.bool, device=device),
        )
    tokens, num_acc, path, invalid = out
    check_tensor("out.output_tokens", tokens, dtype=torch.int32, shape=(batch, width), device=device)
    check_tensor("out.num_accepted", num_acc, dtype=torch.int32, shape=(batch,), device=device, contiguous=True)
    check_tensor("out.invalid", invalid, dtype=torch.bool, shape=(batch,), device=device, contiguous=True)
    if path is None:  # chains have no path output of their own
        path = torch.empty(batch, width, dtype=torch.int32, device=device)
    check_tensor("out.accepted_path", path, dtype=torch.int32, shape=(batch, width), device=device)
    for name, t in (("out.output_tokens", tokens), ("out.accepted_path", path)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have unit stride in its last dimension")
    return tokens, path, num_acc, invalid


def _tree_depth(parents: torch.Tensor, bounds: list[int]) -> int:
    """Deepest node over the batch (host loop; validates the parent arrays)."""
    host = parents.cpu().tolist()
    deepest = 0
    for b in range(len(bounds) - 1):
        start, end = bounds[b], bounds[b + 1]
        if end == start:
            raise ValueError(f"node_offsets give tree {b} no nodes; every tree needs at least its root")
        if host[start] != -1:
            raise ValueError(f"parents[{start}] (root of tree {b}) must be -1, got {host[start]}")
        depth = [0] * (end - start)
        for i in range(1, end - start):
            p = host[start + i]
            if not 0 <= p < i:
                raise ValueError(f"parents[{start + i}] = {p} in tree {b} must lie in [0, {i}) (parents come first)")
            depth[i] = depth[p] + 1
        deepest = max(deepest, max(depth))
    return deepest


# ----------------------------------------------------------------------------- PyTorch reference


def verify_tree_reference(
    target_logits, node_tokens, parents, node_offsets, draft_probs, temperature, top_k, top_p, seed, offset,
    *, max_depth: int, q_rows: torch.Tensor | None = None,
) -> TreeVerifyResult:  # fmt: skip
    """Readable PyTorch implementation of ``verify_tree`` (same contract), vectorised over requests.

    ``q_rows [N]`` maps a node to the ``draft_probs`` row its children were drawn from
    (default: its own row); ``verify_chain`` uses it to share this engine.
    """
    bounds = check_offsets("node_offsets", node_offsets, total=target_logits.shape[0])
    device = target_logits.device
    rows, vocab = target_logits.shape
    batch, width = len(bounds) - 1, max_depth + 1
    starts = torch.tensor(bounds[:-1], device=device)
    sizes = torch.tensor(bounds[1:], device=device) - starts
    row_req = torch.repeat_interleave(torch.arange(batch, device=device), sizes)
    temp_rows = temperature[row_req]
    s = scaled_logits(target_logits, temp_rows)
    thr = filter_thresholds_reference(s, temp_rows, top_k[row_req], top_p[row_req])
    p, argmax, bad = target_probs_reference(s, thr)
    invalid = torch.zeros(batch, dtype=torch.long, device=device).scatter_reduce(0, row_req, bad.long(), "amax") > 0
    greedy = temperature <= 0
    key = request_key(seed, offset)
    has_q = draft_probs is not None
    if has_q:
        q_clean = sanitize_draft_probs(draft_probs)
        q_rows = torch.arange(rows, device=device) if q_rows is None else q_rows.long()
    else:
        excluded = torch.zeros(batch, vocab, dtype=torch.bool, device=device)  # rejected siblings
    every = torch.arange(batch, device=device)
    cur = torch.zeros(batch, dtype=torch.long, device=device)
    depth = torch.zeros_like(cur)
    c_res = torch.zeros(batch, device=device)  # p_j = max(0, p - C q) / S  (stochastic rule)
    s_res = torch.ones(batch, device=device)
    x_rej = torch.zeros(batch, device=device)  # mass of rejected siblings (deterministic rule)
    tokens = torch.full((batch, width), -1, dtype=torch.long, device=device)
    path = torch.full((batch, width), -1, dtype=torch.long, device=device)
    path[:, 0] = 0
    active = ~invalid
    for j in range(1, max(sizes.tolist(), default=1)):
        exists = j < sizes
        node = torch.where(exists, starts + j, 0)
        is_child = active & exists & (parents[node].long() == cur) & (depth < width - 1)
        if not bool(is_child.any()):
            continue
        row = starts + cur
        tok = node_tokens[node].long()
        valid = (tok >= 0) & (tok < vocab)
        safe = torch.where(valid, tok, 0)
        px = torch.where(valid, p[row, safe], 0.0)
        u = uniform_from_key(key, 2 * j)
        if has_q:
            qx = draft_probs[q_rows[row], safe].float()
            res = (px - c_res * q_clean[q_rows[row], safe]).clamp_min(0.0)
            accept = valid & (qx > 0) & (qx <= 1) & (res > 0) & (u * qx * s_res < res)
        else:
            px = torch.where(excluded[every, safe] & valid, 0.0, px)
            accept = (px > 0) & (u * (1.0 - x_rej) < px)
        accept = torch.where(greedy, valid & (tok == argmax[row]), accept)
        took, rejected = is_child & accept, is_child & ~accept & ~greedy
        tokens[took, depth[took]] = tok[took]
        depth = depth + took.long()
        path[took, depth[took]] = j
        cur = torch.where(took, j, cur)
        c_res, s_res, x_rej = (torch.where(took, fresh, v) for fresh, v in ((0.0, c_res), (1.0, s_res), (0.0, x_rej)))
        if has_q:
            c_next = c_res + s_res
            s_next = (p[row] - c_next[:, None] * q_clean[q_rows[row]]).clamp_min(0.0).sum(-1)
            reset = s_next <= RESIDUAL_EPS
            c_res = torch.where(rejected, torch.where(reset, 0.0, c_next), c_res)
            s_res = torch.where(rejected, torch.where(reset, 1.0, s_next), s_res)
        else:
            excluded[took] = False
            x_rej = torch.where(rejected, x_rej + px, x_rej)
            excluded[every[rejected & valid], safe[rejected & valid]] = True
    # final token where each walk stopped
    row = starts + cur
    u = uniform_from_key(key, 2 * cur + 1)
    if has_q:
        mass = (p[row] - c_res[:, None] * q_clean[q_rows[row]]).clamp_min(0.0)
        total = s_res
    else:
        total = 1.0 - x_rej
        exclude = (x_rej > 0) & (total > RESIDUAL_EPS)
        mass = torch.where(excluded & exclude[:, None], 0.0, p[row])
        total = torch.where(exclude, total, 1.0)
    final = torch.where(greedy, argmax[row], inverse_cdf_reference(mass, u * total))
    tokens[every, depth] = final
    tokens[invalid] = -1
    path[invalid, 1:] = -1
    num_accepted = torch.where(invalid, 0, depth)
    return TreeVerifyResult(tokens.to(torch.int32), num_accepted.to(torch.int32), path.to(torch.int32), invalid)
