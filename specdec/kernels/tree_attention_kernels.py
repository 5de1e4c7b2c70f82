"""Tree attention on the GPU: the Triton kernels and their launcher (tile choice: ``tree_attention_tiles``).

The math and the op's contract are in ``specdec.kernels.tree_attention``. Here, each
program owns a tile of BLOCK_Q query tokens of one request times the G query heads
that share one KV head (BLOCK_M = BLOCK_Q * G <= 256 rows), so a KV tile is read once
per (request, KV head, query tile): for decode and for trees of up to 256 / G nodes
(64 for Llama-3-8B's G = 4), once per (request, KV head). Mask rows are read as packed
64-bit words, only for the KV tiles that overlap the tree. Long contexts with few such
tiles are split over programs (flash-decoding) and merged by their log-sum-exp.

Bounds. Every lane's address lies inside its buffer, masked lanes included: query rows,
positions, page columns, mask words and split lanes are clamped into range before they
form an address, padding head-dim lanes fold back into the row (``_lanes``), and a row or
position outside the request's data is masked off. So index tensors whose *values* were
not checked (a GPU hot path) may give wrong numbers but never move an access outside q,
the caches, the mask, the block table, out or lse -- except block ids themselves: the
kernel reads the blocks the table names (clamping them cost ~40 registers per thread in
batch-1 split decode), so they must lie in the pool (``check_bounds`` checks them, and
``KVCache`` keeps unused columns at valid ids).
"""

from __future__ import annotations

import math

import torch

from specdec.kernels._lanes import lane_alignment, row_lanes
from specdec.kernels._triton import jit, tl
from specdec.kernels.tree_attention_tiles import MERGE_SPACE, TileConfig, attention_space, next_pow2
from specdec.kernels.tuning import launch

LN2 = math.log(2.0)


# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------


@jit
def _block_ids_tl(table_row, pos, limit, SLOTS, MAX_BLOCKS):
    """Block ids [BLOCK_N] (int32, as stored) of positions ``pos``; lanes at or past ``limit`` read nothing
    and get block 0 (a real block: their loads are masked anyway). Ids are trusted (module docstring)."""
    page = tl.minimum(pos // SLOTS, MAX_BLOCKS - 1)
    return tl.load(table_row + page, mask=pos < limit, other=0)


@jit
def _attend_tl(q, k_ptr, v_ptr, k_off, v_off, d_at, d_ok, pos_ok, allowed, m_i, l_i, acc, scale_log2,
               GUARD: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """One KV tile of the online softmax (base 2): K and V at offsets ``k_off`` / ``v_off`` [BLOCK_N], scores
    kept where ``allowed``. GUARD: a row may have seen nothing yet (m = -inf): subtract 0 then, so exp2
    gives 0, not NaN; without it every row must have an allowed column in this tile."""
    k = tl.load(k_ptr + k_off[None, :] + d_at[:, None], mask=pos_ok[None, :] & d_ok[:, None], other=0.0)
    s = tl.dot(q, k, input_precision=PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
    s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if GUARD:
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_ref = m_new
    p = tl.exp2(s - m_ref[:, None])
    alpha = tl.exp2(m_i - m_ref)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_ptr + v_off[:, None] + d_at[None, :], mask=pos_ok[:, None] & d_ok[None, :], other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@jit
def tree_attention_kernel(
    # q [T, Hq, D]; k, v [rows, SLOTS, Hkv, D]: contiguous (a row per request) or paged (a block per row)
    # out [S, T, Hq, D] and lse [S, T, Hq]: per-split partials when NUM_SPLITS > 1 (lse in fp32), else the results
    q_ptr,
    k_ptr,
    v_ptr,
    q_offsets_ptr,  # [B+1] int32
    prefix_lens_ptr,  # [B] int32
    tree_start_ptr,  # [B] int32: positions before it are always visible (TREE only)
    mask_ptr,  # [T, MASK_WORDS] int64 (TREE only)
    block_table_ptr,  # [B, MAX_BLOCKS] int32 (PAGED only)
    out_ptr,
    lse_ptr,
    # sizes
    B,
    T,  # query rows
    GROUP,  # query heads per KV head
    HEAD_DIM,
    MASK_WORDS,
    SLOTS,  # positions per row (contiguous) or per block (paged)
    MAX_BLOCKS,
    NUM_SPLITS,  # programs sharing one tile's context
    scale_log2,  # softmax_scale / ln 2: the softmax runs in base 2
    # strides (elements)
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_mt,
    stride_bt,
    stride_os,
    stride_ot,
    stride_oh,
    stride_ls,
    stride_lt,
    stride_lh,
    # meta-parameters
    BLOCK_M: tl.constexpr,  # tile rows = BLOCK_Q query tokens x GROUP heads (padded)
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,  # KV positions per step (a power of two <= 64)
    BLOCK_D: tl.constexpr,  # HEAD_DIM padded to a power of two >= 16
    PAD_D: tl.constexpr,  # lane_alignment(HEAD_DIM, BLOCK_D): padding lanes fold back into the row
    TILES_PER_REQUEST: tl.constexpr,  # every request has this many query tiles (uniform queries); 0: ragged
    SEARCH_STEPS: tl.constexpr,  # >= log2(B + 1) (ragged)
    PAGED: tl.constexpr,
    TREE: tl.constexpr,  # bit-packed mask rows, else causal
    WRITE_LSE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    tl.static_assert(BLOCK_N <= 64, "a KV tile of the tree must lie inside one mask word")
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # -- map program to (request, query tile) --------------------------------------------------
    if TILES_PER_REQUEST > 0:  # the grid holds exactly B * TILES_PER_REQUEST tiles
        req = tile // TILES_PER_REQUEST
        q_lo = (tile % TILES_PER_REQUEST) * BLOCK_Q
        q_start = tl.load(q_offsets_ptr + req)
    else:
        # Request b's tiles are numbered from q_offsets[b] // BLOCK_Q + b on: strictly increasing in b
        # and leaving room for its ceil(n_b / BLOCK_Q) tiles, so a binary search finds the request
        # without a host-side table. Tiles past a request's last query do nothing.
        lo = 0
        hi = B
        for _ in tl.static_range(SEARCH_STEPS):
            mid = (lo + hi) // 2
            first = tl.load(q_offsets_ptr + mid) // BLOCK_Q + mid
            lo = tl.where(first <= tile, mid, lo)
            hi = tl.where(first <= tile, hi, mid)
        req = lo
        q_start = tl.load(q_offsets_ptr + req)
        q_lo = (tile - (q_start // BLOCK_Q + req)) * BLOCK_Q
    n_q = tl.load(q_offsets_ptr + req + 1) - q_start
    prefix = tl.load(prefix_lens_ptr + req)

    # -- the tile's queries: row r is local query q_lo + r // GROUP, head r % GROUP of the group
    rows = tl.arange(0, BLOCK_M)
    tok = q_lo + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (tok < n_q)
    q_row = tl.minimum(tl.maximum(q_start + tok, 0), T - 1).to(tl.int64)  # every lane addresses a real row
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    d_at = row_lanes(d, HEAD_DIM, BLOCK_D, PAD_D)
    q = tl.load(
        q_ptr + q_row[:, None] * stride_qt + head[:, None] * stride_qh + d_at[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )

    # -- this tile's context and this split's share of it. Causal: up to the tile's last query.
    # Tree: the whole tree (a mask bit may name any node), and never past the cache's capacity.
    if TREE:
        tstart = tl.load(tree_start_ptr + req)
        kv_len = prefix + n_q
    else:
        tstart = prefix
        kv_len = prefix + tl.minimum(n_q, q_lo + BLOCK_Q)
    capacity = MAX_BLOCKS * SLOTS if PAGED else SLOTS
    kv_len = tl.where(q_lo < n_q, tl.minimum(kv_len, capacity), 0)
    # unchecked negative prefix_lens / tree_start: every position (block ids read ahead included) stays >= 0
    kv_len = tl.maximum(kv_len, 0)
    tstart = tl.minimum(tl.maximum(tstart, 0), kv_len)
    chunk = tl.cdiv(tl.cdiv(kv_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    kv_lo = split * chunk
    kv_hi = tl.minimum(kv_lo + chunk, kv_len)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    cols = tl.arange(0, BLOCK_N)
    k_head = k_ptr + kv_head * stride_kh
    v_head = v_ptr + kv_head * stride_vh
    table_row = block_table_ptr + req * stride_bt
    # Lanes past the context still address cache slots: a table column and a slot of a real block (paged),
    # or a position inside the request's row (contiguous). Paged loops read the next tile's block ids one
    # step ahead, so no load in the loop waits on another and K/V copies stay in flight across steps.

    # -- the prefix [kv_lo, min(kv_hi, tstart)): visible to every row, no mask --------------------
    pre_hi = tl.minimum(kv_hi, tstart)
    if PAGED:
        blocks = _block_ids_tl(table_row, kv_lo + cols, pre_hi, SLOTS, MAX_BLOCKS)
    for start in range(kv_lo, pre_hi, BLOCK_N):
        pos = start + cols
        pos_ok = pos < pre_hi
        if PAGED:
            k_off = blocks.to(tl.int64) * stride_kb + (pos % SLOTS) * stride_kt
            v_off = blocks.to(tl.int64) * stride_vb + (pos % SLOTS) * stride_vt
            blocks = _block_ids_tl(table_row, pos + BLOCK_N, pre_hi, SLOTS, MAX_BLOCKS)
        else:
            pos_at = tl.minimum(pos, SLOTS - 1).to(tl.int64)
            k_off = req.to(tl.int64) * stride_kb + pos_at * stride_kt
            v_off = req.to(tl.int64) * stride_vb + pos_at * stride_vt
        # column 0 is always in range here, so every row has a finite maximum: no guard needed
        m_i, l_i, acc = _attend_tl(q, k_head, v_head, k_off, v_off, d_at, d_ok, pos_ok, pos_ok[None, :], m_i, l_i,
                                   acc, scale_log2, False, PRECISION)  # fmt: skip

    # -- the tail [max(kv_lo, tstart), kv_hi): tree position j = pos - tstart by mask bit j (or, causal,
    # j <= the query's index). Steps start at tstart + a multiple of BLOCK_N, so a step's mask bits lie in
    # one 64-bit word per row; the first step masks the columns before the split.
    tail_lo = tl.maximum(kv_lo, tstart)
    tail_start = tstart + (tail_lo - tstart) // BLOCK_N * BLOCK_N
    if PAGED:
        blocks = _block_ids_tl(table_row, tail_start + cols, kv_hi, SLOTS, MAX_BLOCKS)
    for start in range(tail_start, kv_hi, BLOCK_N):
        pos = start + cols
        pos_ok = (pos >= tail_lo) & (pos < kv_hi)
        if PAGED:
            k_off = blocks.to(tl.int64) * stride_kb + (pos % SLOTS) * stride_kt
            v_off = blocks.to(tl.int64) * stride_vb + (pos % SLOTS) * stride_vt
            blocks = _block_ids_tl(table_row, pos + BLOCK_N, kv_hi, SLOTS, MAX_BLOCKS)
        else:
            pos_at = tl.minimum(pos, SLOTS - 1).to(tl.int64)
            k_off = req.to(tl.int64) * stride_kb + pos_at * stride_kt
            v_off = req.to(tl.int64) * stride_vb + pos_at * stride_vt
        j = pos - tstart
        if TREE:
            w = (start - tstart) // 64
            # (a scalar condition enters the mask through tl.where: Triton 3.9's interpreter rejects a
            # vector & scalar-tensor mask)
            word = tl.load(
                mask_ptr + q_row * stride_mt + tl.minimum(w, MASK_WORDS - 1),
                mask=tl.where(w < MASK_WORDS, row_ok, False),
                other=0,
            )
            visible = ((word[:, None] >> (j % 64).to(tl.int64)[None, :]) & 1) != 0
        else:
            visible = j[None, :] <= tok[:, None]
        allowed = visible & pos_ok[None, :] & row_ok[:, None]
        m_i, l_i, acc = _attend_tl(q, k_head, v_head, k_off, v_off, d_at, d_ok, pos_ok, allowed, m_i, l_i, acc,
                                   scale_log2, True, PRECISION)  # fmt: skip

    # -- write back: normalised output and natural-log lse (0 and -inf for an empty row or split)
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o = acc / l_safe[:, None]
    split64 = split.to(tl.int64)
    tl.store(
        out_ptr + split64 * stride_os + q_row[:, None] * stride_ot + head[:, None] * stride_oh + d_at[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )
    if WRITE_LSE:
        lse = tl.where(l_i > 0, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
        tl.store(lse_ptr + split64 * stride_ls + q_row * stride_lt + head * stride_lh, lse, mask=row_ok)


@jit
def merge_splits_kernel(
    # part_out [S, T, Hq, D] (fp32 or fp16), part_lse [S, T, Hq] fp32 -> out [T, Hq, D], lse [T, Hq]; sums in fp32
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    lse_ptr,
    NUM_SPLITS,
    HEAD_DIM,
    stride_ps,
    stride_pt,
    stride_ph,
    stride_qs,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_lt,
    stride_lh,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAD_D: tl.constexpr,
    WRITE_LSE: tl.constexpr,
):
    # out = sum_s exp(lse_s - lse) out_s with lse = log sum_s exp(lse_s); empty splits weigh 0
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    s_ok = s < NUM_SPLITS
    s_at = tl.minimum(s, NUM_SPLITS - 1).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    d_at = row_lanes(d, HEAD_DIM, BLOCK_D, PAD_D)
    part_lse = tl.load(part_lse_ptr + s_at * stride_qs + t * stride_qt + h * stride_qh, mask=s_ok, other=float("-inf"))
    m = tl.max(part_lse, 0)
    m_ref = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(part_lse - m_ref)
    total = tl.sum(w, 0)
    part = tl.load(
        part_out_ptr + s_at[:, None] * stride_ps + t * stride_pt + h * stride_ph + d_at[None, :],
        mask=s_ok[:, None] & d_ok[None, :],
        other=0.0,
    ).to(tl.float32)
    o = tl.sum(part * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + d_at, o.to(out_ptr.dtype.element_ty), mask=d_ok)
    if WRITE_LSE:
        tl.store(lse_ptr + t * stride_lt + h * stride_lh, tl.where(total > 0, m_ref + tl.log(total), float("-inf")))


# --------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------


def triton_launches(q, k_cache, v_cache, q_offsets, prefix_lens, tree_start, tree_mask, block_table,
                    part_out, part_lse, softmax_scale, tile, out, lse) -> list:  # fmt: skip
    """[(kernel, grid, args, meta, config, space)] of one call (``tuning.launch``'s arguments): the main
    kernel, then the merge when the context is split.

    ``tile`` is a ``TileConfig`` (or its list); ``part_out [S, T, Hq, D]`` (``attention_plan.partial_dtype``) /
    ``part_lse [S, T, Hq]`` (float32) scratch are needed when ``tile.num_splits = S > 1``. Index tensors must
    have unit stride along their last dim (the plan makes them so).
    """
    tile = TileConfig(*tile)
    tokens, heads, head_dim = q.shape
    batch, kv_heads = prefix_lens.numel(), k_cache.shape[2]
    splits, paged, tree = tile.num_splits, block_table is not None, tree_mask is not None
    if splits > 1:
        dest_out, dest_lse = part_out, part_lse
    else:
        dest_out, dest_lse = out.unsqueeze(0), (lse.unsqueeze(0) if lse is not None else None)
    dummy = q_offsets  # stands in for absent tensors; never read
    mask = tree_mask if tree else dummy
    table = block_table if paged else dummy
    main_args = (
        q, k_cache, v_cache, q_offsets, prefix_lens, tree_start, mask, table, dest_out,
        dest_lse if dest_lse is not None else dummy,
        batch, tokens, heads // kv_heads, head_dim, mask.shape[-1] if tree else 1, k_cache.shape[1],
        table.shape[-1] if paged else 1, splits, softmax_scale / LN2,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        mask.stride(0) if tree else 0, table.stride(0) if paged else 0,
        dest_out.stride(0), dest_out.stride(1), dest_out.stride(2),
        *((dest_lse.stride(0), dest_lse.stride(1), dest_lse.stride(2)) if dest_lse is not None else (0, 0, 0)),
    )  # fmt: skip
    pad_d = lane_alignment(head_dim, tile.block_d)
    main_meta = dict(
        BLOCK_M=tile.block_m, BLOCK_Q=tile.block_q, BLOCK_D=tile.block_d, PAD_D=pad_d,
        TILES_PER_REQUEST=tile.tiles_per_request, SEARCH_STEPS=max(1, batch.bit_length()), PAGED=paged, TREE=tree,
        WRITE_LSE=dest_lse is not None,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )  # fmt: skip
    config = dict(BLOCK_N=tile.block_n, num_warps=tile.num_warps, num_stages=tile.num_stages)
    # uniform queries: exactly each request's tiles; ragged: room for every request's (some stay idle)
    tiles = batch * tile.tiles_per_request if tile.tiles_per_request else tokens // tile.block_q + batch
    grid = (tiles, kv_heads, splits)
    space = attention_space(tile.block_m, tile.block_d, q.dtype == torch.float32, bool(tile.hopper))
    launches = [(tree_attention_kernel, grid, main_args, main_meta, config, space)]
    if splits > 1:
        merge_args = (
            part_out, part_lse, out, lse if lse is not None else dummy, splits, head_dim,
            part_out.stride(0), part_out.stride(1), part_out.stride(2),
            part_lse.stride(0), part_lse.stride(1), part_lse.stride(2),
            out.stride(0), out.stride(1), *((lse.stride(0), lse.stride(1)) if lse is not None else (0, 0)),
        )  # fmt: skip
        merge_meta = dict(BLOCK_S=next_pow2(splits), BLOCK_D=tile.block_d, PAD_D=pad_d, WRITE_LSE=lse is not None)
        launches.append((merge_splits_kernel, (tokens, heads), merge_args, merge_meta, dict(num_warps=4), MERGE_SPACE))
    return launches


def tree_attention_triton(q, k_cache, v_cache, q_offsets, prefix_lens, tree_start, tree_mask, block_table,
                          query_rows, token_slots, kv_rows, attn_bias, part_out, part_lse, softmax_scale, tile,
                          out, lse) -> None:  # fmt: skip
    """The op's Triton body (positional arguments of ``torch.ops.specdec.tree_attention``).

    The PyTorch path's plan tensors (``query_rows`` .. ``attn_bias``) are not used here.
    """
    if q.shape[0] == 0:
        return
    for planned in triton_launches(
        q, k_cache, v_cache, q_offsets, prefix_lens, tree_start, tree_mask, block_table, part_out, part_lse,
        softmax_scale, tile, out, lse,
    ):  # fmt: skip
        launch(*planned)
