"""What one model forward needs to know about its query tokens besides their ids.

The same forward serves a ragged prefill chunk, one decode token per request and a
token tree per request (verification); only the metadata differs:

    q_offsets  [B+1]  int32  request b owns query rows q_offsets[b] .. q_offsets[b+1]-1
                             (possibly none: a finished request simply sends no rows)
    tree_mask  [Tq, W] int64 bit-packed ancestor-or-self rows (``build_tree_metadata``),
                             or None for causal attention among each request's rows
    tree_start [B]    int32  optional, tree masks only: where each request's tree begins in
                             its cache (default ``seq_lens``); bit j of a mask row is position
                             ``tree_start[b] + j``. A start below ``seq_lens[b]`` makes the
                             queries the newest nodes of a tree whose earlier nodes are already
                             cached (drafting a tree level by level: commit each level with
                             ``KVCache.advance``, attend with the tree's start, truncate after).

Query row i of request b is written to the KV cache at ``seq_lens[b] + i`` and sees
the whole committed prefix. RoPE positions are given separately: ``seq_lens[b] + i``
for causal rows, ``seq_lens[b] + depth`` for tree nodes; the helpers below build
them on the device without a host synchronisation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.kernels._checks import check_tensor


@dataclass(frozen=True)
class AttentionMetadata:
    """Query layout of one forward: ``q_offsets [B+1]`` int32, an optional ``tree_mask [Tq, W]`` int64
    and, with a mask, an optional ``tree_start [B]`` int32 (see the module docstring)."""

    q_offsets: torch.Tensor
    tree_mask: torch.Tensor | None = None
    tree_start: torch.Tensor | None = None

    def __post_init__(self):
        check_tensor("q_offsets", self.q_offsets, dtype=torch.int32, ndim=1)
        if self.q_offsets.numel() < 2:
            raise ValueError(f"q_offsets must hold B+1 >= 2 entries, got {self.q_offsets.numel()}")
        if self.tree_mask is not None:
            check_tensor("tree_mask", self.tree_mask, dtype=torch.int64, ndim=2)
        if self.tree_start is not None:
            if self.tree_mask is None:
                raise ValueError("tree_start applies to tree masks only; causal attention has no cached tree")
            check_tensor("tree_start", self.tree_start, dtype=torch.int32, shape=(self.batch_size,))

    @property
    def causal(self) -> bool:
        return self.tree_mask is None

    @property
    def batch_size(self) -> int:
        return self.q_offsets.numel() - 1


def request_index(q_offsets: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """int64 ``[Tq]``: the request each flattened query row belongs to (empty requests skipped)."""
    rows = torch.arange(num_tokens, device=q_offsets.device, dtype=q_offsets.dtype)
    return torch.searchsorted(q_offsets[1:], rows, right=True)


def causal_positions(
    q_offsets: torch.Tensor, seq_lens: torch.Tensor, num_tokens: int, *, per_request: int | None = None
) -> torch.Tensor:
    """int64 ``[Tq]`` RoPE positions ``seq_lens[b] + i`` of the i-th row of request b.

    ``per_request``: a host fact, every request has exactly this many rows (two ops instead of six).
    """
    if per_request is not None:
        return (seq_lens.long()[:, None] + torch.arange(per_request, device=seq_lens.device)).flatten()
    req = request_index(q_offsets, num_tokens)
    rows = torch.arange(num_tokens, device=q_offsets.device)
    return rows - q_offsets.long()[req] + seq_lens.long()[req]


def tree_positions(q_offsets: torch.Tensor, seq_lens: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
    """int64 ``[Tq]`` RoPE positions ``seq_lens[b] + depth`` of each tree node."""
    req = request_index(q_offsets, depth.numel())
    return seq_lens.long()[req] + depth.long()
