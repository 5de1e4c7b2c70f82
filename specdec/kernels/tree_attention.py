"""Tree attention: one op for causal prefill, decode and token-tree verification.

Query tokens of B requests are flattened into ``q [Tq, Hq, D]``; request b owns rows
``q_offsets[b] .. q_offsets[b+1]-1`` (n_b of them, possibly none). Its K/V cache
holds ``prefix_lens[b]`` earlier tokens, followed by the K/V of its own n_b query
tokens (already written). Query i of request b attends to

    every prefix position 0 .. p_b-1, and
    tree position p_b + j  iff  bit j of its mask row is set   (tree_mask), or j <= i (causal=True).

A chain mask is causal prefill; a single node is decode. With s = scale * q.k,
out = sum_j softmax(s)_j v_j and lse = log sum_j exp(s_j) over the allowed positions.

The Triton kernel processes, per program, a tile of BLOCK_Q query tokens of one
request times the G query heads sharing one KV head (BLOCK_M = BLOCK_Q * G <= 256
rows), so each KV tile is read once per (request, KV head, query tile): for decode and
trees of up to 256 / G nodes (64 for Llama-3-8B's G = 4), once per (request, KV head). Mask rows are read as packed
64-bit words, only for the KV tiles that overlap the tree. Long contexts with few such
tiles are split across programs (flash-decoding) and merged by their log-sum-exp.
The op is registered as ``torch.ops.specdec.tree_attention`` (writes ``out``/``lse``),
so it composes with torch.compile; the CUDA path makes no host-device sync.
"""

from __future__ import annotations

import math

import torch

from specdec import _backend
from specdec.kernels._checks import check_offsets, check_same_device, check_tensor
from specdec.kernels._triton import jit, tl
from specdec.kernels.tree_metadata import MASK_WORD_BITS, unpack_mask_rows

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
LN2 = math.log(2.0)


# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------


@jit
def _tree_attention_kernel(
    # q [Tq, Hq, D]; k, v [B', max_len, Hkv, D] or paged [num_blocks, PAGE, Hkv, D] (last dim contiguous)
    # out [S, Tq, Hq, D] and lse [S, Tq, Hq]: per-split partials (fp32) when NUM_SPLITS > 1, else the results
    q_ptr,
    k_ptr,
    v_ptr,
    q_offsets_ptr,  # [B+1] int32
    prefix_lens_ptr,  # [B] int32
    mask_ptr,  # [Tq, MASK_WORDS] int64 (TREE only)
    block_table_ptr,  # [B, MAX_BLOCKS] int32 (PAGED only)
    out_ptr,
    lse_ptr,
    # sizes
    B,
    GROUP,  # query heads per KV head
    HEAD_DIM,
    MASK_WORDS,
    PAGE,  # block size of the paged layout
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
    BLOCK_N: tl.constexpr,  # KV positions per step
    BLOCK_D: tl.constexpr,  # HEAD_DIM padded to a power of two
    SEARCH_STEPS: tl.constexpr,  # >= log2(B)
    PAGED: tl.constexpr,
    TREE: tl.constexpr,  # bit-packed mask rows, else causal
    WRITE_LSE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    tl.static_assert(BLOCK_N <= 64, "a KV tile may span at most two mask words")
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # -- map program to (request, query tile) --------------------------------------------------
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
    n_q = tl.load(q_offsets_ptr + req + 1) - q_start
    prefix = tl.load(prefix_lens_ptr + req)
    q_lo = (tile - (q_start // BLOCK_Q + req)) * BLOCK_Q

    # -- load the tile's queries: row r is local query q_lo + r // GROUP, head r % GROUP of the group
    rows = tl.arange(0, BLOCK_M)
    tok = q_lo + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (tok < n_q)
    q_row = (q_start + tok).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(
        q_ptr + q_row[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )

    # -- this tile's context (prefix + tree positions up to its last query) and this split's share
    kv_len = tl.where(q_lo < n_q, prefix + tl.minimum(n_q, q_lo + BLOCK_Q), 0)
    chunk = tl.cdiv(tl.cdiv(kv_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    kv_lo = split * chunk
    kv_hi = tl.minimum(kv_lo + chunk, kv_len)

    # -- iterate over KV tiles with an online softmax (base 2) ---------------------------------
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    cols = tl.arange(0, BLOCK_N)
    for start in range(kv_lo, kv_hi, BLOCK_N):
        pos = start + cols
        pos_ok = pos < kv_hi
        if PAGED:
            page = pos // PAGE
            block = tl.load(block_table_ptr + req * stride_bt + page, mask=pos_ok & (page < MAX_BLOCKS), other=0)
            block = block.to(tl.int64)
            k_off = block * stride_kb + (pos % PAGE) * stride_kt
            v_off = block * stride_vb + (pos % PAGE) * stride_vt
        else:
            k_off = req.to(tl.int64) * stride_kb + pos.to(tl.int64) * stride_kt
            v_off = req.to(tl.int64) * stride_vb + pos.to(tl.int64) * stride_vt
        k = tl.load(
            k_ptr + k_off[None, :] + kv_head * stride_kh + d[:, None], mask=pos_ok[None, :] & d_ok[:, None], other=0.0
        )  # [BLOCK_D, BLOCK_N]
        s = tl.dot(q, k, input_precision=PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]

        # prefix positions are always visible; tree position j by mask bit j (or j <= query)
        j = pos - prefix
        if TREE:
            # a tile of BLOCK_N <= 64 columns spans at most two mask words per row: load those two
            # [BLOCK_M] vectors (none for a tile inside the prefix) and pick each column's word
            jj = tl.maximum(j, 0)
            w0 = tl.maximum(start - prefix, 0) // 64
            # (scalar conditions enter the masks through tl.where: Triton 3.9's interpreter rejects
            # a vector & scalar-tensor mask)
            rows_in_tile = tl.where(start + BLOCK_N > prefix, row_ok, False)
            row_words = mask_ptr + q_row * stride_mt + w0
            word0 = tl.load(row_words, mask=tl.where(w0 < MASK_WORDS, rows_in_tile, False), other=0)
            word1 = tl.load(row_words + 1, mask=tl.where(w0 + 1 < MASK_WORDS, rows_in_tile, False), other=0)
            word = tl.where((jj // 64 == w0)[None, :], word0[:, None], word1[:, None])
            in_tree = ((word >> (jj % 64).to(tl.int64)[None, :]) & 1) != 0
        else:
            in_tree = j[None, :] <= tok[:, None]
        allowed = ((j < 0)[None, :] | in_tree) & pos_ok[None, :] & row_ok[:, None]
        s = tl.where(allowed, s, float("-inf"))

        # a row with nothing allowed yet keeps m = -inf; subtract 0 then so exp2 gives 0, not NaN
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_ref[:, None])
        alpha = tl.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_ptr + v_off[:, None] + kv_head * stride_vh + d[None, :], mask=pos_ok[:, None] & d_ok[None, :], other=0.0
        )  # [BLOCK_N, BLOCK_D]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    # -- write back: normalised output and natural-log lse (0 and -inf for an empty row or split)
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    o = acc / l_safe[:, None]
    split64 = split.to(tl.int64)
    tl.store(
        out_ptr + split64 * stride_os + q_row[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )
    if WRITE_LSE:
        lse = tl.where(l_i > 0, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
        tl.store(lse_ptr + split64 * stride_ls + q_row * stride_lt + head * stride_lh, lse, mask=row_ok)


@jit
def _merge_splits_kernel(
    # part_out [S, Tq, Hq, D] fp32, part_lse [S, Tq, Hq] fp32 -> out [Tq, Hq, D], lse [Tq, Hq]
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
    WRITE_LSE: tl.constexpr,
):
    # out = sum_s exp(lse_s - lse) out_s with lse = log sum_s exp(lse_s); empty splits weigh 0
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    s_ok = s < NUM_SPLITS
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    part_lse = tl.load(part_lse_ptr + s * stride_qs + t * stride_qt + h * stride_qh, mask=s_ok, other=float("-inf"))
    m = tl.max(part_lse, 0)
    m_ref = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(part_lse - m_ref)
    total = tl.sum(w, 0)
    part = tl.load(
        part_out_ptr + s[:, None].to(tl.int64) * stride_ps + t * stride_pt + h * stride_ph + d[None, :],
        mask=s_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    o = tl.sum(part * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + d, o.to(out_ptr.dtype.element_ty), mask=d_ok)
    if WRITE_LSE:
        tl.store(lse_ptr + t * stride_lt + h * stride_lh, tl.where(total > 0, m_ref + tl.log(total), float("-inf")))


# --------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------


def _next_pow2(x: int) -> int:
    return 1 << max(0, x - 1).bit_length()


def _tile_config(tokens: int, batch: int, group: int, head_dim: int) -> dict:
    """Tile sizes and warps for the main kernel, from shapes only."""
    block_d = _next_pow2(head_dim)
    # Rows are (query token, head of the group) pairs; size the tile to the mean request, so
    # decode and trees up to BLOCK_Q nodes read each KV tile once per (request, KV head).
    rows = _next_pow2(-(-tokens // batch) * group)
    if block_d <= 128 and 128 < rows <= 256:
        # e.g. a 64-node tree x 4 heads: 256 rows in one tile with 32-wide KV steps (255 registers,
        # no spills on sm_90) rather than two 128-row tiles that would each read the context
        block_m, block_n = 256, 32
    else:
        block_m = max(16, min(128 if block_d <= 128 else 64, rows), _next_pow2(group))
        block_n = 64 if block_d <= 128 else 32
    return dict(
        BLOCK_M=block_m,
        BLOCK_Q=block_m // group,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        num_warps=8 if block_m >= 128 else 4,
    )


def _tree_attention_triton(*args) -> None:
    """Launch the kernel, then the split merge if the context was split (args as ``_plan_launches``)."""
    for kernel, grid, kernel_args, meta in _plan_launches(*args):
        kernel[grid](*kernel_args, **meta)


def _plan_launches(q, k_cache, v_cache, q_offsets, prefix_lens, tree_mask, block_table, scale, out, lse, splits):
    """[(kernel, grid, args, meta)]: tile sizes and split count from shapes only (no sync), buffers allocated."""
    tokens, heads, head_dim = q.shape
    batch, kv_heads = prefix_lens.numel(), k_cache.shape[2]
    group = heads // kv_heads
    tile = _tile_config(tokens, batch, group, head_dim)
    block_q, block_n, block_d = tile["BLOCK_Q"], tile["BLOCK_N"], tile["BLOCK_D"]
    tiles = tokens // block_q + batch
    paged = block_table is not None
    if splits is None:
        splits = 1
        if q.is_cuda:  # split the context until the grid covers the GPU about twice
            sms = torch.cuda.get_device_properties(q.device).multi_processor_count
            capacity = k_cache.shape[1] * (block_table.shape[1] if paged else 1)  # bound on any context
            splits = max(1, min(-(-2 * sms // (tiles * kv_heads)), -(-capacity // (4 * block_n)), 64))
    if splits > 1:
        part_out = torch.empty(splits, tokens, heads, head_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(splits, tokens, heads, dtype=torch.float32, device=q.device)
        dest_out, dest_lse = part_out, part_lse
    else:
        dest_out, dest_lse = out.unsqueeze(0), (lse.unsqueeze(0) if lse is not None else None)
    # the small index tensors may be strided views: the kernel assumes unit stride along their rows
    q_offsets, prefix_lens = q_offsets.contiguous(), prefix_lens.contiguous()
    dummy = q_offsets
    mask = tree_mask.contiguous() if tree_mask is not None else dummy
    table = block_table.contiguous() if paged else dummy
    main_args = (
        q, k_cache, v_cache, q_offsets, prefix_lens, mask, table, dest_out,
        dest_lse if dest_lse is not None else dummy,
        batch, group, head_dim, mask.shape[-1] if tree_mask is not None else 1, k_cache.shape[1],
        table.shape[-1] if paged else 1, splits, scale / LN2,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        mask.stride(0) if tree_mask is not None else 0, table.stride(0) if paged else 0,
        dest_out.stride(0), dest_out.stride(1), dest_out.stride(2),
        *((dest_lse.stride(0), dest_lse.stride(1), dest_lse.stride(2)) if dest_lse is not None else (0, 0, 0)),
    )  # fmt: skip
    main_meta = dict(
        **tile, SEARCH_STEPS=max(1, batch.bit_length()), PAGED=paged, TREE=tree_mask is not None,
        WRITE_LSE=dest_lse is not None, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )  # fmt: skip
    launches = [(_tree_attention_kernel, (tiles, kv_heads, splits), main_args, main_meta)]
    if splits > 1:
        merge_args = (
            part_out, part_lse, out, lse if lse is not None else dummy, splits, head_dim,
            part_out.stride(0), part_out.stride(1), part_out.stride(2),
            part_lse.stride(0), part_lse.stride(1), part_lse.stride(2),
            out.stride(0), out.stride(1), *((lse.stride(0), lse.stride(1)) if lse is not None else (0, 0)),
        )  # fmt: skip
        merge_meta = dict(BLOCK_S=_next_pow2(splits), BLOCK_D=block_d, WRITE_LSE=lse is not None)
        launches.append((_merge_splits_kernel, (tokens, heads), merge_args, merge_meta))
    return launches


# --------------------------------------------------------------------------------------------
# Public op
# --------------------------------------------------------------------------------------------


def tree_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    q_offsets: torch.Tensor,
    prefix_lens: torch.Tensor,
    *,
    tree_mask: torch.Tensor | None = None,
    causal: bool = False,
    block_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    out: torch.Tensor | None = None,
    return_lse: bool = False,
    check_bounds: bool | None = None,
    num_splits: int | None = None,
):
    """Attention of flattened query tokens over a KV cache, masked by token trees.

    Parameters
    ----------
    q : ``[Tq, Hq, D]`` float16, bfloat16 or float32; query tokens of all requests.
    k_cache, v_cache : same dtype as ``q``; contiguous layout ``[B', max_len, Hkv, D]``
        (B' >= B, request b uses row b) or, with ``block_table``, paged layout
        ``[num_blocks, block_size, Hkv, D]``. Strided views are fine (e.g. one layer of a
        stacked ``[L, 2, B, max_len, Hkv, D]`` cache) as long as the last dim is contiguous.
    q_offsets : ``[B+1]`` int32; request b owns query rows ``q_offsets[b] .. q_offsets[b+1]-1``.
    prefix_lens : ``[B]`` int32; cached tokens before request b's queries. Query i of
        request b has its K/V at cache position ``prefix_lens[b] + i``.
    tree_mask : ``[Tq, W]`` int64, bit-packed ancestor-or-self rows with local node indices
        (bit j = word j // 64, bit j % 64), as ``build_tree_metadata`` returns them.
    causal : True instead of ``tree_mask``: query i attends to tree positions j <= i.
    block_table : ``[B, max_blocks]`` int32 physical block ids (paged layout only).
    softmax_scale : default ``D ** -0.5``.
    out : optional ``[Tq, Hq, D]`` output buffer, dtype of ``q`` (last dim contiguous).
    return_lse : also return the log-sum-exp ``[Tq, Hq]`` float32 (natural log).
    check_bounds : check the *values* of ``q_offsets``, ``prefix_lens`` and ``block_table``
        (offsets non-decreasing and summing to Tq, prefixes >= 0, every request fitting in
        its cache row or block table, mask rows wide enough for the tree: ``W * 64 >= n_b``,
        block ids in range). Default: only for CPU tensors, where it costs no device sync;
        pass True to check CUDA inputs too (one sync). Shapes, dtypes, devices, head counts
        and, for a single request, the mask width are always checked. Unchecked CUDA values
        never cause out-of-bounds reads of the mask or the block table (bits past ``W * 64``
        read as unset, block columns past ``max_blocks`` as block 0) but give wrong results.
        A row with no allowed position gets out 0, lse -inf.
    num_splits : Triton path only: split each request's context over this many programs
        (default: chosen from the device's size).

    Returns
    -------
    ``out [Tq, Hq, D]`` (dtype of ``q``), or ``(out, lse [Tq, Hq] float32)`` with ``return_lse``.

    Example
    -------
    >>> from specdec.kernels import build_tree_metadata
    >>> parents = torch.tensor([-1, 0, 0], dtype=torch.int32)        # root and two children
    >>> meta = build_tree_metadata(parents, torch.tensor([0, 3], dtype=torch.int32))
    >>> k = torch.randn(1, 16, 2, 64); v = torch.randn(1, 16, 2, 64)  # 10 cached + 3 tree tokens
    >>> q = torch.randn(3, 8, 64)                                      # 8 query heads share 2 KV heads
    >>> o = tree_attention(q, k, v, torch.tensor([0, 3], dtype=torch.int32),
    ...                    torch.tensor([10], dtype=torch.int32), tree_mask=meta.ancestor_mask)
    >>> o.shape
    torch.Size([3, 8, 64])
    """
    check_tensor("q", q, dtype=DTYPES, ndim=3)
    check_tensor("k_cache", k_cache, dtype=q.dtype, ndim=4)
    check_tensor("v_cache", v_cache, dtype=q.dtype, shape=tuple(k_cache.shape))
    check_tensor("q_offsets", q_offsets, dtype=torch.int32, ndim=1)
    batch = q_offsets.numel() - 1
    if batch < 1:
        raise ValueError(f"q_offsets must hold B+1 >= 2 entries (B >= 1 requests), got {q_offsets.numel()}")
    check_tensor("prefix_lens", prefix_lens, dtype=torch.int32, shape=(batch,))
    tokens, heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"k_cache head dim {k_cache.shape[3]} differs from q's head dim {head_dim}")
    if head_dim % 16 or not 16 <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"q head dim must be a multiple of 16 in [16, {MAX_HEAD_DIM}], got {head_dim}")
    if heads % kv_heads:
        raise ValueError(f"q has {heads} heads, not a multiple of k_cache's {kv_heads} KV heads")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last (head) dimension; call .contiguous() first")
    if (tree_mask is None) == (not causal):
        raise ValueError("pass exactly one of tree_mask (tree verification) or causal=True (prefill / decode)")
    if tree_mask is not None:
        check_tensor("tree_mask", tree_mask, dtype=torch.int64, ndim=2)
        if tree_mask.shape[0] != tokens or tree_mask.shape[1] < 1:
            raise ValueError(f"tree_mask must have shape ({tokens}, W >= 1), got {tuple(tree_mask.shape)}")
        if batch == 1 and tree_mask.shape[1] * MASK_WORD_BITS < tokens:  # one tree: its size is Tq (no sync)
            raise ValueError(
                f"tree_mask has {tree_mask.shape[1]} words per row ({tree_mask.shape[1] * MASK_WORD_BITS} nodes), "
                f"too short for request 0's tree of {tokens} nodes"
            )
    if block_table is not None:
        check_tensor("block_table", block_table, dtype=torch.int32, ndim=2)
        if block_table.shape[0] != batch:
            raise ValueError(f"block_table must have {batch} rows (one per request), got {block_table.shape[0]}")
    elif k_cache.shape[0] < batch:
        raise ValueError(f"k_cache has {k_cache.shape[0]} rows but there are {batch} requests (contiguous layout)")
    device = check_same_device(
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        q_offsets=q_offsets,
        prefix_lens=prefix_lens,
        tree_mask=tree_mask,
        block_table=block_table,
        out=out,
    )
    if out is not None:
        check_tensor("out", out, dtype=q.dtype, shape=tuple(q.shape))
        if out.stride(-1) != 1:
            raise ValueError("out must be contiguous in its last dimension")
    if softmax_scale is None:
        softmax_scale = head_dim**-0.5
    if not (isinstance(softmax_scale, (int, float)) and math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"softmax_scale must be a positive finite float, got {softmax_scale!r}")
    if num_splits is not None and (not isinstance(num_splits, int) or num_splits < 1):
        raise ValueError(f"num_splits must be a positive int, got {num_splits!r}")
    if check_bounds is None:
        check_bounds = device.type == "cpu"
    if check_bounds:
        _check_values(q_offsets, prefix_lens, tokens, k_cache, tree_mask, block_table)

    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty(tokens, heads, dtype=torch.float32, device=device) if return_lse else None
    if tokens > 0:
        _tree_attention_op(
            q, k_cache, v_cache, q_offsets, prefix_lens, tree_mask, block_table, float(softmax_scale), out, lse,
            num_splits or 0,
        )  # fmt: skip
    return (out, lse) if return_lse else out


@torch.library.custom_op("specdec::tree_attention", mutates_args=("out", "lse"))
def _tree_attention_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    q_offsets: torch.Tensor,
    prefix_lens: torch.Tensor,
    tree_mask: torch.Tensor | None,
    block_table: torch.Tensor | None,
    softmax_scale: float,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    num_splits: int,
) -> None:
    """The op as torch.compile and CUDA graphs see it: writes ``out`` (and ``lse``); 0 splits = auto."""
    if _backend.select_backend(q, k_cache) == "triton":
        _tree_attention_triton(
            q, k_cache, v_cache, q_offsets, prefix_lens, tree_mask, block_table, softmax_scale, out, lse,
            num_splits or None,
        )  # fmt: skip
        return
    if tree_mask is None and lse is None:  # prefill chunks, decode and chains: fused SDPA per request
        causal_attention_sdpa(q, k_cache, v_cache, q_offsets, prefix_lens, block_table, softmax_scale, out)
        return
    ref_out, ref_lse = tree_attention_reference(
        q, k_cache, v_cache, q_offsets, prefix_lens, tree_mask, block_table, softmax_scale
    )
    out.copy_(ref_out)
    if lse is not None:
        lse.copy_(ref_lse)


@_tree_attention_op.register_fake
def _(q, k_cache, v_cache, q_offsets, prefix_lens, tree_mask, block_table, softmax_scale, out, lse, num_splits):
    return None


def _check_values(q_offsets, prefix_lens, tokens, k_cache, tree_mask, block_table) -> None:
    """Checks that read tensor values (a device sync on CUDA)."""
    bounds = check_offsets("q_offsets", q_offsets, total=tokens)
    prefixes = prefix_lens.tolist()
    sizes = [bounds[b + 1] - bounds[b] for b in range(len(prefixes))]
    for b, p in enumerate(prefixes):
        if p < 0:
            raise ValueError(f"prefix_lens[{b}] must be >= 0, got {p}")
    if tree_mask is not None and max(sizes) > tree_mask.shape[1] * MASK_WORD_BITS:
        b = max(range(len(sizes)), key=lambda i: sizes[i])
        raise ValueError(
            f"tree_mask has {tree_mask.shape[1]} words per row ({tree_mask.shape[1] * MASK_WORD_BITS} nodes), "
            f"too short for request {b}'s tree of {sizes[b]} nodes"
        )
    needed = [p + n for p, n in zip(prefixes, sizes)]
    if block_table is None:
        for b, length in enumerate(needed):
            if length > k_cache.shape[1]:
                raise ValueError(
                    f"request {b} needs {length} cache positions (prefix_lens {prefixes[b]} + {sizes[b]} queries) "
                    f"but k_cache holds max_len={k_cache.shape[1]}"
                )
        return
    block_size, max_blocks = k_cache.shape[1], block_table.shape[1]
    for b, length in enumerate(needed):
        blocks = -(-length // block_size)
        if blocks > max_blocks:
            raise ValueError(
                f"block_table is too small: request {b} needs {blocks} blocks of {block_size} for {length} "
                f"tokens but block_table has {max_blocks} columns"
            )
        used = block_table[b, :blocks]
        if used.numel() and (int(used.min()) < 0 or int(used.max()) >= k_cache.shape[0]):
            raise ValueError(f"block_table row {b} holds block ids outside [0, {k_cache.shape[0]}) in its used part")


# --------------------------------------------------------------------------------------------
# PyTorch reference
# --------------------------------------------------------------------------------------------


def request_kv(k_cache, v_cache, block_table, b: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Request b's first ``length`` cached K and V, ``[L, Hkv, D]`` each, from either layout."""
    if block_table is None:
        return k_cache[b, :length], v_cache[b, :length]
    # paged: gather whole blocks, then trim: [blocks, block_size, Hkv, D] -> [L, Hkv, D]
    blocks = block_table[b, : -(-length // k_cache.shape[1])].long()
    return k_cache[blocks].flatten(0, 1)[:length], v_cache[blocks].flatten(0, 1)[:length]


REFERENCE_SCORE_BUDGET = 1 << 25  # float32 scores one reference step may hold


def tree_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    q_offsets: torch.Tensor,
    prefix_lens: torch.Tensor,
    tree_mask: torch.Tensor | None,
    block_table: torch.Tensor | None,
    softmax_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Readable PyTorch tree attention (the CPU path); returns (out like q, lse [Tq, Hq] float32).

    Vectorised per request in float32; queries are processed in chunks so a long prefill
    chunk never holds more than ``REFERENCE_SCORE_BUDGET`` scores at once. ``tree_mask=None``
    means causal. (Padding all requests into one batched product was tried: on the CPU it
    was up to 5x slower at long contexts, the padded K/V no longer staying in cache.)
    """
    tokens, heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    group = heads // kv_heads
    out = torch.zeros(tokens, heads, head_dim, dtype=torch.float32, device=q.device)
    lse = torch.full((tokens, heads), -math.inf, dtype=torch.float32, device=q.device)
    bounds, prefixes = q_offsets.tolist(), prefix_lens.tolist()
    for b, prefix in enumerate(prefixes):
        start, n = bounds[b], bounds[b + 1] - bounds[b]
        if n == 0:
            continue
        length = prefix + n
        k, v = request_kv(k_cache, v_cache, block_table, b, length)
        k, v = k.float(), v.float()
        nodes = torch.arange(n, device=q.device)
        if tree_mask is not None:
            allowed = unpack_mask_rows(tree_mask[start : start + n], n)  # [n, n] local node bits
            allowed = torch.nn.functional.pad(allowed, (0, n - allowed.shape[1]))  # bits past W*64 are unset
        qb = q[start : start + n].float().view(n, kv_heads, group, head_dim)
        chunk = max(1, REFERENCE_SCORE_BUDGET // (heads * length))
        for c0 in range(0, n, chunk):
            c1 = min(n, c0 + chunk)
            s = torch.einsum("nhgd,lhd->hgnl", qb[c0:c1], k).mul_(softmax_scale)  # [Hkv, G, c, L]
            # causal: compare indices per chunk instead of building an [n, n] mask for a long prefill
            rows = allowed[c0:c1] if tree_mask is not None else nodes[c0:c1, None] >= nodes
            s[..., prefix:].masked_fill_(~rows, -math.inf)
            # softmax by hand to get the lse too; a row with nothing allowed has max -inf: use 0
            row_max = s.amax(-1, keepdim=True).nan_to_num_(neginf=0.0)
            p = s.sub_(row_max).exp_()
            row_sum = p.sum(-1)  # [Hkv, G, c]
            o = torch.einsum("hgnl,lhd->nhgd", p, v) / row_sum.clamp_min(1e-30).permute(2, 0, 1).unsqueeze(-1)
            out[start + c0 : start + c1] = o.reshape(c1 - c0, heads, head_dim)
            row_lse = row_max.squeeze(-1) + row_sum.log()  # log 0 = -inf for an empty row
            lse[start + c0 : start + c1] = row_lse.permute(2, 0, 1).reshape(c1 - c0, heads)
    return out.to(q.dtype), lse


def causal_attention_sdpa(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    q_offsets: torch.Tensor,
    prefix_lens: torch.Tensor,
    block_table: torch.Tensor | None,
    softmax_scale: float,
    out: torch.Tensor,
) -> None:
    """The causal case without the log-sum-exp, on PyTorch's fused SDPA (the CPU fast path).

    Same contract as ``tree_attention_reference`` with ``tree_mask=None``: query i of request b
    sees positions ``0 .. prefix_lens[b] + i``. Every row sees at least itself, so no row is empty.
    One SDPA call per request instead of the reference's dozen small ops: on the CPU a decode
    step is dominated by per-op overhead, not arithmetic.
    """
    heads, kv_heads = q.shape[1], k_cache.shape[2]
    bounds, prefixes = q_offsets.tolist(), prefix_lens.tolist()
    for b, prefix in enumerate(prefixes):
        start, n = bounds[b], bounds[b + 1] - bounds[b]
        if n == 0:
            continue
        length = prefix + n
        k, v = request_kv(k_cache, v_cache, block_table, b, length)
        qb = q[start : start + n].transpose(0, 1)  # [Hq, n, D]
        kb = k.transpose(0, 1).repeat_interleave(heads // kv_heads, dim=0)  # [Hq, L, D]
        vb = v.transpose(0, 1).repeat_interleave(heads // kv_heads, dim=0)
        mask = None
        if n > 1:
            positions = torch.arange(length, device=q.device)
            mask = positions[None, :] <= (prefix + torch.arange(n, device=q.device))[:, None]  # [n, L]
        o = torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=softmax_scale)
        out[start : start + n] = o.transpose(0, 1)
