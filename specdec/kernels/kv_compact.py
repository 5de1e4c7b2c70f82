"""KV compaction: move each request's accepted tree path next to its prefix, in every layer, in place.

For request b with n_b leading non-negative entries in ``accepted_path[b]`` (local node
indices, root first, strictly increasing), the row at ``seq_lens[b] + path[b, j]`` moves
to ``seq_lens[b] + j`` for j < n_b, in every layer, K and V, then ``seq_lens[b] += n_b``.

Work split. A program owns one request's row chunk in a set of slabs (a slab is one layer's
K or V): slabs g, g + G, g + 2G, ... for G programs per request along the slabs. It reads
the path, the length and the block ids once, then copies its slabs one after another.
Moves overlap only inside a slab (a destination can be another row's source) and one
program owns each slab, so no program reads what another writes; within a slab, every
thread loads its source rows before any thread stores a destination (a barrier between).
G is chosen so that a large batch runs a few programs per SM, each copying several slabs,
rather than one short program per slab whose fixed cost (dependent reads of the path, the
length and the block ids before the first row moves, an atomic at the end) would dominate.
The last program of a request (counted with an atomic ticket) advances that request's
length, after every program of the request has read the old one.

Bad paths. The checked public op refuses a path that is not root first (``path[b, 0] == 0``
when non-empty), not strictly increasing, padded with anything but -1, or reaching past the
capacity. Unchecked calls (a GPU hot path, or the bodies called directly) skip any move
whose source or destination lies outside the request's capacity (or, paged, on a block id
outside the pool) and still add n_b; nothing outside the cache is read or written.
"""

from __future__ import annotations

import torch

from specdec.kernels._checks import check_tensor
from specdec.kernels._lanes import lane_alignment, row_lanes
from specdec.kernels._op import register_op
from specdec.kernels._triton import jit, tl, triton
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
def kv_compact_kernel(
    data_ptr,  # stacked cache, integer view; slab s = layer * 2 + kv
    seq_lens_ptr,  # [B] int32, advanced in place by the last program of each request
    path_ptr,  # [B, P] int32 local node indices, -1 padded
    block_tables_ptr,  # [B, max_blocks] int32 (PAGED only)
    tickets_ptr,  # [B] int32, zero between calls; counts finished programs per request
    # sizes
    P,
    ROW,
    SPAN,  # lanes over a row: chunks * ROW_BLOCK
    capacity,
    NUM_BLOCKS,  # blocks in the pool (PAGED only)
    NUM_SLABS,  # layers * 2
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
    ALIGN: tl.constexpr,  # lane_alignment(ROW, SPAN)
):
    # ---- map the program to (request, first slab of its set, chunk of the token row)
    b = tl.program_id(0)  # the batch goes on axis 0, whose size limit is 2^31 - 1 (axes 1, 2: 65535)
    first = tl.program_id(1)
    groups = tl.num_programs(1)  # this program copies slabs first, first + groups, ...
    chunk = tl.program_id(2)

    # ---- the request's path: n leading valid entries; only rows whose position changes move
    j = tl.arange(0, P_BLOCK)
    path = tl.load(path_ptr + b * stride_path + tl.minimum(j, P - 1), mask=j < P, other=-1)
    n = tl.min(tl.where(path < 0, j, P), axis=0)
    start = tl.load(seq_lens_ptr + b)
    src = start + path
    dst = start + j
    move = (j < n) & (src != dst) & (src >= 0) & (src < capacity) & (dst >= 0) & (dst < capacity)
    src = tl.where(move, src, 0)
    dst = tl.where(move, dst, 0)
    if PAGED:
        src_block = tl.load(block_tables_ptr + b * stride_bt + src // PAGE, mask=move, other=0)
        dst_block = tl.load(block_tables_ptr + b * stride_bt + dst // PAGE, mask=move, other=0)
        move = move & (src_block >= 0) & (src_block < NUM_BLOCKS) & (dst_block >= 0) & (dst_block < NUM_BLOCKS)
        src_block = tl.where(move, src_block, 0).to(tl.int64)
        dst_block = tl.where(move, dst_block, 0).to(tl.int64)
        src_off = src_block * stride_req + (src % PAGE).to(tl.int64) * stride_pos
        dst_off = dst_block * stride_req + (dst % PAGE).to(tl.int64) * stride_pos
    else:
        base = b.to(tl.int64) * stride_req
        src_off = base + src.to(tl.int64) * stride_pos
        dst_off = base + dst.to(tl.int64) * stride_pos

    # ---- the request's last program to get here (all others have read seq_lens[b]) advances the length;
    # the copies below use only offsets computed already, and nothing is kept alive across them
    tl.debug_barrier()
    ticket = tl.atomic_add(tickets_ptr + b, 1)
    if ticket == programs_per_request - 1:
        tl.store(seq_lens_ptr + b, start + n)
        tl.store(tickets_ptr + b, 0)

    # ---- per slab: stage every source row in registers, then write the destinations
    e = chunk * ROW_BLOCK + tl.arange(0, ROW_BLOCK)
    mask = move[:, None] & (e < ROW)[None, :]
    e = row_lanes(e, ROW, SPAN, ALIGN)
    slab = first.to(tl.int64) * stride_slab
    step = groups.to(tl.int64) * stride_slab
    for _ in range(first, NUM_SLABS, groups):
        slab_ptr = data_ptr + slab
        rows = tl.load(slab_ptr + src_off[:, None] + e[None, :], mask=mask)
        tl.debug_barrier()  # a destination can be another row's source: all threads read this slab first
        tl.store(slab_ptr + dst_off[:, None] + e[None, :], rows, mask=mask)
        slab += step


# --------------------------------------------------------------------------------------------
# Bodies: the Triton launcher and the PyTorch implementation
# --------------------------------------------------------------------------------------------


# Only the warps are tuned (the row block is fixed by the layout). Never benchmarked by
# triton.autotune: a trial moves rows again and advances the lengths, and restoring the whole
# cache inside every timed trial would time the copy; pin a candidate with ``tuning.use_config``.
# maxnreg: a program holds its rows of a slab in registers; without the allowance ptxas caps some of these
# tiles near 80 registers for occupancy and spills a few bytes (seen on sm_80, Triton 3.6 and 3.9)
KV_COMPACT_SPACE = TuningSpace(candidates(num_warps=(2, 4, 8), maxnreg=(255,)), key=("ROW", "PAGED"),
                               autotune=False)  # fmt: skip

# Programs a launch aims for: a few per SM of a large GPU. Below it every slab gets its own program;
# above it each program copies several slabs, so its fixed cost is paid once for all of them.
FILL_PROGRAMS = 512


def slab_groups(batch: int, slabs: int, chunks: int) -> int:
    """Programs per request and row chunk along the slabs (each copies every ``groups``-th slab)."""
    per_program = min(slabs, max(1, batch * slabs * chunks // FILL_PROGRAMS))
    return triton.cdiv(slabs, per_program)


def kv_compact_triton(data, seq_lens, accepted_path, block_tables, tickets) -> None:
    layers, _, _, _, kv_heads, head_dim = data.shape
    batch, width = accepted_path.shape
    if width == 0:
        return
    bits = BITS_VIEW[data.element_size()]
    row = kv_heads * head_dim
    row_block = min(triton.next_power_of_2(row), MAX_ROW_BLOCK)
    chunks = triton.cdiv(row, row_block)
    groups = slab_groups(batch, layers * 2, chunks)
    paged = block_tables is not None
    args = (
        data.view(bits), seq_lens, accepted_path, block_tables if paged else seq_lens, tickets,
        width, row, chunks * row_block, capacity(data, block_tables), data.shape[2], layers * 2, groups * chunks,
        data.stride(1), data.stride(2), data.stride(3), accepted_path.stride(0),
        block_tables.stride(0) if paged else 0,
    )  # fmt: skip
    meta = dict(
        PAGED=paged, PAGE=data.shape[3] if paged else 1, P_BLOCK=triton.next_power_of_2(max(width, 2)),
        ROW_BLOCK=row_block, ALIGN=lane_alignment(row, chunks * row_block),
    )  # fmt: skip
    launch(kv_compact_kernel, (batch, groups, chunks), args, meta, dict(num_warps=4, maxnreg=255), KV_COMPACT_SPACE)


def kv_compact_torch(data, seq_lens, accepted_path, block_tables, tickets) -> None:
    """Gather every row that moves, then scatter them (selecting the moves is one sync on a GPU)."""
    node = accepted_path.long()
    j = torch.arange(node.shape[1], device=node.device)
    accepted = (node >= 0).cumprod(1).bool()  # the leading valid entries of each row
    start = seq_lens.long()[:, None]
    src, dst = start + node, start + j
    room = capacity(data, block_tables)
    move = accepted & (src != dst) & (torch.minimum(src, dst) >= 0) & (torch.maximum(src, dst) < room)
    b, j = move.nonzero(as_tuple=True)  # a chain has nothing here
    src_at, dst_at = slots(data, block_tables, b, src[b, j]), slots(data, block_tables, b, dst[b, j])
    if block_tables is not None:  # skip moves from or to a block id outside the pool
        inside = (torch.minimum(src_at[0], dst_at[0]) >= 0) & (torch.maximum(src_at[0], dst_at[0]) < data.shape[2])
        if not bool(inside.all()):
            src_at, dst_at = [x[inside] for x in src_at], [x[inside] for x in dst_at]
    rows = data[:, :, src_at[0], src_at[1]].clone()
    data[:, :, dst_at[0], dst_at[1]] = rows
    seq_lens += accepted.sum(1, dtype=torch.int32)


def compact_rows(data, seq_lens, accepted_path, block_tables) -> None:
    """The hot path's PyTorch compaction: no value read back, for paths the caller admitted.

    Every path entry moves (gather all, then scatter all); entries past the accepted ones repeat the
    batch's first accepted move (identical writes; with none, a self-copy of request 0's root
    position). Paths must be valid and inside the capacity -- e.g. from a verification op over
    trees whose K/V this step wrote -- which is what lets this skip the selection ``kv_compact`` makes.
    """
    node = accepted_path.long()
    accepted = (node >= 0).cumprod(1).bool()
    start = seq_lens.long()[:, None]
    home = start.clamp(max=capacity(data, block_tables) - 1)  # the root's own position
    j = torch.arange(node.shape[1], device=node.device)
    src = torch.where(accepted, start + node, home)
    dst = torch.where(accepted, start + j, home)
    b = torch.arange(node.shape[0], device=node.device)[:, None].expand_as(node)
    # Unused entries then repeat the batch's first accepted move: a slot holding no blocks (paused, finished) still
    # names its old ones, which another request may own now, and its self-copy could undo that request's move.
    first = accepted.flatten().int().argmax().view(1)  # (a device index: nothing is read back)
    src, dst, b = (torch.where(accepted, t, t.flatten().index_select(0, first)) for t in (src, dst, b))
    src_at, dst_at = slots(data, block_tables, b, src), slots(data, block_tables, b, dst)
    data[:, :, dst_at[0], dst_at[1]] = data[:, :, src_at[0], src_at[1]]
    seq_lens += accepted.sum(1, dtype=torch.int32)


# --------------------------------------------------------------------------------------------
# Registered op
# --------------------------------------------------------------------------------------------


@register_op(
    "kv_compact", mutates_args=("data", "seq_lens", "tickets"), triton=kv_compact_triton, torch=kv_compact_torch
)
def kv_compact_op(
    data: torch.Tensor,
    seq_lens: torch.Tensor,
    accepted_path: torch.Tensor,
    block_tables: torch.Tensor | None,
    tickets: torch.Tensor,
) -> None:
    """Writes ``data``, advances ``seq_lens``; ``tickets [B]`` int32 zeros (left zero) for the Triton body."""


# --------------------------------------------------------------------------------------------
# Public op
# --------------------------------------------------------------------------------------------


def kv_compact(
    data: torch.Tensor,
    seq_lens: torch.Tensor,
    accepted_path: torch.Tensor,
    block_tables: torch.Tensor | None = None,
    *,
    tickets: torch.Tensor | None = None,
    check_bounds: bool | None = None,
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
    check_bounds : check the path values (see the module docstring) and, paged, the block ids,
        raising ValueError before moving anything. Default: for CPU tensors only (no device sync).

    Example
    -------
    >>> data = torch.arange(8.).view(1, 2, 1, 4, 1, 1)            # 1 layer, B=1, positions 0..3
    >>> seq_lens = torch.tensor([1], dtype=torch.int32)
    >>> kv_compact(data, seq_lens, torch.tensor([[0, 2, -1]], dtype=torch.int32))
    >>> data[0, 0, 0, :, 0, 0].tolist(), seq_lens.tolist()        # node 2 (position 3) -> position 2
    ([0.0, 1.0, 3.0, 3.0], [3])
    """
    check_cache(data, block_tables)
    batch = check_lengths(seq_lens, data, block_tables)
    check_tensor("accepted_path", accepted_path, dtype=torch.int32, shape=(batch, None), device=data.device)
    if accepted_path.stride(-1) != 1:
        raise ValueError("accepted_path must have a contiguous last dim; call .contiguous() first")
    if tickets is None:
        tickets = torch.zeros(batch, dtype=torch.int32, device=data.device)
    check_tensor("tickets", tickets, dtype=torch.int32, shape=(batch,), device=data.device, contiguous=True)
    if check_bounds is None:
        check_bounds = data.device.type == "cpu"
    if check_bounds:
        counts = check_accepted_path(accepted_path, seq_lens, capacity(data, block_tables))
        if block_tables is not None:
            rows, starts = accepted_path.tolist(), seq_lens.tolist()
            check_block_ids(data, block_tables, [s + r[n - 1] + 1 if n else 0 for r, s, n in zip(rows, starts, counts)])
    if accepted_path.shape[1]:
        kv_compact_op.run(data, seq_lens, accepted_path, block_tables, tickets)


def check_accepted_path(accepted_path: torch.Tensor, seq_lens: torch.Tensor, capacity: int) -> list[int]:
    """Check path values (reads them to the host); returns the valid count per request."""
    counts = []
    for b, (row, start) in enumerate(zip(accepted_path.tolist(), seq_lens.tolist())):
        n = next((j for j, node in enumerate(row) if node < 0), len(row))
        if any(node != -1 for node in row[n:]):
            raise ValueError(f"accepted_path[{b}] = {row}: only -1 may follow the first -1")
        if n and row[0] != 0:
            raise ValueError(f"accepted_path[{b}] = {row} must start at the root, node 0")
        for j in range(1, n):
            if row[j] <= row[j - 1]:
                raise ValueError(f"accepted_path[{b}] = {row} must be strictly increasing (root first)")
        if start < 0:
            raise ValueError(f"seq_lens[{b}] must be >= 0, got {start}")
        if n and start + row[n - 1] >= capacity:
            raise ValueError(
                f"accepted_path[{b}] reaches position {start + row[n - 1]}, past the capacity of {capacity}"
            )
        counts.append(n)
    return counts


# --------------------------------------------------------------------------------------------
# PyTorch reference
# --------------------------------------------------------------------------------------------


def kv_compact_reference(data, seq_lens, accepted_path, block_tables=None) -> None:
    """Readable ``kv_compact``: per request, copy the path's rows out, then write them back in order."""
    for b, (row, start) in enumerate(zip(accepted_path.tolist(), seq_lens.tolist())):
        path = row[: next((j for j, node in enumerate(row) if node < 0), len(row))]
        moved = [data[(slice(None), slice(None)) + slots(data, block_tables, b, start + node)].clone() for node in path]
        for j, rows in enumerate(moved):
            data[(slice(None), slice(None)) + slots(data, block_tables, b, start + j)] = rows
        seq_lens[b] += len(path)
