"""Tree attention: one op for causal prefill, decode and token-tree verification.

Query tokens of B requests are flattened into ``q [Tq, Hq, D]``; request b owns rows
``q_offsets[b] .. q_offsets[b+1]-1`` (n_b of them, possibly none). Its K/V cache
holds ``prefix_lens[b]`` earlier tokens, followed by the K/V of its own n_b query
tokens (already written). Query i of request b attends to

    every prefix position 0 .. p_b-1, and
    tree position p_b + j  iff  bit j of its mask row is set   (tree_mask), or j <= i (causal=True).

A chain mask is causal prefill; a single node is decode. With s = scale * q.k,
out = sum_j softmax(s)_j v_j and lse = log sum_j exp(s_j) over the allowed positions.

The Triton path (kernels in ``tree_attention_kernels``) processes, per program, a
tile of BLOCK_Q query tokens of one request times the G query heads sharing one KV
head, so each KV tile is read once per (request, KV head, query tile) -- for decode
and trees up to BLOCK_Q nodes that is once per (request, KV head). Long contexts
with few such tiles are split across programs and merged by their log-sum-exp.
"""

from __future__ import annotations

import math

import torch

from specdec.kernels._checks import check_offsets, check_same_device, check_tensor
from specdec.kernels.tree_metadata import MASK_WORD_BITS, unpack_mask_rows

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256


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
        pass True to check CUDA inputs too (one sync). Shapes, dtypes, devices and head
        counts are always checked. A row with no allowed position gets out 0, lse -inf.
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
        ref_out, ref_lse = tree_attention_reference(
            q, k_cache, v_cache, q_offsets, prefix_lens, tree_mask, block_table, float(softmax_scale)
        )
        out.copy_(ref_out)
        if lse is not None:
            lse.copy_(ref_lse)
    return (out, lse) if return_lse else out


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
    chunk never materialises more than ~32M scores at once. ``tree_mask=None`` means causal.
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
        positions = torch.arange(length, device=q.device)
        if block_table is None:
            k, v = k_cache[b, :length], v_cache[b, :length]  # [L, Hkv, D]
        else:
            blocks = block_table[b, positions // k_cache.shape[1]].long()
            k, v = k_cache[blocks, positions % k_cache.shape[1]], v_cache[blocks, positions % k_cache.shape[1]]
        k, v = k.float(), v.float()
        if tree_mask is None:
            allowed = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        else:
            allowed = unpack_mask_rows(tree_mask[start : start + n], n)  # [n, n] local node bits
            allowed = torch.nn.functional.pad(allowed, (0, n - allowed.shape[1]))  # bits past W*64 are unset
        qb = q[start : start + n].float().view(n, kv_heads, group, head_dim)
        chunk = max(1, (1 << 25) // (heads * length))
        for c0 in range(0, n, chunk):
            c1 = min(n, c0 + chunk)
            s = torch.einsum("nhgd,lhd->hgnl", qb[c0:c1], k) * softmax_scale  # [Hkv, G, c, L]
            s[..., prefix:].masked_fill_(~allowed[c0:c1], -math.inf)
            row_lse = torch.logsumexp(s, dim=-1)  # [Hkv, G, c]
            p = torch.exp(s - row_lse.unsqueeze(-1)).nan_to_num_(0.0)  # rows with nothing allowed -> 0
            o = torch.einsum("hgnl,lhd->nhgd", p, v)
            out[start + c0 : start + c1] = o.reshape(c1 - c0, heads, head_dim)
            lse[start + c0 : start + c1] = row_lse.permute(2, 0, 1).reshape(c1 - c0, heads)
    return out.to(q.dtype), lse
