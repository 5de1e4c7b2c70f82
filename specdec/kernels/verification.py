"""What the verification ops (``verify_chain``, ``verify_tree``, ``sample`` and the greedy fast
path) share: their argument checks, their output buffers and the Triton pipeline.

The pipeline, one launch each, no host synchronisation:

1. ``top_k_top_p``: the filter threshold and 1/T of every target row (only filtered rows work);
2. ``target_stats``: per-tile statistics of every row (rows x tiles);
3. ``tree_walk``: the acceptance walk (one program per request);
4. ``final_sample``: per-tile mass of each final distribution (requests x tiles), then the draw.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from specdec.kernels._checks import check_tensor
from specdec.kernels.final_sample import final_sample_triton
from specdec.kernels.target_stats import row_stats_triton
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
    check_tensor(name, logits, dtype=FLOAT_DTYPES, ndim=2)
    if logits.shape[1] < 1:
        raise ValueError(f"{name} must have a vocabulary of at least 1, got shape {tuple(logits.shape)}")
    return logits.device


def check_request_offsets(name: str, offsets, device: torch.device) -> int:
    """int32 ``[B+1]`` offsets on ``device``; returns B (values are checked where they are read)."""
    check_tensor(name, offsets, dtype=torch.int32, ndim=1, device=device)
    if offsets.numel() < 1:
        raise ValueError(f"{name} must hold B+1 >= 1 entries, got none")
    return offsets.numel() - 1


def check_draft_probs(draft_probs, rows: int, vocab: int, device: torch.device) -> None:
    """Float ``[rows, V]`` on ``device``, sharing the target's vocabulary."""
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


def result_buffers(out, result_type: type[NamedTuple], batch: int, width: int, device: torch.device):
    """``out`` checked field by field (a ``result_type``, same fields and order as the op returns), or
    fresh buffers: ``[batch, width]`` int32 for 2-D fields (unit last stride), ``[batch]`` for the rest."""
    specs = {
        "output_tokens": ((batch, width), torch.int32),
        "accepted_path": ((batch, width), torch.int32),
        "num_accepted": ((batch,), torch.int32),
        "invalid": ((batch,), torch.bool),
        "tokens": ((batch,), torch.int32),
    }
    if out is None:
        return result_type(*(torch.empty(*specs[f][0], dtype=specs[f][1], device=device) for f in result_type._fields))
    if not isinstance(out, result_type):
        raise TypeError(f"out must be a {result_type.__name__}, got {type(out).__name__}")
    for field, value in zip(result_type._fields, out):
        shape, dtype = specs[field]
        check_tensor(f"out.{field}", value, dtype=dtype, shape=shape, device=device, contiguous=len(shape) == 1)
        if value.dim() == 2 and value.stride(-1) != 1:
            raise ValueError(f"out.{field} must have unit stride in its last dimension")
    return out


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
    (``TreeVerifyResult``'s order) in place; ``params`` = (temperature, top_k, top_p, seed, offset).
    With ``chain``, ``tokens`` and ``offsets`` are draft tokens and draft offsets, ``parents`` unread."""
    batch = offsets.numel() - 1
    if batch == 0:
        return
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    q = logits if draft_probs is None else draft_probs  # a stand-in the deterministic rule never reads
    if q.stride(-1) != 1:
        q = q.contiguous()
    device, width, block = logits.device, out[0].shape[1], vocab_block(logits.shape[1])
    temperature, top_k, top_p, _seed, _offset = params
    rows = ROWS_BY_DRAFT_OFFSETS if chain else ROWS_BY_NODE_OFFSETS
    thr, inv_row = filter_thresholds_triton(logits, temperature, top_k, top_p, block, rows, offsets)
    stats = row_stats_triton(logits, inv_row, thr, block)
    fin_i = torch.empty(batch, 4, dtype=torch.int32, device=device)
    fin_f = torch.empty(batch, 2, dtype=torch.float32, device=device)
    tree_walk_triton(logits, tokens, parents, offsets, q, thr, stats, params, out, fin_i, fin_f,
                     rule=rule, chain=chain, block=block, width=width)  # fmt: skip
    final_sample_triton(logits, tokens, parents, q, thr, inv_row, stats, params, fin_i, fin_f, out[0], out[1],
                        rule=rule, chain=chain, block=block)  # fmt: skip
