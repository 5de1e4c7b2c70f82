"""Plan once, run many: what every layer of one forward shares in tree attention.

A forward's layers all attend with the same query layout (offsets, prefix lengths, tree
mask, block table), so ``plan_attention`` validates that layout once and prepares what
the chosen backend needs; each layer then calls ``tree_attention(..., plan=plan, check=False)``
(see ``specdec.kernels.tree_attention``), which checks nothing.

What the plan holds, and what each piece depends on:

    backend, tile (Triton)          host sizes: tokens, batch, heads, head dim, device; uniform_queries
    num_splits, part_out, part_lse  host sizes and the context bound; scratch for split contexts (``partial_dtype``)
    query_rows, token_slots         q_offsets                          (PyTorch path; None when uniform)
    kv_rows                         q_offsets, prefix_lens, block_table (PyTorch path; None for cache views)
    attn_bias                       q_offsets, prefix_lens, tree_start, tree_mask (PyTorch path)

Two host facts let the PyTorch path skip its gathers: ``uniform_queries`` (every request has
the same number of queries, so the padded layout is q itself; the Triton path then launches
exactly each request's query tiles, no idle ones) and ``finite_cache`` (a
contiguous cache whose every position holds finite values, e.g. a zero-initialised
``KVCache`` written only by a model, so the first ``max_context`` positions of each row
can be read as a view: the padding past a request's context is stale but masked, and
only a NaN or inf there could leak through the mask).

Every shape comes from host sizes (``num_tokens``, B, ``max_queries``, ``max_context``,
the cache shape), so with the bounds given and ``check_bounds=False`` building a plan
reads nothing back from the device: it can run inside a CUDA-graph capture or a
``torch.compile`` region. When a bound is not given it is read from the values if they
are on the CPU (free) and taken from shapes otherwise (``max_queries = num_tokens``,
``max_context`` = the cache's capacity per request).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec import _backend
from specdec.kernels._checks import check_offsets, check_same_device, check_tensor
from specdec.kernels.tree_attention_tiles import MAX_HEAD_DIM, TileConfig, default_splits, tile_config
from specdec.kernels.tree_attention_torch import padded_layout
from specdec.kernels.tree_metadata import MASK_WORD_BITS

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class AttentionPlan:
    """One forward's attention layout, validated, with each backend's precomputed tensors.

    Layout (as given): ``q_offsets [B+1]`` int32, ``prefix_lens [B]`` int32, ``tree_start [B]``
    int32 (``prefix_lens`` itself when not given), ``tree_mask [T, W]`` int64 or None (causal),
    ``block_table [B, max_blocks]`` int32 or None (contiguous cache).
    Triton: ``tile`` (block sizes, warps, ``num_splits``), ``part_out [S, T, Hq, D]`` and
    ``part_lse [S, T, Hq]`` scratch when S > 1 (else None): outputs in ``partial_dtype(dtype)``, lse in float32.
    PyTorch: ``query_rows [B, n_max]``, ``token_slots [T]``, ``kv_rows [B * L_max]`` int64 and
    ``attn_bias [B, 1, n_max, L_max]`` in the query dtype (see ``tree_attention_torch``); None on
    the Triton backend, and the first three None where the plan needs no gather (uniform queries;
    views of a finite contiguous cache).
    """

    backend: str
    num_tokens: int
    num_heads: int
    cache_shape: tuple[int, int, int, int]
    dtype: torch.dtype
    softmax_scale: float
    max_queries: int
    max_context: int
    q_offsets: torch.Tensor
    prefix_lens: torch.Tensor
    tree_start: torch.Tensor
    tree_mask: torch.Tensor | None
    block_table: torch.Tensor | None
    tile: TileConfig | None
    part_out: torch.Tensor | None
    part_lse: torch.Tensor | None
    query_rows: torch.Tensor | None
    token_slots: torch.Tensor | None
    kv_rows: torch.Tensor | None
    attn_bias: torch.Tensor | None

    @property
    def batch_size(self) -> int:
        return self.prefix_lens.numel()

    def op_args(self) -> tuple:
        """Everything the registered op takes between ``v_cache`` and ``out``, in its order."""
        tile = list(self.tile) if self.tile is not None else []
        return (
            self.q_offsets, self.prefix_lens, self.tree_start, self.tree_mask, self.block_table,
            self.query_rows, self.token_slots, self.kv_rows, self.attn_bias, self.part_out, self.part_lse,
            self.softmax_scale, tile,
        )  # fmt: skip


def plan_attention(
    q_offsets: torch.Tensor,
    prefix_lens: torch.Tensor,
    *,
    num_tokens: int,
    num_heads: int,
    cache_shape: Sequence[int],
    dtype: torch.dtype,
    tree_mask: torch.Tensor | None = None,
    causal: bool = False,
    tree_start: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    max_queries: int | None = None,
    max_context: int | None = None,
    softmax_scale: float | None = None,
    num_splits: int | None = None,
    check_bounds: bool | None = None,
    uniform_queries: bool = False,
    finite_cache: bool = False,
) -> AttentionPlan:
    """Validate one forward's attention layout and prepare its plan (see the module docstring).

    Parameters
    ----------
    q_offsets, prefix_lens, tree_mask, causal, tree_start, block_table, softmax_scale, num_splits,
    check_bounds : as in ``tree_attention``.
    num_tokens : T, the query rows of the forward.
    num_heads : Hq, query heads.
    cache_shape : the shape of one layer's K (or V) cache, ``(rows or blocks, positions or
        block size, Hkv, D)``.
    dtype : dtype of q and the cache.
    max_queries : host bound on any request's query count (the padded width of the PyTorch path).
    max_context : host bound on any request's prefix + queries (how far the PyTorch path reads).
    uniform_queries : host fact: every request has exactly ``num_tokens / B`` queries (read from
        the offsets instead when they are on the CPU and ``max_queries`` is not given).
    finite_cache : host fact: the cache is contiguous and every position of its first B rows
        holds finite values; the PyTorch path then reads K/V as views instead of gathering them.

    Returns
    -------
    AttentionPlan, on the device of ``q_offsets``.

    Example
    -------
    >>> offsets = torch.tensor([0, 1, 2], dtype=torch.int32)      # two requests, one query each
    >>> plan = plan_attention(offsets, torch.tensor([5, 9], dtype=torch.int32), num_tokens=2,
    ...                       num_heads=4, cache_shape=(2, 16, 2, 8), dtype=torch.float32, causal=True)
    >>> plan.max_queries, plan.max_context, plan.batch_size
    (1, 10, 2)
    """
    check_tensor("q_offsets", q_offsets, dtype=torch.int32, ndim=1)
    batch = q_offsets.numel() - 1
    if batch < 1:
        raise ValueError(f"q_offsets must hold B+1 >= 2 entries (B >= 1 requests), got {q_offsets.numel()}")
    check_tensor("prefix_lens", prefix_lens, dtype=torch.int32, shape=(batch,))
    if dtype not in DTYPES:
        raise TypeError(f"dtype must be float16, bfloat16 or float32, got {dtype}")
    rows, slots, kv_heads, head_dim = (int(s) for s in cache_shape)
    _check_count("num_tokens", num_tokens, 0)
    _check_count("num_heads", num_heads, 1)
    if num_heads % kv_heads:
        raise ValueError(f"q has {num_heads} heads, not a multiple of the cache's {kv_heads} KV heads")
    if head_dim < 1:
        raise ValueError(f"head dim must be positive, got {head_dim}")
    if (tree_mask is None) == (not causal):
        raise ValueError("pass exactly one of tree_mask (tree verification) or causal=True (prefill / decode)")
    if tree_mask is not None:
        check_tensor("tree_mask", tree_mask, dtype=torch.int64, ndim=2)
        if tree_mask.shape[0] != num_tokens or tree_mask.shape[1] < 1:
            raise ValueError(f"tree_mask must have shape ({num_tokens}, W >= 1), got {tuple(tree_mask.shape)}")
        if batch == 1 and tree_mask.shape[1] * MASK_WORD_BITS < num_tokens:  # one tree: its size is T (no sync)
            raise ValueError(
                f"tree_mask has {tree_mask.shape[1]} words per row ({tree_mask.shape[1] * MASK_WORD_BITS} nodes), "
                f"too short for request 0's tree of {num_tokens} nodes"
            )
    if tree_start is not None:
        if tree_mask is None:
            raise ValueError("tree_start applies to tree masks only; causal attention has no cached tree")
        check_tensor("tree_start", tree_start, dtype=torch.int32, shape=(batch,))
    if block_table is not None:
        check_tensor("block_table", block_table, dtype=torch.int32, ndim=2)
        if block_table.shape[0] != batch:
            raise ValueError(f"block_table must have {batch} rows (one per request), got {block_table.shape[0]}")
        capacity = block_table.shape[1] * slots
    else:
        if rows < batch:
            raise ValueError(f"k_cache has {rows} rows but there are {batch} requests (contiguous layout)")
        capacity = slots
    device = check_same_device(
        q_offsets=q_offsets, prefix_lens=prefix_lens, tree_mask=tree_mask, tree_start=tree_start,
        block_table=block_table,
    )  # fmt: skip
    if softmax_scale is None:
        softmax_scale = head_dim**-0.5
    if not (isinstance(softmax_scale, (int, float)) and math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"softmax_scale must be a positive finite float, got {softmax_scale!r}")
    if num_splits is not None and (not isinstance(num_splits, int) or num_splits < 1):
        raise ValueError(f"num_splits must be a positive int, got {num_splits!r}")
    for name, bound in (("max_queries", max_queries), ("max_context", max_context)):
        if bound is not None:
            _check_count(name, bound, 1 if num_tokens else 0)  # a query sees at least itself
    if check_bounds is None:
        check_bounds = device.type == "cpu"
    unbounded = max_queries is None or max_context is None
    if check_bounds or (unbounded and device.type == "cpu"):  # values on the CPU are free to read
        sizes, contexts = _read_sizes(q_offsets, prefix_lens, num_tokens)
        if check_bounds:
            _check_values(sizes, contexts, prefix_lens, tree_start, tree_mask, block_table, capacity, (rows, slots),
                          max_queries, max_context)  # fmt: skip
        max_queries = max(sizes) if max_queries is None else max_queries
        max_context = max(contexts) if max_context is None else max_context
        if uniform_queries and len(set(sizes)) > 1:
            raise ValueError(f"uniform_queries was given but the requests have {sizes} queries")
        uniform_queries = uniform_queries or len(set(sizes)) == 1
    if uniform_queries and num_tokens % batch:
        raise ValueError(f"uniform_queries: {num_tokens} tokens do not split evenly over {batch} requests")
    max_queries = min(num_tokens if max_queries is None else max_queries, num_tokens)
    uniform_queries = uniform_queries and num_tokens > 0
    if uniform_queries:
        max_queries = num_tokens // batch
    max_context = min(capacity if max_context is None else max_context, capacity)
    return build_attention_plan(
        q_offsets, prefix_lens, num_tokens=num_tokens, num_heads=num_heads,
        cache_shape=(rows, slots, kv_heads, head_dim), dtype=dtype, tree_mask=tree_mask, tree_start=tree_start,
        block_table=block_table, max_queries=max_queries, max_context=max_context,
        softmax_scale=float(softmax_scale), num_splits=num_splits, uniform_queries=uniform_queries,
        finite_cache=finite_cache,
    )  # fmt: skip


def build_attention_plan(
    q_offsets: torch.Tensor,
    prefix_lens: torch.Tensor,
    *,
    num_tokens: int,
    num_heads: int,
    cache_shape: tuple[int, int, int, int],
    dtype: torch.dtype,
    tree_mask: torch.Tensor | None,
    tree_start: torch.Tensor | None,
    block_table: torch.Tensor | None,
    max_queries: int,
    max_context: int,
    softmax_scale: float,
    num_splits: int | None = None,
    uniform_queries: bool = False,
    finite_cache: bool = False,
) -> AttentionPlan:
    """``plan_attention`` after its checks: for a caller that validated the layout itself (a model's
    forward plan). Arguments as ``plan_attention``, all given (host bounds within the capacity,
    ``uniform_queries`` only when ``num_tokens`` splits evenly); reads no device value."""
    rows, slots, kv_heads, head_dim = cache_shape
    batch, device = prefix_lens.shape[0], q_offsets.device
    backend = _backend.select_backend(q_offsets)
    tile = part_out = part_lse = None
    query_rows = token_slots = kv_rows = attn_bias = None
    if backend == "triton":
        if head_dim > MAX_HEAD_DIM:
            raise ValueError(f"head dim {head_dim} is above the Triton path's limit of {MAX_HEAD_DIM}")
        hopper = device.type != "cuda" or torch.cuda.get_device_capability(device)[0] >= 9
        tile = tile_config(max(num_tokens, 1), batch, num_heads // kv_heads, head_dim, 1,
                           fp32=dtype == torch.float32, hopper=hopper, uniform=uniform_queries)  # fmt: skip
        splits = num_splits or default_splits(device, num_tokens, batch, kv_heads, tile, max_context,
                                              elem_bytes=dtype.itemsize)  # fmt: skip
        tile = tile._replace(num_splits=splits)
        if splits > 1:
            part_out = torch.empty(splits, num_tokens, num_heads, head_dim, dtype=partial_dtype(dtype), device=device)
            part_lse = torch.empty(splits, num_tokens, num_heads, dtype=torch.float32, device=device)
        # the kernels assume unit stride along the index tensors' rows
        q_offsets, prefix_lens = q_offsets.contiguous(), prefix_lens.contiguous()
        tree_start = tree_start.contiguous() if tree_start is not None else None
        tree_mask = tree_mask.contiguous() if tree_mask is not None else None
        block_table = block_table.contiguous() if block_table is not None else None
    else:
        query_rows, token_slots, kv_rows, attn_bias = padded_layout(
            q_offsets, prefix_lens, tree_start if tree_start is not None else prefix_lens, tree_mask, block_table,
            num_tokens=num_tokens, cache_shape=(rows, slots), max_queries=max_queries, max_context=max_context,
            dtype=dtype, uniform=uniform_queries, kv_view=finite_cache and block_table is None,
        )  # fmt: skip
    return AttentionPlan(
        backend, num_tokens, num_heads, (rows, slots, kv_heads, head_dim), dtype, softmax_scale, max_queries,
        max_context, q_offsets, prefix_lens, tree_start if tree_start is not None else prefix_lens, tree_mask,
        block_table, tile, part_out, part_lse, query_rows, token_slots, kv_rows, attn_bias,
    )  # fmt: skip


def partial_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a split context's per-split outputs are stored in for queries of ``dtype``: float16 for float16
    (half the merge's bytes, and the output's error against the float64 reference stays within the bound that
    ``bench/bench_split_partials.py`` checks), float32 otherwise (bfloat16 partials fail that bound, and float16
    cannot hold every bfloat16 value)."""
    return torch.float16 if dtype == torch.float16 else torch.float32


def _check_count(name: str, value, lowest: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < lowest:
        raise ValueError(f"{name} must be an int >= {lowest}, got {value!r}")


def _read_sizes(q_offsets, prefix_lens, num_tokens) -> tuple[list[int], list[int]]:
    """Per request (queries, prefix + queries), with the offsets validated (reads values)."""
    bounds = check_offsets("q_offsets", q_offsets, total=num_tokens)
    sizes = [bounds[b + 1] - bounds[b] for b in range(len(bounds) - 1)]
    return sizes, [p + n for p, n in zip(prefix_lens.tolist(), sizes)]


def _check_values(sizes, contexts, prefix_lens, tree_start, tree_mask, block_table, capacity, cache_rows_slots,
                  max_queries, max_context) -> None:  # fmt: skip
    """Checks that read tensor values (a device sync on CUDA)."""
    rows, slots = cache_rows_slots
    prefixes = prefix_lens.tolist()
    for b, p in enumerate(prefixes):
        if p < 0:
            raise ValueError(f"prefix_lens[{b}] must be >= 0, got {p}")
    starts = prefixes if tree_start is None else tree_start.tolist()
    for b, (s, p) in enumerate(zip(starts, prefixes)):
        if not 0 <= s <= p:
            raise ValueError(f"tree_start[{b}] = {s} must lie in [0, prefix_lens[{b}] = {p}]")
    if tree_mask is not None:
        bits = tree_mask.shape[1] * MASK_WORD_BITS
        for b, (s, context) in enumerate(zip(starts, contexts)):
            if context - s > bits:
                raise ValueError(
                    f"tree_mask has {tree_mask.shape[1]} words per row ({bits} nodes), too short for request "
                    f"{b}'s tree of {context - s} nodes"
                )
    for b, context in enumerate(contexts):
        if context > capacity:
            if block_table is None:
                raise ValueError(
                    f"request {b} needs {context} cache positions (prefix_lens {prefixes[b]} + {sizes[b]} queries) "
                    f"but k_cache holds max_len={capacity}"
                )
            raise ValueError(
                f"block_table is too small: request {b} needs {-(-context // slots)} blocks of {slots} for "
                f"{context} tokens but block_table has {block_table.shape[1]} columns"
            )
        if block_table is not None:
            used = block_table[b, : -(-context // slots)]
            if used.numel() and (int(used.min()) < 0 or int(used.max()) >= rows):
                raise ValueError(f"block_table row {b} holds block ids outside [0, {rows}) in its used part")
    if max_queries is not None and max(sizes) > max_queries:
        b = sizes.index(max(sizes))
        raise ValueError(f"max_queries={max_queries} is below request {b}'s {sizes[b]} queries")
    if max_context is not None and max(contexts) > max_context:
        b = contexts.index(max(contexts))
        raise ValueError(f"max_context={max_context} is below request {b}'s context of {contexts[b]} positions")
