"""CUDA-graph replay of a model's planned forward: one graph replay per decode / verify / draft forward.

A forward whose plan is built from *bounds* instead of this step's sizes has static shapes: rows
padded to a bucket (1, 2, 4, ... ``max(BUCKETS)``), contexts bounded by the cache's capacity, the
mask as wide as the bucket. ``CudaGraphs`` keeps, per (cache, bucket, mask width, logits rows),
static input buffers, the plan built from them and a ``torch.cuda.CUDAGraph`` of ``plan + run``;
a forward copies its inputs into the buffers and replays. Rows past the real ones belong to no
request: the Triton K/V write drops them, attention never computes them, and their (finite or
not) values stay in their own rows through the row-wise norms and GEMMs; results are sliced off.
(Hence the Triton path only: the PyTorch path's K/V write has no rows to drop them into.)

What may change between replays without a new capture, because the graph reads it from the same
addresses: the tokens, positions, offsets and mask (copied in), the cache's ``seq_lens``,
``block_tables`` (updated in place by ``KVCache``) and its data. Host bookkeeping (the cache's
reservation) runs eagerly before each replay. A new cache (a new ``stream`` call) captures anew.

Replay and eager ``run`` under the same plan give the same bits (a gpu-marked test); the plan's
context bound is the capacity, so on the Triton path a replayed forward may split a context
over more programs than an eager forward planned for the exact length would (same math, other
rounding).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from specdec.model.attention_metadata import AttentionMetadata
from specdec.model.forward_plan import admit_forward, build_plan

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)  # rows per forward that get a graph


@dataclass
class _Captured:
    """One graph and the static buffers it reads and writes."""

    tokens: torch.Tensor  # [Tp] int64
    positions: torch.Tensor  # [Tp] int64
    metadata: AttentionMetadata  # q_offsets [B+1] int32, tree_mask [Tp, W] int64 or None
    logits_rows: torch.Tensor | None  # [Rp] int64
    graph: torch.cuda.CUDAGraph | None = None
    outputs: tuple[torch.Tensor, torch.Tensor] | None = None


class CudaGraphs:
    """Replays ``model.run`` from CUDA graphs; see the module docstring.

    ``forward(tokens, positions, metadata, cache, logits_rows)`` takes ``LlamaModel.forward``'s
    arguments and returns its results, or None when the forward cannot be replayed (not on CUDA,
    more rows than the largest bucket, an incremental tree with ``tree_start``): the caller then
    runs it eagerly. ``replays`` counts the replays (one per replayed forward).
    """

    def __init__(self, model, buckets: tuple[int, ...] = BUCKETS):
        if not buckets or any(not isinstance(b, int) or b < 1 for b in buckets):
            raise ValueError(f"buckets must be positive ints, got {buckets!r}")
        self.model, self.buckets = model, tuple(sorted(buckets))
        self._graphs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # cache -> {key: _Captured}
        self.replays = 0

    def forward(self, tokens, positions, metadata: AttentionMetadata, cache, logits_rows=None):
        num_tokens = tokens.shape[0]
        if (
            not tokens.is_cuda
            or num_tokens == 0
            or num_tokens > self.buckets[-1]
            or metadata.tree_start is not None
            or (logits_rows is not None and logits_rows.shape[0] > self.buckets[-1])
        ):
            return None
        admit_forward(self.model, tokens, positions, metadata, cache)  # checks + host bookkeeping
        padded = next(b for b in self.buckets if b >= num_tokens)
        rows = None if logits_rows is None else next(b for b in self.buckets if b >= logits_rows.shape[0])
        width = 0 if metadata.tree_mask is None else metadata.tree_mask.shape[1]
        graphs = self._graphs.setdefault(cache, {})
        captured = graphs.get((padded, width, rows))
        fresh = captured is None
        if fresh:
            captured = graphs[padded, width, rows] = self._buffers(cache, padded, width, rows)
        captured.tokens[:num_tokens].copy_(tokens, non_blocking=True)
        captured.positions[:num_tokens].copy_(positions, non_blocking=True)
        captured.metadata.q_offsets.copy_(metadata.q_offsets, non_blocking=True)
        if width:
            captured.metadata.tree_mask[:num_tokens].copy_(metadata.tree_mask, non_blocking=True)
        if rows is not None:
            captured.logits_rows[: logits_rows.shape[0]].copy_(logits_rows, non_blocking=True)
        if fresh:
            self._capture(captured, cache, graphs)
        captured.graph.replay()
        self.replays += 1
        logits, hidden = captured.outputs
        count = num_tokens if logits_rows is None else logits_rows.shape[0]
        return logits[:count].clone(), hidden[:num_tokens].clone()  # the buffers are rewritten by the next replay

    def _buffers(self, cache, padded: int, width: int, rows: int | None) -> _Captured:
        device = cache.device
        mask = torch.zeros(padded, width, dtype=torch.int64, device=device) if width else None
        metadata = AttentionMetadata(torch.zeros(cache.batch_size + 1, dtype=torch.int32, device=device), mask)
        logits_rows = None if rows is None else torch.zeros(rows, dtype=torch.int64, device=device)
        zeros = torch.zeros(padded, dtype=torch.int64, device=device)
        return _Captured(zeros, zeros.clone(), metadata, logits_rows)

    def _capture(self, captured: _Captured, cache, graphs: dict) -> None:
        """Warm up (compiles the Triton kernels, computes this forward), then record ``plan + run``.

        The graphs of one cache share one memory pool. A pool is reused only while a graph that holds
        it lives: once a cache and its graphs are gone, PyTorch refuses its pool to a new capture
        (an internal assert), so a new cache starts a pool of its own.
        """
        pool = next((c.graph.pool() for c in graphs.values() if c.graph is not None), None)
        model = self.model
        capacity = cache.position_bound
        padded = captured.tokens.shape[0]

        def forward():
            plan = build_plan(model, captured.positions, captured.metadata, cache, padded, capacity, None)
            return model.run(captured.tokens, plan, captured.logits_rows)

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            forward()
        torch.cuda.current_stream().wait_stream(side)
        captured.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(captured.graph, pool=pool):
            captured.outputs = forward()
