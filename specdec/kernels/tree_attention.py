"""Tree attention: one op for causal prefill, decode and token-tree verification.

Query tokens of B requests are flattened into ``q [T, Hq, D]``; request b owns rows
``q_offsets[b] .. q_offsets[b+1]-1`` (n_b of them, possibly none). Its K/V cache holds
``prefix_lens[b]`` earlier tokens, followed by the K/V of its own n_b query tokens
(already written). With ``s_b = tree_start[b]`` (default ``prefix_lens[b]``), query i of
request b attends to cache position t iff

    t < s_b                                   (the committed context), or
    s_b <= t < p_b + n_b and bit t - s_b of its mask row is set   (tree_mask), or
    t <= p_b + i                              (causal=True instead of a mask).

With the default start the mask's bit j is tree node j, the query tokens themselves; a
start below the prefix lets a request's queries be the newest level of a draft tree whose
earlier levels (positions s_b .. p_b - 1) were written by earlier calls, so drafting a tree
level by level never feeds the tree again. A chain mask is causal prefill; a single node is
decode. With s = scale * q.k, out = sum_t softmax(s)_t v_t and lse = log sum_t exp(s_t)
over the visible positions; a row that sees nothing gets out 0 and lse -inf.

One entry point: ``tree_attention`` checks every argument, plans and runs (outside callers); a
forward validates its layout once with ``plan_attention`` (``attention_plan``) and runs each layer
as ``tree_attention(q, k_cache, v_cache, plan=plan, out=out, check=False)``, which checks nothing.
Both end in the registered op
``torch.ops.specdec.tree_attention`` (Triton kernels in ``tree_attention_kernels``, the
padded-batch PyTorch path and the float64 reference in ``tree_attention_torch``).
"""

from __future__ import annotations

import torch

from specdec.kernels._checks import check_same_device, check_tensor, unchecked_needs
from specdec.kernels._op import register_op
from specdec.kernels.attention_plan import DTYPES, AttentionPlan, plan_attention
from specdec.kernels.tree_attention_kernels import tree_attention_triton
from specdec.kernels.tree_attention_torch import tree_attention_reference, tree_attention_torch

__all__ = ["AttentionPlan", "plan_attention", "tree_attention", "tree_attention_reference"]


# --------------------------------------------------------------------------------------------
# Registered op
# --------------------------------------------------------------------------------------------


@register_op(
    "tree_attention",
    mutates_args=("part_out", "part_lse", "out", "lse"),
    triton=tree_attention_triton,
    torch=tree_attention_torch,
)
def tree_attention_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    q_offsets: torch.Tensor,
    prefix_lens: torch.Tensor,
    tree_start: torch.Tensor,
    tree_mask: torch.Tensor | None,
    block_table: torch.Tensor | None,
    query_rows: torch.Tensor | None,
    token_slots: torch.Tensor | None,
    kv_rows: torch.Tensor | None,
    attn_bias: torch.Tensor | None,
    part_out: torch.Tensor | None,
    part_lse: torch.Tensor | None,
    softmax_scale: float,
    tile: list[int],
    out: torch.Tensor,
    lse: torch.Tensor | None,
) -> None:
    """Writes ``out`` (and ``lse``); the arguments after ``v_cache`` are ``AttentionPlan.op_args()``."""


# --------------------------------------------------------------------------------------------
# Public functions
# --------------------------------------------------------------------------------------------


def tree_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    q_offsets: torch.Tensor | None = None,
    prefix_lens: torch.Tensor | None = None,
    *,
    tree_mask: torch.Tensor | None = None,
    causal: bool = False,
    tree_start: torch.Tensor | None = None,
    block_table: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    out: torch.Tensor | None = None,
    return_lse: bool = False,
    check_bounds: bool | None = None,
    num_splits: int | None = None,
    lse: torch.Tensor | None = None,
    plan: AttentionPlan | None = None,
    check: bool = True,
):
    """Attention of flattened query tokens over a KV cache, masked by token trees.

    Parameters
    ----------
    q : ``[T, Hq, D]`` float16, bfloat16 or float32; query tokens of all requests. Any head
        dim D >= 1 on the PyTorch path, up to 256 on the Triton path.
    k_cache, v_cache : same dtype as ``q``; contiguous layout ``[B', max_len, Hkv, D]``
        (B' >= B, request b uses row b) or, with ``block_table``, paged layout
        ``[num_blocks, block_size, Hkv, D]``. Strided views are fine (e.g. one layer of a
        stacked ``[L, 2, B, max_len, Hkv, D]`` cache) as long as the last dim is contiguous.
    q_offsets : ``[B+1]`` int32; request b owns query rows ``q_offsets[b] .. q_offsets[b+1]-1``.
    prefix_lens : ``[B]`` int32; cached tokens before request b's queries. Query i of
        request b has its K/V at cache position ``prefix_lens[b] + i``.
    tree_mask : ``[T, W]`` int64, bit-packed rows (bit j = word j // 64, bit j % 64) over the
        positions from ``tree_start`` on, as ``build_tree_metadata`` returns them for a whole tree.
    causal : True instead of ``tree_mask``: query i attends to positions up to its own.
    tree_start : ``[B]`` int32 with ``0 <= tree_start[b] <= prefix_lens[b]`` (tree masks only):
        where request b's tree begins in its cache; default ``prefix_lens``. ``W * 64`` must
        cover ``prefix_lens[b] - tree_start[b] + n_b``.
    block_table : ``[B, max_blocks]`` int32 physical block ids (paged layout only).
    softmax_scale : default ``D ** -0.5``.
    out : optional ``[T, Hq, D]`` output buffer, dtype of ``q`` (last dim contiguous).
    return_lse : also return the log-sum-exp ``[T, Hq]`` float32 (natural log).
    check_bounds : check the *values* of the index tensors (offsets non-decreasing and summing
        to T, ``0 <= tree_start <= prefix_lens``, every request fitting in its cache row or block
        table, mask rows wide enough, block ids in range). Default: only for CPU tensors, where
        it costs no device sync; pass True to check CUDA inputs too (one sync). Shapes, dtypes,
        devices, head counts and, for a single request, the mask width are always checked.
        Unchecked values give wrong results but never move a kernel's access outside its buffers
        (positions past the capacity, bits past ``W * 64`` and block columns past ``max_blocks``
        are never read), provided the block ids the table holds lie in the pool.
    num_splits : Triton path only: split each request's context over this many programs
        (default: chosen from the device's size).
    lse : optional ``[T, Hq]`` float32 contiguous buffer for the log-sum-exp (implies ``return_lse``).
    plan : with ``check=False`` (then required): the layout ``plan_attention`` validated and prepared
        once for every layer of a forward, in place of ``q_offsets`` .. ``num_splits`` (unread).
    check : False skips every argument check (``specdec.kernels``): the per-layer hot path. ``q``, the
        caches, ``out`` and ``lse`` must match the plan (``plan.num_tokens``, ``plan.num_heads``,
        ``plan.cache_shape``, ``plan.dtype``, last dims contiguous). Outside a ``torch.compile`` region
        the plan's backend body runs directly, skipping the dispatcher.

    Returns
    -------
    ``out [T, Hq, D]`` (dtype of ``q``), or ``(out, lse [T, Hq] float32)`` with ``return_lse``.

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
    return_lse = return_lse or lse is not None
    if not check:
        if plan is None:
            raise unchecked_needs("plan")
        if out is None:
            out = torch.empty_like(q, memory_format=torch.contiguous_format)
        if return_lse and lse is None:
            lse = torch.empty(q.shape[0], q.shape[1], dtype=torch.float32, device=q.device)
        if plan.num_tokens:
            args = (q, k_cache, v_cache, *plan.op_args(), out, lse)
            if torch.compiler.is_compiling():
                tree_attention_op(*args)
            else:
                tree_attention_op.body(plan.backend)(*args)
        return (out, lse) if return_lse else out
    if plan is not None:
        raise ValueError("plan runs without checks: pass check=False with it (a checked call plans itself)")
    for name, value in (("q_offsets", q_offsets), ("prefix_lens", prefix_lens)):
        if value is None:
            raise ValueError(f"{name} is required (or a plan, with check=False)")
    check_tensor("q", q, dtype=DTYPES, ndim=3)
    check_tensor("k_cache", k_cache, dtype=q.dtype, ndim=4)
    check_tensor("v_cache", v_cache, dtype=q.dtype, shape=tuple(k_cache.shape))
    tokens, heads, head_dim = q.shape
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"k_cache head dim {k_cache.shape[3]} differs from q's head dim {head_dim}")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last (head) dimension; call .contiguous() first")
    check_same_device(
        q=q, k_cache=k_cache, v_cache=v_cache, q_offsets=q_offsets, prefix_lens=prefix_lens, tree_mask=tree_mask,
        tree_start=tree_start, block_table=block_table, out=out,
    )  # fmt: skip
    if out is not None:
        check_tensor("out", out, dtype=q.dtype, shape=tuple(q.shape))
        if out.stride(-1) != 1:
            raise ValueError("out must be contiguous in its last dimension")
    if lse is not None:
        check_tensor("lse", lse, dtype=torch.float32, shape=(tokens, heads), device=q.device, contiguous=True)
    plan = plan_attention(
        q_offsets, prefix_lens, num_tokens=tokens, num_heads=heads, cache_shape=tuple(k_cache.shape),
        dtype=q.dtype, tree_mask=tree_mask, causal=causal, tree_start=tree_start, block_table=block_table,
        softmax_scale=softmax_scale, num_splits=num_splits, check_bounds=check_bounds,
    )  # fmt: skip
    return tree_attention(q, k_cache, v_cache, out=out, lse=lse, return_lse=return_lse, plan=plan, check=False)
