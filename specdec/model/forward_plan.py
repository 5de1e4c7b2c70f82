"""Plan once, run many: what every layer of one model forward shares, validated and prepared once.

``LlamaModel.forward`` = ``plan_forward`` (check the inputs, admit the K/V write, build this
plan) + ``LlamaModel.run`` (every layer calls op bodies directly: no checks, no dispatch, no
backend choice per layer). What the plan holds and where it comes from:

    backend        chosen once for the step (``specdec._backend.select_backend``)
    attention      ``AttentionPlan`` from host bounds only -- ``KVCache.length_bounds()`` plus the
                   rows per request of the cache's reservation (``KVCache.begin_forward``) -- so
                   building it reads nothing back from the device
    attention_args the attention op's arguments after the caches, assembled once
    rotary         PyTorch path: cos / sin ``[T, 1, D]`` once per forward, gathered from the model's
                   table (``LlamaModel.rotary_rows``); the Triton kernel computes its angles itself
    kv_rows        PyTorch path: the cache row of each token, shared by every layer's K/V write
                   (``append_rows``); the Triton path's ``kv_append`` kernel finds them itself

Both backends build every tensor here by device ops from host sizes, so on a GPU planning
never synchronises and a plan built from static buffers can be replayed in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from specdec.kernels._checks import check_tensor
from specdec.kernels.attention_plan import AttentionPlan, build_attention_plan
from specdec.kernels.kv_append import append_rows, kv_append_op
from specdec.kernels.rms_norm import add_rms_norm_op, rms_norm_op
from specdec.kernels.rotary import apply_rotary_op
from specdec.kernels.silu_mul import silu_mul_op
from specdec.kernels.tree_attention import tree_attention_op
from specdec.kernels.tree_metadata import MASK_WORD_BITS
from specdec.model.attention_metadata import AttentionMetadata

INDEX_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class ForwardPlan:
    """One forward's shared state (see the module docstring); built by ``plan_forward``."""

    backend: str
    num_tokens: int
    positions: torch.Tensor
    q_offsets: torch.Tensor
    cache: object  # the KVCache the forward writes
    attention: AttentionPlan
    attention_args: tuple
    rotary: tuple[torch.Tensor, torch.Tensor] | None
    kv_rows: torch.Tensor | None


class LayerOps(NamedTuple):
    """The op bodies a forward calls, chosen once per backend (registered ops inside torch.compile)."""

    rms_norm: object
    add_rms_norm: object
    rotary: object
    kv_append: object
    attention: object
    silu_mul: object


def _layer_ops(backend: str, compiling: bool) -> LayerOps:
    ops = (rms_norm_op, add_rms_norm_op, apply_rotary_op, kv_append_op, tree_attention_op, silu_mul_op)
    if compiling and backend == "triton":
        return LayerOps(*(op.op for op in ops))
    return LayerOps(*(op.body(backend) for op in ops))


# Bodies of each backend; when compiling the Triton path, the registered ops (the graph holds one
# opaque call each), while the PyTorch bodies are plain torch code that Dynamo traces through.
LAYER_OPS = {(b, c): _layer_ops(b, c) for b in ("torch", "triton") for c in (False, True)}


def plan_forward(
    model, tokens: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata, cache
) -> ForwardPlan:
    """Validate a forward's inputs once, admit its K/V write in ``cache`` and prepare its plan.

    Arguments as ``LlamaModel.forward``; ``model`` is any decoder with ``config``, ``dtype``, ``device``
    and ``rotary_rows`` (``LlamaModel``, ``EagleHead``). Raises TypeError / ValueError naming the
    argument. Reads no device value when the cache holds a reservation for the step (``KVCache.reserve``).
    """
    counts = admit_forward(model, tokens, positions, metadata, cache)
    per_request = counts[0] if len(set(counts)) == 1 and tokens.shape[0] else None
    max_context = max((b + c for b, c in zip(cache.length_bounds(), counts) if c), default=1)
    return build_plan(model, positions, metadata, cache, max(max(counts), 1), max_context, per_request)


def admit_forward(model, tokens, positions, metadata: AttentionMetadata, cache) -> list[int]:
    """``plan_forward``'s checks and the cache's admission of the write; returns the rows per request."""
    config, device, dtype = model.config, model.device, model.dtype
    check_tensor("tokens", tokens, dtype=INDEX_DTYPES, ndim=1, device=device)
    num_tokens = tokens.shape[0]
    check_tensor("positions", positions, dtype=INDEX_DTYPES, shape=(num_tokens,), device=device)
    if not isinstance(metadata, AttentionMetadata):
        raise TypeError(f"metadata must be an AttentionMetadata, got {type(metadata).__name__}")
    _check_cache(cache, config, dtype, device)
    q_offsets, tree_mask, tree_start = metadata.q_offsets, metadata.tree_mask, metadata.tree_start
    check_tensor("metadata.q_offsets", q_offsets, shape=(cache.batch_size + 1,), device=device)
    if tree_mask is not None:
        check_tensor("metadata.tree_mask", tree_mask, shape=(num_tokens, None), device=device)
    if tree_start is not None:
        check_tensor("metadata.tree_start", tree_start, device=device)
    counts = cache.begin_forward(q_offsets, num_tokens)
    if tree_mask is not None and tree_start is None and max(counts) > tree_mask.shape[1] * MASK_WORD_BITS:
        raise ValueError(
            f"metadata.tree_mask has {tree_mask.shape[1]} words per row, too short for a tree of {max(counts)} nodes"
        )
    return counts


def build_plan(
    model, positions, metadata: AttentionMetadata, cache, max_queries: int, max_context: int, per_request: int | None
) -> ForwardPlan:
    """The plan of an admitted forward from host bounds: ``max_queries`` rows per request at most, contexts of
    ``max_context`` positions at most, ``per_request`` rows for every request (or None). Device ops only."""
    num_tokens, dtype = positions.shape[0], model.dtype
    q_offsets = metadata.q_offsets
    capacity = cache.position_bound
    attention = build_attention_plan(
        q_offsets, cache.seq_lens, num_tokens=num_tokens, num_heads=model.config.num_heads,
        cache_shape=tuple(cache.data.shape[2:]), dtype=dtype, tree_mask=metadata.tree_mask,
        tree_start=metadata.tree_start, block_table=cache.block_tables, max_queries=max_queries,
        max_context=max_context, softmax_scale=model.config.head_dim**-0.5,
        uniform_queries=per_request is not None,
        finite_cache=cache.layout == "contiguous",  # a KVCache starts zeroed and holds only its model's K/V
    )  # fmt: skip
    rotary = kv_rows = None
    if attention.backend == "torch":
        rotary = model.rotary_rows(positions, capacity)
        kv_rows = append_rows(cache.data, cache.seq_lens, q_offsets, cache.block_tables, num_tokens, per_request)
    return ForwardPlan(
        attention.backend, num_tokens, positions, q_offsets, cache, attention, attention.op_args(), rotary, kv_rows,
    )  # fmt: skip


def write_kv(ops: LayerOps, plan: ForwardPlan, layer: int, k: torch.Tensor, v: torch.Tensor, compiling: bool) -> None:
    """One layer's K/V into the cache: through the plan's rows (PyTorch) or the ``kv_append`` kernel."""
    cache = plan.cache
    if plan.kv_rows is None:
        ops.kv_append(cache.data, layer, k, v, cache.seq_lens, plan.q_offsets, cache.block_tables)
        return
    if compiling:  # the cache enters a compiled graph as one tensor (views of it as inputs would alias)
        k_rows, v_rows = (cache.data[layer, i].view(-1, cache.num_kv_heads, cache.head_dim) for i in (0, 1))
    else:
        k_rows, v_rows = cache.row_views[layer]
    k_rows.index_copy_(0, plan.kv_rows, k)
    v_rows.index_copy_(0, plan.kv_rows, v)


def _check_cache(cache, config, dtype: torch.dtype, device: torch.device) -> None:
    from specdec.model.kv_cache import KVCache

    if not isinstance(cache, KVCache):
        raise TypeError(f"cache must be a KVCache, got {type(cache).__name__}")
    want = (config.num_layers, config.num_kv_heads, config.head_dim, dtype, device)
    got = (cache.num_layers, cache.num_kv_heads, cache.head_dim, cache.dtype, cache.device)
    if want != got:
        raise ValueError(
            f"cache has (layers, kv heads, head dim, dtype, device) = {got} but the model needs {want}; "
            "build it with model.new_cache"
        )
