"""KV append: write the K/V of new query tokens right after each request's prefix, in place.

Token i of request b (rows ``q_offsets[b] + i`` of k and v) goes to position
``seq_lens[b] + i`` of layer ``layer`` in the stacked cache (``kv_layout``); ``seq_lens``
is not changed. One program copies one chunk of one token's row, for K and for V.

Capacity. A token whose position would fall outside its request's capacity (or, paged,
on a block id outside the pool) is a caller error: the checked public op raises a
ValueError naming the request and the position before anything is written. Unchecked
calls (a GPU hot path, or the op bodies called directly) drop such a token on both
backends and write everything else; nothing is ever written outside the cache.
"""

from __future__ import annotations

import torch

from specdec.kernels._checks import check_offsets, check_tensor
from specdec.kernels._lanes import lane_alignment, row_lanes
from specdec.kernels._op import register_op
from specdec.kernels._triton import INT32_MAX, jit, tl, triton
from specdec.kernels.kv_layout import (
    BITS_VIEW,
    MAX_ROW_BLOCK,
    capacity,
    check_block_ids,
    check_cache,
    check_lengths,
    slots,
)
from specdec.kernels.tuning import TuningSpace, candidates, launch

# --------------------------------------------------------------------------------------------
# Triton kernel
# --------------------------------------------------------------------------------------------


@jit
def kv_append_kernel(
    # k, v: [T, Hkv, D] (last dim contiguous); data: the layer's [2, ...] slab, integer view
    k_ptr,
    v_ptr,
    data_ptr,
    seq_lens_ptr,  # [B] int32
    q_offsets_ptr,  # [B+1] int32
    block_tables_ptr,  # [B, max_blocks] int32 (PAGED only)
    # sizes
    B,
    ROW,  # Hkv * D elements per token row
    D,
    SPAN,  # lanes over a row: chunks * ROW_BLOCK
    capacity,  # positions per request
    NUM_BLOCKS,  # blocks in the pool (PAGED only)
    # strides (elements)
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kv,  # K slab -> V slab
    stride_req,  # request (contiguous) or block (paged)
    stride_pos,  # position within a request row or a block
    stride_bt,
    # meta-parameters
    PAGED: tl.constexpr,
    PAGE: tl.constexpr,
    B_BLOCK: tl.constexpr,
    ROW_BLOCK: tl.constexpr,
    ALIGN: tl.constexpr,  # lane_alignment(ROW, SPAN)
):
    # ---- map the program to (token, chunk of its row) and the token to its request
    t = tl.program_id(0)
    chunk = tl.program_id(1)
    r = tl.arange(0, B_BLOCK)
    ends = tl.load(q_offsets_ptr + 1 + tl.minimum(r, B - 1), mask=r < B, other=INT32_MAX)
    b = tl.sum((ends <= t).to(tl.int32), axis=0)
    in_batch = b < B
    b = tl.minimum(b, B - 1)
    pos = tl.load(seq_lens_ptr + b) + t - tl.load(q_offsets_ptr + b)
    ok = in_batch & (pos >= 0) & (pos < capacity)  # never outside the request's slots
    pos = tl.minimum(tl.maximum(pos, 0), capacity - 1)
    if PAGED:
        block = tl.load(block_tables_ptr + b * stride_bt + pos // PAGE)
        ok = ok & (block >= 0) & (block < NUM_BLOCKS)  # a bad block id: drop the token
        block = tl.minimum(tl.maximum(block, 0), NUM_BLOCKS - 1).to(tl.int64)
        dst = block * stride_req + (pos % PAGE).to(tl.int64) * stride_pos
    else:
        dst = b.to(tl.int64) * stride_req + pos.to(tl.int64) * stride_pos

    # ---- copy the row chunk of K and of V
    e = chunk * ROW_BLOCK + tl.arange(0, ROW_BLOCK)
    emask = e < tl.where(ok, ROW, 0)  # (a scalar & vector of bools is not a bool mask in the interpreter)
    e = row_lanes(e, ROW, SPAN, ALIGN)
    h = e // D
    d = e % D
    t64 = t.to(tl.int64)
    k_row = tl.load(k_ptr + t64 * stride_kt + h * stride_kh + d, mask=emask)
    v_row = tl.load(v_ptr + t64 * stride_vt + h * stride_vh + d, mask=emask)
    tl.store(data_ptr + dst + e, k_row, mask=emask)
    tl.store(data_ptr + stride_kv + dst + e, v_row, mask=emask)


# --------------------------------------------------------------------------------------------
# Bodies: the Triton launcher and the PyTorch implementation
# --------------------------------------------------------------------------------------------


# The row block is fixed by the layout (it sets the grid and the lane folding); only the warps are
# tuned. Rewriting the same rows is harmless, so trials need no restore.
KV_APPEND_SPACE = TuningSpace(candidates(num_warps=(2, 4, 8)), key=("ROW", "PAGED"))


def kv_append_triton(data, layer, k, v, seq_lens, q_offsets, block_tables) -> None:
    tokens, kv_heads, head_dim = k.shape
    if tokens == 0:
        return
    bits = BITS_VIEW[data.element_size()]
    row = kv_heads * head_dim
    row_block = min(triton.next_power_of_2(row), MAX_ROW_BLOCK)
    chunks = triton.cdiv(row, row_block)
    paged = block_tables is not None
    batch = seq_lens.shape[0]
    args = (
        k.view(bits), v.view(bits), data[layer].view(bits), seq_lens, q_offsets,
        block_tables if paged else seq_lens,
        batch, row, head_dim, chunks * row_block, capacity(data, block_tables), data.shape[2],
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), data.stride(1), data.stride(2), data.stride(3),
        block_tables.stride(0) if paged else 0,
    )  # fmt: skip
    meta = dict(
        PAGED=paged, PAGE=data.shape[3] if paged else 1, B_BLOCK=triton.next_power_of_2(max(batch, 2)),
        ROW_BLOCK=row_block, ALIGN=lane_alignment(row, chunks * row_block),
    )  # fmt: skip
    launch(kv_append_kernel, (tokens, chunks), args, meta, dict(num_warps=4), KV_APPEND_SPACE)


def kv_append_torch(data, layer, k, v, seq_lens, q_offsets, block_tables) -> None:
    """Vectorised over tokens; tokens that would land outside the cache are dropped (see the module)."""
    tokens = k.shape[0]
    if tokens == 0:
        return
    batch = seq_lens.shape[0]
    t = torch.arange(tokens, device=k.device)
    b = torch.searchsorted(q_offsets[1:], t.to(q_offsets.dtype), right=True).clamp_(max=batch - 1)
    pos = seq_lens[b] + (t - q_offsets[b])
    rows = _rows_inside(data, block_tables, q_offsets, t, b, pos)
    if rows is not None:
        b, pos = b[rows], pos[rows]
    where = slots(data, block_tables, b, pos)
    data[layer, 0][where] = k if rows is None else k[rows]
    data[layer, 1][where] = v if rows is None else v[rows]


def append_rows(data, seq_lens, q_offsets, block_tables, num_tokens: int, per_request: int | None = None):
    """int64 ``[T]``: the row of ``data[l, kv].view(-1, Hkv, D)`` each token goes to, by device ops only.

    The model's forward plan computes these once for every layer's ``index_copy_`` of K and V; the
    caller has admitted every position (``KVCache.reserve``), so nothing is dropped or checked.
    ``per_request``: a host fact, every request sends exactly this many tokens (cheaper indexing).
    """
    page = data.shape[3]  # positions per request row (contiguous) or per block (paged)
    device = seq_lens.device
    if per_request is not None:  # [B, n] positions, request by request
        i = torch.arange(per_request, device=device)
        if block_tables is None:  # row b * page + position
            return ((seq_lens + torch.arange(0, seq_lens.shape[0] * page, page, device=device))[:, None] + i).flatten()
        pos = seq_lens[:, None] + i
        return (block_tables.long().gather(1, pos // page) * page + pos % page).flatten()
    t = torch.arange(num_tokens, device=device)
    b = torch.searchsorted(q_offsets[1:], t.to(q_offsets.dtype), right=True).clamp_(max=seq_lens.shape[0] - 1)
    pos = seq_lens.long()[b] + (t - q_offsets.long()[b])
    if block_tables is None:
        return b * page + pos
    return block_tables.long()[b, pos // page] * page + pos % page


def _rows_inside(data, block_tables, q_offsets, t, b, pos):
    """None when every token lands in its request's slots, else the indices of those that do.

    The common case costs one read of a few extremes (a sync on a GPU), not a mask per token.
    """
    room = capacity(data, block_tables)
    low, high = torch.aminmax(pos)
    extremes = [q_offsets[-1].long(), low, high]
    if block_tables is not None:
        block = block_tables[b, (pos // data.shape[3]).clamp(0, block_tables.shape[1] - 1)]
        extremes += [x.long() for x in torch.aminmax(block)]
    values = torch.stack(extremes).tolist()
    fits = values[0] >= t.numel() and values[1] >= 0 and values[2] < room
    if block_tables is not None:
        fits = fits and values[3] >= 0 and values[4] < data.shape[2]
    if fits:
        return None
    keep = (t < q_offsets[-1]) & (pos >= 0) & (pos < room)
    if block_tables is not None:
        keep &= (block >= 0) & (block < data.shape[2])
    return keep.nonzero().squeeze(1)


# --------------------------------------------------------------------------------------------
# Registered op
# --------------------------------------------------------------------------------------------


@register_op("kv_append", mutates_args=("data",), triton=kv_append_triton, torch=kv_append_torch)
def kv_append_op(
    data: torch.Tensor,
    layer: int,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_lens: torch.Tensor,
    q_offsets: torch.Tensor,
    block_tables: torch.Tensor | None,
) -> None:
    """Writes ``data``; index tensors contiguous. ``kv_append_op.body(backend)`` is the unchecked hot path."""


# --------------------------------------------------------------------------------------------
# Public op
# --------------------------------------------------------------------------------------------


def kv_append(
    data: torch.Tensor,
    layer: int,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_lens: torch.Tensor,
    q_offsets: torch.Tensor,
    block_tables: torch.Tensor | None = None,
    *,
    check_bounds: bool | None = None,
) -> None:
    """Write the K/V of new query tokens right after each request's prefix, in place.

    Parameters
    ----------
    data : float16, bfloat16 or float32, contiguous; the stacked cache ``[L, 2, B, max_len, Hkv, D]``
        or, with ``block_tables``, ``[L, 2, num_blocks, block_size, Hkv, D]``.
    layer : which layer's K and V slabs receive the tokens.
    k, v : ``[T, Hkv, D]``, dtype of ``data``, last dim contiguous (strided views of a fused
        QKV projection are fine); token rows of all requests, flattened.
    seq_lens : ``[B]`` int32; committed tokens per request (not changed here).
    q_offsets : ``[B+1]`` int32; request b owns tokens ``q_offsets[b] .. q_offsets[b+1]-1`` and
        token ``q_offsets[b] + i`` goes to position ``seq_lens[b] + i``.
    block_tables : ``[B, max_blocks]`` int32 physical block of each logical block (paged only).
    check_bounds : check the offsets and that every token lands inside its request's capacity
        (and, paged, on a real block), raising ValueError before writing. Default: for CPU
        tensors only, where it costs no device sync. Unchecked, such tokens are dropped.

    Example
    -------
    >>> data = torch.zeros(1, 2, 2, 8, 1, 4)                       # 1 layer, B=2, max_len 8
    >>> k = torch.arange(12.).view(3, 1, 4); v = -k
    >>> kv_append(data, 0, k, v, torch.tensor([2, 5], dtype=torch.int32),
    ...           torch.tensor([0, 1, 3], dtype=torch.int32))
    >>> data[0, 0, 1, 5:7, 0, 0].tolist()                          # tokens 1, 2 at positions 5, 6
    [4.0, 8.0]
    """
    check_cache(data, block_tables)
    layers, _, _, _, kv_heads, head_dim = data.shape
    if not isinstance(layer, int) or isinstance(layer, bool) or not 0 <= layer < layers:
        raise ValueError(f"layer must be an int in [0, {layers}), got {layer!r}")
    device = data.device
    check_tensor("k", k, dtype=data.dtype, ndim=3, device=device)
    check_tensor("v", v, dtype=data.dtype, shape=(k.shape[0], kv_heads, head_dim), device=device)
    check_tensor("k", k, shape=(None, kv_heads, head_dim))
    for name, t in (("k", k), ("v", v)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dim; call .contiguous() first")
    batch = check_lengths(seq_lens, data, block_tables)
    check_tensor("q_offsets", q_offsets, dtype=torch.int32, shape=(batch + 1,), device=device)
    if check_bounds is None:
        check_bounds = device.type == "cpu"
    if check_bounds:
        _check_positions(data, block_tables, seq_lens, check_offsets("q_offsets", q_offsets, total=k.shape[0]))
    kv_append_op.run(data, layer, k, v, seq_lens, q_offsets.contiguous(), block_tables)


def _check_positions(data, block_tables, seq_lens, bounds: list[int]) -> None:
    """Every token inside its request's capacity, on real blocks (reads values)."""
    room = capacity(data, block_tables)
    ends = []
    for b, start in enumerate(seq_lens.tolist()):
        count = bounds[b + 1] - bounds[b]
        if start < 0:
            raise ValueError(f"seq_lens[{b}] must be >= 0, got {start}")
        if count and start + count > room:
            raise ValueError(
                f"request {b} would write position {start + count - 1} ({start} cached + {count} new), past its "
                f"capacity of {room} positions"
            )
        ends.append(start + count if count else 0)
    check_block_ids(data, block_tables, ends)


# --------------------------------------------------------------------------------------------
# PyTorch reference
# --------------------------------------------------------------------------------------------


def kv_append_reference(data, layer, k, v, seq_lens, q_offsets, block_tables=None) -> None:
    """Readable ``kv_append``: request by request, token by token (inputs assumed valid)."""
    bounds, lengths = q_offsets.tolist(), seq_lens.tolist()
    for b, length in enumerate(lengths):
        for t in range(bounds[b], bounds[b + 1]):
            where = slots(data, block_tables, b, length + t - bounds[b])
            data[layer, 0][where] = k[t]
            data[layer, 1][where] = v[t]
