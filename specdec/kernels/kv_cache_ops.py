"""KV-cache ops: append new K/V after each request's prefix, and compact accepted tree paths in place.

Both ops work on one stacked cache tensor that holds every layer, so one launch
covers all layers:

    contiguous  data [L, 2, B, max_len, Hkv, D]           (2 = K, V)
    paged       data [L, 2, num_blocks, block_size, Hkv, D] with block_tables [B, max_blocks] int32

Position p of request b lives at ``data[l, kv, b, p]`` (contiguous) or at
``data[l, kv, block_tables[b, p // block_size], p % block_size]`` (paged). Each
position holds one token row of ``Hkv * D`` contiguous elements in both layouts,
which is what the kernels copy. They copy bits (the cache is viewed as integers
of the same width), so every move is exact whatever the float dtype.

``kv_append`` writes token i of request b at position ``seq_lens[b] + i``.
``kv_compact`` moves, for every layer, K and V, and every request, the node at
``seq_lens[b] + path[b, j]`` to ``seq_lens[b] + j`` and adds the number of valid
path entries to ``seq_lens[b]``, all in one launch. Paths list increasing node
indices (root first), so a destination never lies after its source; within a
program every source row is loaded before any destination row is stored, which
makes overlapping moves safe. The last program of a request (counted with an
atomic ticket) advances that request's length, after every program of the request
has read the old one.
"""

from __future__ import annotations

import torch

from specdec import _backend
from specdec.kernels._checks import check_offsets, check_same_device, check_tensor
from specdec.kernels._triton import jit, tl, triton

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# The kernels copy raw bits through an integer view of the same width.
_BITS_VIEW = {2: torch.int16, 4: torch.int32}
_MAX_ROW_BLOCK = 1024


# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------


@jit
def _kv_append_kernel(
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
    capacity,  # positions per request
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
):
    # ---- map the program to (token, chunk of its row) and the token to its request
    t = tl.program_id(0)
    chunk = tl.program_id(1)
    r = tl.arange(0, B_BLOCK)
    ends = tl.load(q_offsets_ptr + 1 + r, mask=r < B, other=2147483647)
    b = tl.sum((ends <= t).to(tl.int32), axis=0)
    in_batch = b < B
    b = tl.minimum(b, B - 1)
    pos = tl.load(seq_lens_ptr + b) + t - tl.load(q_offsets_ptr + b)
    ok = in_batch & (pos >= 0) & (pos < capacity)  # never outside the request's slots
    pos = tl.minimum(tl.maximum(pos, 0), capacity - 1)
    if PAGED:
        block = tl.load(block_tables_ptr + b * stride_bt + pos // PAGE).to(tl.int64)
        dst = block * stride_req + (pos % PAGE).to(tl.int64) * stride_pos
    else:
        dst = b.to(tl.int64) * stride_req + pos.to(tl.int64) * stride_pos

    # ---- copy the row chunk of K and of V
    e = chunk * ROW_BLOCK + tl.arange(0, ROW_BLOCK)
    emask = e < tl.where(ok, ROW, 0)  # (a scalar & vector of bools is not a bool mask in the interpreter)
    h = e // D
    d = e % D
    t64 = t.to(tl.int64)
    k_row = tl.load(k_ptr + t64 * stride_kt + h * stride_kh + d, mask=emask)
    v_row = tl.load(v_ptr + t64 * stride_vt + h * stride_vh + d, mask=emask)
    tl.store(data_ptr + dst + e, k_row, mask=emask)
    tl.store(data_ptr + stride_kv + dst + e, v_row, mask=emask)


@jit
def _kv_compact_kernel(
    data_ptr,  # stacked cache, integer view; slab s = layer * 2 + kv
    seq_lens_ptr,  # [B] int32, advanced in place by the last program of each request
    path_ptr,  # [B, P] int32 local node indices, -1 padded
    block_tables_ptr,  # [B, max_blocks] int32 (PAGED only)
    tickets_ptr,  # [B] int32, zero between calls; counts finished programs per request
    # sizes
    P,
    ROW,
    capacity,
    programs_per_request,
    # strides (elements)
    stride_slab,
    stride_req,  # request (contiguous) or block (paged)
    stride_pos,
    stride_path,
    stride_bt,
    # meta-parameters
    PAGED: tl.constexpr,
    PAGE: tl.constexpr,
    P_BLOCK: tl.constexpr,
    ROW_BLOCK: tl.constexpr,
):
    # ---- map the program to (request, layer/kv slab, chunk of the token row)
    b = tl.program_id(0)  # the batch goes on axis 0, whose size limit is 2^31 - 1 (axes 1, 2: 65535)
    slab = tl.program_id(1)
    chunk = tl.program_id(2)

    # ---- the request's path: n leading valid entries; only rows whose position changes move
    j = tl.arange(0, P_BLOCK)
    path = tl.load(path_ptr + b * stride_path + j, mask=j < P, other=-1)
    n = tl.min(tl.where(path < 0, j, P), axis=0)
    start = tl.load(seq_lens_ptr + b)
    src = start + path
    dst = start + j
    move = (j < n) & (src != dst) & (src < capacity) & (dst >= 0)
    src = tl.where(move, src, 0)
    dst = tl.where(move, dst, 0)
    if PAGED:
        src_block = tl.load(block_tables_ptr + b * stride_bt + src // PAGE, mask=move, other=0).to(tl.int64)
        dst_block = tl.load(block_tables_ptr + b * stride_bt + dst // PAGE, mask=move, other=0).to(tl.int64)
        src_off = src_block * stride_req + (src % PAGE).to(tl.int64) * stride_pos
        dst_off = dst_block * stride_req + (dst % PAGE).to(tl.int64) * stride_pos
    else:
        base = b.to(tl.int64) * stride_req
        src_off = base + src.to(tl.int64) * stride_pos
        dst_off = base + dst.to(tl.int64) * stride_pos

    # ---- stage every source row in registers, then write the destinations
    e = chunk * ROW_BLOCK + tl.arange(0, ROW_BLOCK)
    mask = move[:, None] & (e < ROW)[None, :]
    slab_ptr = data_ptr + slab.to(tl.int64) * stride_slab
    rows = tl.load(slab_ptr + src_off[:, None] + e[None, :], mask=mask)
    tl.debug_barrier()  # a destination can be another row's source: all threads finish reading first
    tl.store(slab_ptr + dst_off[:, None] + e[None, :], rows, mask=mask)

    # ---- the request's last program (all others have read seq_lens[b]) advances the length
    tl.debug_barrier()
    ticket = tl.atomic_add(tickets_ptr + b, 1)
    if ticket == programs_per_request - 1:
        tl.store(seq_lens_ptr + b, start + n)
        tl.store(tickets_ptr + b, 0)


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------


def _row_block(row: int) -> int:
    return min(triton.next_power_of_2(row), _MAX_ROW_BLOCK)


def _layout_strides(data: torch.Tensor) -> tuple[int, int]:
    # (request or block stride, position stride) of one [2, ...] slab: dims 2 and 3 of data
    return data.stride(2), data.stride(3)


def _launch_append(data, layer, k, v, seq_lens, q_offsets, block_tables) -> None:
    T, Hkv, D = k.shape
    if T == 0:
        return
    bits = _BITS_VIEW[data.element_size()]
    slab = data[layer].view(bits)
    row = Hkv * D
    row_block = _row_block(row)
    stride_req, stride_pos = _layout_strides(data)
    paged = block_tables is not None
    B = seq_lens.shape[0]
    grid = (T, triton.cdiv(row, row_block))
    _kv_append_kernel[grid](
        k.view(bits),
        v.view(bits),
        slab,
        seq_lens,
        q_offsets,
        block_tables if paged else seq_lens,
        B,
        row,
        D,
        _capacity(data, block_tables),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        data.stride(1),
        stride_req,
        stride_pos,
        block_tables.stride(0) if paged else 0,
        PAGED=paged,
        PAGE=data.shape[3] if paged else 1,
        B_BLOCK=triton.next_power_of_2(max(B, 2)),
        ROW_BLOCK=row_block,
    )


def _launch_compact(data, seq_lens, accepted_path, block_tables, tickets) -> None:
    L, _, _, _, Hkv, D = data.shape
    B, P = accepted_path.shape
    bits = _BITS_VIEW[data.element_size()]
    row = Hkv * D
    row_block = _row_block(row)
    chunks = triton.cdiv(row, row_block)
    stride_req, stride_pos = _layout_strides(data)
    paged = block_tables is not None
    grid = (B, L * 2, chunks)
    _kv_compact_kernel[grid](
        data.view(bits),
        seq_lens,
        accepted_path,
        block_tables if paged else seq_lens,
        tickets,
        P,
        row,
        _capacity(data, block_tables),
        L * 2 * chunks,
        data.stride(1),
        stride_req,
        stride_pos,
        accepted_path.stride(0),
        block_tables.stride(0) if paged else 0,
        PAGED=paged,
        PAGE=data.shape[3] if paged else 1,
        P_BLOCK=triton.next_power_of_2(max(P, 2)),
        ROW_BLOCK=row_block,
    )


# --------------------------------------------------------------------------------------------
# Public ops
# --------------------------------------------------------------------------------------------


def kv_append(
    data: torch.Tensor,
    layer: int,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_lens: torch.Tensor,
    q_offsets: torch.Tensor,
    block_tables: torch.Tensor | None = None,
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

    The caller guarantees that every written position lies inside the request's capacity
    (``KVCache`` checks that on the host before calling); the Triton kernel also drops any
    row that would fall outside the request's slots rather than write out of bounds.

    Example
    -------
    >>> data = torch.zeros(1, 2, 2, 8, 1, 4)                       # 1 layer, B=2, max_len 8
    >>> k = torch.arange(12.).view(3, 1, 4); v = -k
    >>> kv_append(data, 0, k, v, torch.tensor([2, 5], dtype=torch.int32),
    ...           torch.tensor([0, 1, 3], dtype=torch.int32))
    >>> data[0, 0, 1, 5:7, 0, 0].tolist()                          # tokens 1, 2 at positions 5, 6
    [4.0, 8.0]
    """
    _check_cache(data, block_tables)
    L, _, _, _, Hkv, D = data.shape
    if not isinstance(layer, int) or not 0 <= layer < L:
        raise ValueError(f"layer must be an int in [0, {L}), got {layer!r}")
    device = data.device
    check_tensor("k", k, dtype=data.dtype, ndim=3, device=device)
    check_tensor("v", v, dtype=data.dtype, shape=(k.shape[0], Hkv, D), device=device)
    check_tensor("k", k, shape=(None, Hkv, D))
    for name, t in (("k", k), ("v", v)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dim; call .contiguous() first")
    B = _check_lengths(seq_lens, data, block_tables)
    check_tensor("q_offsets", q_offsets, dtype=torch.int32, shape=(B + 1,), device=device)
    if q_offsets.is_cpu:  # free to check here; on a GPU it would cost a sync
        check_offsets("q_offsets", q_offsets, total=k.shape[0])
    if _backend.select_backend(data) == "triton":
        _launch_append(data, layer, k, v, seq_lens, q_offsets.contiguous(), block_tables)
    else:
        kv_append_reference(data, layer, k, v, seq_lens, q_offsets, block_tables)


def kv_compact(
    data: torch.Tensor,
    seq_lens: torch.Tensor,
    accepted_path: torch.Tensor,
    block_tables: torch.Tensor | None = None,
    *,
    tickets: torch.Tensor | None = None,
) -> None:
    """Move each request's accepted tree path to the positions right after its prefix, in place.

    For every layer, K and V, and request b with n_b leading non-negative entries in
    ``accepted_path[b]``: the row at position ``seq_lens[b] + accepted_path[b, j]`` moves to
    ``seq_lens[b] + j`` (j < n_b), then ``seq_lens[b] += n_b``. One launch on the Triton path,
    no host synchronisation. Rows that stay where they are (a chain ``0..a``) are not touched.

    Parameters
    ----------
    data : float16, bfloat16 or float32, contiguous; the stacked cache ``[L, 2, B, max_len, Hkv, D]``
        or, with ``block_tables``, ``[L, 2, num_blocks, block_size, Hkv, D]``.
    seq_lens : ``[B]`` int32; committed tokens per request, advanced in place.
    accepted_path : ``[B, P]`` int32; local node indices of the accepted path, root (0) first,
        strictly increasing, padded with -1 after the last accepted node. A row of -1 is a no-op.
    block_tables : ``[B, max_blocks]`` int32 (paged only).
    tickets : ``[B]`` int32 zeros the Triton kernel uses to find each request's last program
        (left zero again afterwards); allocated per call when not given.

    Values are checked for CPU inputs (no sync needed); on a GPU the kernel skips moves whose
    source lies outside the request's capacity instead of reading out of bounds.

    Example
    -------
    >>> data = torch.arange(8.).view(1, 2, 1, 4, 1, 1)            # 1 layer, B=1, positions 0..3
    >>> seq_lens = torch.tensor([1], dtype=torch.int32)
    >>> kv_compact(data, seq_lens, torch.tensor([[0, 2, -1]], dtype=torch.int32))
    >>> data[0, 0, 0, :, 0, 0].tolist(), seq_lens.tolist()        # node 2 (position 3) -> position 2
    ([0.0, 1.0, 3.0, 3.0], [3])
    """
    _check_cache(data, block_tables)
    B = _check_lengths(seq_lens, data, block_tables)
    check_tensor("accepted_path", accepted_path, dtype=torch.int32, shape=(B, None), device=data.device)
    if accepted_path.stride(-1) != 1:
        raise ValueError("accepted_path must have a contiguous last dim; call .contiguous() first")
    if accepted_path.is_cpu:
        check_accepted_path(accepted_path, seq_lens, _capacity(data, block_tables))
    if accepted_path.shape[1] == 0:
        return
    if _backend.select_backend(data) == "triton":
        if tickets is None:
            tickets = torch.zeros(B, dtype=torch.int32, device=data.device)
        check_tensor("tickets", tickets, dtype=torch.int32, shape=(B,), device=data.device, contiguous=True)
        _launch_compact(data, seq_lens, accepted_path, block_tables, tickets)
    else:
        kv_compact_reference(data, seq_lens, accepted_path, block_tables)


def check_accepted_path(accepted_path: torch.Tensor, seq_lens: torch.Tensor, capacity: int) -> list[int]:
    """Check path values (reads them to the host); returns the valid count per request."""
    counts = []
    for b, (row, start) in enumerate(zip(accepted_path.tolist(), seq_lens.tolist())):
        n = next((j for j, node in enumerate(row) if node < 0), len(row))
        if any(node != -1 for node in row[n:]):
            raise ValueError(f"accepted_path[{b}] = {row}: only -1 may follow the first -1")
        for j in range(1, n):
            if row[j] <= row[j - 1]:
                raise ValueError(f"accepted_path[{b}] = {row} must be strictly increasing (root first)")
        if n and start + row[n - 1] >= capacity:
            raise ValueError(
                f"accepted_path[{b}] reaches position {start + row[n - 1]}, past the capacity of {capacity}"
            )
        counts.append(n)
    return counts


def _capacity(data: torch.Tensor, block_tables: torch.Tensor | None) -> int:
    return data.shape[3] if block_tables is None else block_tables.shape[1] * data.shape[3]


def _check_cache(data: torch.Tensor, block_tables: torch.Tensor | None) -> None:
    check_tensor("data", data, dtype=DTYPES, ndim=6, contiguous=True)
    if data.shape[1] != 2:
        raise ValueError(f"data must have shape [L, 2, ...] (K and V), got {tuple(data.shape)}")
    if block_tables is not None:
        check_tensor("block_tables", block_tables, dtype=torch.int32, ndim=2, device=data.device, contiguous=True)


def _check_lengths(seq_lens: torch.Tensor, data: torch.Tensor, block_tables: torch.Tensor | None) -> int:
    check_tensor("seq_lens", seq_lens, dtype=torch.int32, ndim=1, device=data.device, contiguous=True)
    B = seq_lens.shape[0]
    if B == 0:
        raise ValueError("seq_lens is empty: the batch needs at least one request")
    rows = data.shape[2] if block_tables is None else block_tables.shape[0]
    if block_tables is None and B > rows:
        raise ValueError(f"seq_lens has {B} requests but data holds {rows} request rows")
    if block_tables is not None and B != rows:
        raise ValueError(f"seq_lens has {B} requests but block_tables has {rows} rows")
    check_same_device(data=data, seq_lens=seq_lens)
    return B


# --------------------------------------------------------------------------------------------
# PyTorch references
# --------------------------------------------------------------------------------------------


def _slots(data, block_tables, b, pos):
    """Index tuple for dims 2 and 3 of ``data`` addressing positions ``pos`` of request(s) ``b``."""
    if block_tables is None:
        return b, pos
    page = data.shape[3]
    return block_tables[b, pos // page].long(), pos % page


def kv_append_reference(data, layer, k, v, seq_lens, q_offsets, block_tables=None) -> None:
    """Readable PyTorch ``kv_append`` (no host synchronisation)."""
    t = torch.arange(k.shape[0], device=k.device)
    b = torch.searchsorted(q_offsets[1:].long().contiguous(), t, right=True)  # request of each token
    pos = seq_lens.long()[b] + t - q_offsets.long()[b]
    where = _slots(data, block_tables, b, pos)
    data[layer, 0][where] = k
    data[layer, 1][where] = v


def kv_compact_reference(data, seq_lens, accepted_path, block_tables=None) -> None:
    """Readable PyTorch ``kv_compact``: gather every row that moves, then scatter them (one sync on a GPU)."""
    node = accepted_path.long()
    j = torch.arange(node.shape[1], device=node.device)
    accepted = (node >= 0).cumprod(1).bool()  # the leading valid entries of each row
    b, j = (accepted & (node != j)).nonzero(as_tuple=True)  # a chain has nothing here
    start = seq_lens.long()[b]
    rows = data[(slice(None), slice(None)) + _slots(data, block_tables, b, start + node[b, j])].clone()
    data[(slice(None), slice(None)) + _slots(data, block_tables, b, start + j)] = rows
    seq_lens += accepted.sum(1, dtype=torch.int32)
