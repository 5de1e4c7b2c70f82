"""What the verification ops (``verify_chain``, ``verify_tree``, ``sample`` and the greedy fast
path) share: their argument checks, their output buffers and the Triton pipeline.

The pipeline, one launch each, no host synchronisation:

1. ``top_k_top_p``: the filter threshold and 1/T of every target row (only filtered rows work);
2. ``target_stats``: per-tile statistics of every row (rows x tiles);
3. ``tree_walk``: the acceptance walk and the final draw (``final_sample``), one program per request.

The stages hand each other their results through scratch tensors (thresholds, tile statistics),
which ``scratch`` takes from a workspace reused from call to call instead of allocating them per
call. Scratch never holds a result: the results are fresh tensors (or the caller's ``out=``) every
call.
"""

from __future__ import annotations

import functools
import math
import threading
from typing import NamedTuple

import torch

from specdec.kernels._checks import check_tensor
from specdec.kernels._triton import cdiv
from specdec.kernels.target_stats import TileStats, row_stats_triton
from specdec.kernels.top_k_top_p import (
    FLOAT_DTYPES,
    ROWS_BY_DRAFT_OFFSETS,
    ROWS_BY_NODE_OFFSETS,
    filter_thresholds_triton,
    vocab_block,
)
from specdec.kernels.tree_walk import tree_walk_triton


def check_logits(logits, name: str = "target_logits") -> torch.device:
    """fp32/fp16/bf16 ``[rows, V]`` with V >= 1; returns its device."""
    if type(logits) is torch.Tensor and logits.dtype in FLOAT_DTYPES and logits.dim() == 2 and logits.shape[1]:
        return logits.device  # (the conditions below, tested at once: every call checks them)
    check_tensor(name, logits, dtype=FLOAT_DTYPES, ndim=2)
    if logits.shape[1] < 1:
        raise ValueError(f"{name} must have a vocabulary of at least 1, got shape {tuple(logits.shape)}")
    return logits.device


def check_request_offsets(name: str, offsets, device: torch.device) -> int:
    """int32 ``[B+1]`` offsets on ``device``; returns B (values are checked where they are read)."""
    if type(offsets) is torch.Tensor and offsets.dtype is torch.int32 and offsets.dim() == 1 and offsets.shape[0]:
        if offsets.device == device:  # (check_tensor's conditions, tested inline: every call checks them)
            return offsets.shape[0] - 1
    check_tensor(name, offsets, dtype=torch.int32, ndim=1, device=device)
    if offsets.numel() < 1:
        raise ValueError(f"{name} must hold B+1 >= 1 entries, got none")
    return offsets.numel() - 1


def check_draft_probs(draft_probs, rows: int, vocab: int, device: torch.device) -> None:
    """Float ``[rows, V]`` on ``device``, sharing the target's vocabulary."""
    if type(draft_probs) is torch.Tensor and draft_probs.dtype in FLOAT_DTYPES and draft_probs.shape == (rows, vocab):
        if draft_probs.device == device:  # (the conditions below, tested inline)
            return
    check_tensor("draft_probs", draft_probs, dtype=FLOAT_DTYPES, ndim=2, device=device)
    if draft_probs.shape[1] != vocab:
        raise ValueError(
            f"draft_probs has vocabulary {draft_probs.shape[1]} but target_logits has {vocab}: "
            "draft and target must share one vocabulary"
        )
    if draft_probs.shape[0] != rows:
        raise ValueError(f"draft_probs must have {rows} rows, got shape {tuple(draft_probs.shape)}")


def check_width(name: str, value) -> int:
    """A host int >= 0 (``max_draft_len`` / ``max_depth``)."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return value


class _ResultFields(dict):
    """result type -> ((2-D?, dtype) per field), made on first use (every call allocates its results)."""

    def __missing__(self, result_type):
        wide = ("output_tokens", "accepted_path")
        kinds = tuple((f in wide, torch.bool if f == "invalid" else torch.int32) for f in result_type._fields)
        self[result_type] = kinds
        return kinds


_RESULT_FIELDS = _ResultFields()
_empty = torch.empty


def result_buffers(out, result_type: type[NamedTuple], batch: int, width: int, device: torch.device):
    """``out`` checked field by field (a ``result_type``, same fields and order as the op returns), or
    fresh buffers: ``[batch, width]`` int32 for 2-D fields (unit last stride), ``[batch]`` for the rest."""
    if out is None:  # (sizes as separate ints: torch parses them faster than a shape tuple)
        return tuple.__new__(result_type, [_empty(batch, width, dtype=dtype, device=device) if wide
                                           else _empty(batch, dtype=dtype, device=device)
                                           for wide, dtype in _RESULT_FIELDS[result_type]])  # fmt: skip
    specs = {
        "output_tokens": ((batch, width), torch.int32),
        "accepted_path": ((batch, width), torch.int32),
        "num_accepted": ((batch,), torch.int32),
        "invalid": ((batch,), torch.bool),
        "tokens": ((batch,), torch.int32),
    }
    if not isinstance(out, result_type):
        raise TypeError(f"out must be a {result_type.__name__}, got {type(out).__name__}")
    for field, value in zip(result_type._fields, out):
        shape, dtype = specs[field]
        check_tensor(f"out.{field}", value, dtype=dtype, shape=shape, device=device, contiguous=len(shape) == 1)
        if value.dim() == 2 and value.stride(-1) != 1:
            raise ValueError(f"out.{field} must have unit stride in its last dimension")
    return out


# ----------------------------------------------------------------------------- scratch workspace

_workspaces = threading.local()  # per thread: {(device, CUDA stream id): Workspace}
MAX_LAYOUTS = 32  # carved layouts kept per workspace (each a handful of views); more start over


class Workspace:
    """One flat buffer of 4-byte words per (thread, device, CUDA stream), the views carved from it, and
    read-only zero tensors.

    The kernels of one call run in order on one stream, and every stage writes its scratch before the
    next reads it, so consecutive calls on the same stream may share the words. A layout that does
    not fit replaces the buffer by a larger one (the old one is freed once its views are dropped; on
    CUDA the caching allocator reuses it in stream order)."""

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None
        self.views: dict[tuple, tuple[torch.Tensor, ...]] = {}
        self.zeros: dict[int, torch.Tensor] = {}


def _workspace(device: torch.device) -> Workspace | None:
    """This thread's workspace for ``device`` and its current CUDA stream; None while a CUDA graph is being
    captured (the graph then owns fresh allocations)."""
    spaces = getattr(_workspaces, "by_place", None)
    if spaces is None:
        spaces = _workspaces.by_place = {}
    space = spaces.get(device)  # a device without streams: its workspace is keyed by the device alone
    if space is not None:
        return space
    if device.type == "cuda":
        if torch.cuda.is_current_stream_capturing():
            return None
        where = (device, torch.cuda.current_stream(device).stream_id)
    else:
        where = device
    space = spaces.get(where)
    if space is None:
        space = spaces[where] = Workspace()
    return space


class Layout(tuple):
    """A scratch layout (``scratch``'s argument and cache key) that hashes once, not at every lookup."""

    def __new__(cls, entries):
        self = super().__new__(cls, entries)
        self.hash = tuple.__hash__(self)
        return self

    def __hash__(self) -> int:
        return self.hash


def scratch(device: torch.device, layout: tuple[tuple[tuple[int, ...], torch.dtype], ...]) -> tuple[torch.Tensor, ...]:
    """Uninitialised tensors of the shapes and 4-byte dtypes in ``layout`` (also the cache key: a ``Layout``
    where the caller keeps one), reused by
    every call with the same layout on this thread, device and CUDA stream: a caller writes what it
    reads within its call and never returns or keeps them."""
    space = _workspace(device)
    if space is None:
        return tuple(torch.empty(shape, dtype=dtype, device=device) for shape, dtype in layout)
    views = space.views.get(layout)
    if views is None:
        views = _carve(space, device, layout)
    return views


def zero_offsets(device: torch.device, n: int) -> torch.Tensor:
    """int32 zeros ``[n]`` that no kernel writes (offsets of requests without drafts), made once per workspace."""
    space = _workspace(device)
    if space is None:
        return torch.zeros(n, dtype=torch.int32, device=device)
    zeros = space.zeros.get(n)
    if zeros is None:
        with torch.inference_mode(False):
            zeros = space.zeros[n] = torch.zeros(n, dtype=torch.int32, device=device)
    return zeros


def _carve(space: Workspace, device: torch.device, layout) -> tuple[torch.Tensor, ...]:
    sizes = [math.prod(shape) for shape, _ in layout]
    words = [-(-n // 4) * 4 for n in sizes]  # each view starts 16-byte aligned, as fresh allocations do
    with torch.inference_mode(False):  # usable inside and outside inference mode alike
        if space.buffer is None or space.buffer.numel() < sum(words):
            space.buffer = torch.empty(max(sum(words), 1024), dtype=torch.int32, device=device)
            space.views.clear()
        if len(space.views) >= MAX_LAYOUTS:
            space.views.clear()
        views, at = [], 0
        for (shape, dtype), n, w in zip(layout, sizes, words):
            views.append(space.buffer[at : at + n].view(dtype).view(shape))
            at += w
    views = space.views[layout] = tuple(views)
    return views


@functools.lru_cache(maxsize=256)
def _pipeline_plan(rows: int, vocab: int, batch: int, width: int) -> tuple[int, Layout]:
    """(vocabulary tile, scratch layout) of ``verify_triton``: thr, inv_row [R]; tile max,
    sum, arg, bad [R, T]; a path [B, W] and counts [B] for callers that do not want them."""
    block = vocab_block(vocab)
    n_tiles = cdiv(vocab, block)
    f32, i32 = torch.float32, torch.int32
    tiles = (rows, n_tiles)
    layout = Layout((((rows,), f32), ((rows,), f32), (tiles, f32), (tiles, f32), (tiles, i32), (tiles, i32),
                     ((batch, width), i32), ((batch,), i32)))  # fmt: skip
    return block, layout


def tree_depth(parents: torch.Tensor, bounds: list[int]) -> int:
    """Deepest node over the batch (a host loop that also validates the parent arrays)."""
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


def verify_triton(logits, tokens, parents, offsets, draft_probs, params, out, *, rule: str, chain: bool) -> None:
    """The whole Triton pipeline, writing ``out`` = (output_tokens, num_accepted, accepted_path, invalid)
    (``TreeVerifyResult``'s order) in place; a None num_accepted or accepted_path goes to scratch.
    ``params`` = (temperature, top_k, top_p, seed, offset). With ``chain``, ``tokens`` and ``offsets``
    are draft tokens and draft offsets, ``parents`` unread."""
    batch = offsets.shape[0] - 1
    if batch == 0:
        return
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    q = logits  # a stand-in the deterministic rule never reads
    if draft_probs is not None:
        q = draft_probs if draft_probs.stride(-1) == 1 else draft_probs.contiguous()
    (rows, vocab), output_tokens = logits.shape, out[0]
    width = output_tokens.shape[1]
    block, layout = _pipeline_plan(rows, vocab, batch, width)
    thr, inv_row, *tiles, path, num_acc = scratch(logits.device, layout)
    out = (output_tokens, num_acc if out[1] is None else out[1], path if out[2] is None else out[2], out[3])
    temperature, top_k, top_p, _seed, _offset = params
    rows_of = ROWS_BY_DRAFT_OFFSETS if chain else ROWS_BY_NODE_OFFSETS
    filter_thresholds_triton(logits, temperature, top_k, top_p, block, rows_of, offsets, out=(thr, inv_row))
    stats = row_stats_triton(logits, inv_row, thr, block, out=TileStats(*tiles))
    tree_walk_triton(logits, tokens, parents, offsets, q, thr, stats, params, out, rule=rule, chain=chain,
                     block=block, width=width)  # fmt: skip
