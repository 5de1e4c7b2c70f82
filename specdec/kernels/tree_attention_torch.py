"""Tree attention in PyTorch: the padded-batch path the CPU runs, and the readable reference.

The fast path has no per-request Python loop. A step's plan (``padded_layout``, built once
and shared by every layer) pads the B requests' queries into ``[B, n_max]`` slots, lists
the cache rows of each request's first ``L_max`` positions, and turns the visibility rule
into one additive mask ``[B, 1, n_max, L_max]`` (0 visible, -inf hidden). A layer then
gathers q and K/V with three ``index_select`` calls, runs one masked
``scaled_dot_product_attention`` (grouped-query heads via ``enable_gqa``), and gathers the
real rows back into ``out``. ``n_max`` and ``L_max`` are host bounds, so every shape comes
from host sizes and the plan needs no device read. Where the caller knows more, the gathers
go: with uniform query counts the padded layout is q itself (a view), and a finite
contiguous cache is read as a view of its first ``L_max`` positions (``attention_plan``).
With the cache as a view, float32 CPU tensors run the extension's kernel instead of SDPA
(``cpu_attention``: torch's CPU flash kernel is slow at a few queries per request), ragged
query counts too (q gathered into its padded slots and the real rows taken back), and in the
row-invariant mode (``SPECDEC_ROW_INVARIANT=1``) gathered caches too, so that one body serves every row.

A request whose context is shorter than ``L_max`` re-reads its own last position in the
padding (never stale or uninitialised cache memory, whose NaN bits would poison the
masked sums), and a padded query slot re-reads the last real query; the mask hides both, a
padded query slot entirely (the kernel skips such slots; SDPA's outputs there are dropped).

``tree_attention_reference`` is the oracle: per request and in float64, the visibility
rule written out directly. Production never runs it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from specdec.kernels import cpu_attention
from specdec.kernels.tree_metadata import MASK_WORD_BITS, unpack_mask_rows

# scaled_dot_product_attention's enable_gqa (torch >= 2.5); older versions repeat the KV heads
SDPA_HAS_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)
LSE_SCORE_BUDGET = 1 << 24  # float32 scores the log-sum-exp path holds at once


# --------------------------------------------------------------------------------------------
# The plan's tensors
# --------------------------------------------------------------------------------------------


def padded_layout(q_offsets, prefix_lens, tree_start, tree_mask, block_table, *, num_tokens: int,
                  cache_shape, max_queries: int, max_context: int, dtype: torch.dtype, uniform: bool = False,
                  kv_view: bool = False):  # fmt: skip
    """``(query_rows, token_slots, kv_rows, attn_bias)`` of a step, by device ops only (no sync).

    query_rows  [B, n_max]            int64  q row of each padded query slot (None: ``uniform``)
    token_slots [T]                   int64  padded slot (b * n_max + i) of each q row (None: ``uniform``)
    kv_rows     [B * L_max]           int64  row of ``cache.reshape(-1, Hkv, D)`` of each position
                                             (None: ``kv_view``, positions 0 .. L_max-1 of rows 0 .. B-1)
    attn_bias   [B, 1, n_max, L_max]  dtype  0 where the query sees the position, -inf elsewhere

    Values come from q_offsets (all four), prefix_lens (kv_rows, attn_bias), block_table
    (kv_rows), tree_start and tree_mask (attn_bias); shapes only from the host sizes.
    ``uniform``: every request has n_max = T / B queries. ``kv_view``: contiguous cache, finite.
    """
    device = q_offsets.device
    batch, n_max, length = prefix_lens.numel(), max_queries, max_context
    rows, slots = cache_shape[0], cache_shape[1]
    prefix = prefix_lens  # int32; arithmetic with the int64 ranges below promotes
    i = torch.arange(n_max, device=device)
    pos = torch.arange(length, device=device)

    if uniform:
        query_rows = token_slots = None
        context = None if kv_view and tree_mask is None else prefix + n_max
    else:
        offsets = q_offsets.long()
        starts, counts = offsets[:-1], offsets[1:] - offsets[:-1]  # [B]
        query_rows = (starts[:, None] + torch.minimum(i, (counts - 1).clamp(min=0)[:, None])).clamp_(0, num_tokens - 1)
        token = torch.arange(num_tokens, device=device)
        req = torch.searchsorted(offsets[1:].contiguous(), token, right=True).clamp_(max=batch - 1)
        token_slots = req * n_max + (token - starts[req]).clamp_(0, n_max - 1)
        context = prefix + counts
    if kv_view:
        kv_rows = None
    elif block_table is None:
        kv_pos = torch.minimum(pos, (context - 1).clamp(min=0)[:, None])  # [B, L]: padding repeats the last position
        kv_rows = torch.arange(batch, device=device)[:, None] * slots + kv_pos
    else:
        kv_pos = torch.minimum(pos, (context - 1).clamp(min=0)[:, None])
        page = (kv_pos // slots).clamp_(max=block_table.shape[1] - 1)
        block = block_table.long().gather(1, page).clamp_(0, rows - 1)
        kv_rows = block * slots + kv_pos % slots

    if tree_mask is None:  # causal: query i sees positions up to prefix + i
        visible = pos <= (prefix[:, None] + i)[:, :, None]  # [B, n, L]
    else:  # positions before tree_start always; later ones inside the context by their mask bit
        first = tree_start.long()[:, None]  # [B, 1]
        width = tree_mask.shape[1] * MASK_WORD_BITS
        rows_mask = tree_mask if uniform else tree_mask[query_rows.flatten()]
        bits = unpack_mask_rows(rows_mask, width).view(batch, n_max, width)
        bit = (pos - first).clamp(0, width - 1)  # [B, L]
        in_tree = (pos >= first) & (pos - first < width) & (pos < context[:, None])
        tree_bit = bits.gather(2, bit[:, None, :].expand(batch, n_max, length))
        visible = (pos < first)[:, None, :] | (in_tree[:, None, :] & tree_bit)
    if not uniform:  # a padded query slot sees nothing: the kernel passes it by (a prompt beside decode rows)
        visible = visible & (i[None, :] < counts[:, None])[:, :, None]
    attn_bias = torch.full((batch, 1, n_max, length), -math.inf, dtype=dtype, device=device)
    attn_bias.masked_fill_(visible[:, None], 0.0)
    return query_rows, token_slots, None if kv_rows is None else kv_rows.flatten(), attn_bias


# --------------------------------------------------------------------------------------------
# The op's PyTorch body
# --------------------------------------------------------------------------------------------


def tree_attention_torch(q, k_cache, v_cache, q_offsets, prefix_lens, tree_start, tree_mask, block_table,
                         query_rows, token_slots, kv_rows, attn_bias, part_out, part_lse, softmax_scale, tile,
                         out, lse) -> None:  # fmt: skip
    """The op's PyTorch body (positional arguments of ``torch.ops.specdec.tree_attention``).

    Uses only the plan's padded-batch tensors; the layout tensors went into them already.
    Without ``lse``: fused SDPA, or on float32 CPU tensors laid out as views (no gathers) the
    extension's kernel (``cpu_attention``). With ``lse``: the same masked softmax written out in float32.
    """
    if q.shape[0] == 0:
        return
    if attn_bias is None:
        raise RuntimeError("this attention plan was built for the triton backend; plan again for torch")
    if lse is None and cpu_attention.applies(q) and (kv_rows is None or cpu_attention.row_invariant()):
        if kv_rows is not None:  # row-invariant mode: the gathered caches through the same kernel as views
            batch, length, shape = attn_bias.shape[0], attn_bias.shape[3], k_cache.shape[-2:]
            k_cache = k_cache.reshape(-1, *shape).index_select(0, kv_rows).view(batch, length, *shape)
            v_cache = v_cache.reshape(-1, *shape).index_select(0, kv_rows).view(batch, length, *shape)
        if query_rows is None:  # the cache as a view: the C++ kernel
            cpu_attention.padded_attention(q, k_cache, v_cache, attn_bias, softmax_scale, out)
        else:  # ragged query counts (an adaptive step's depths): pad q, attend, keep the real rows
            padded = q.index_select(0, query_rows.flatten())
            padded_out = torch.empty_like(padded)
            cpu_attention.padded_attention(padded, k_cache, v_cache, attn_bias, softmax_scale, padded_out)
            torch.index_select(padded_out, 0, token_slots, out=out)
        return
    batch, _, n_max, length = attn_bias.shape
    heads, head_dim = q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[2]
    if query_rows is None:  # uniform query counts: the padded layout is q itself
        qp = q.view(batch, n_max, heads, head_dim).transpose(1, 2)
    else:
        qp = q.index_select(0, query_rows.flatten()).view(batch, n_max, heads, head_dim).transpose(1, 2)
    if kv_rows is None:  # a finite contiguous cache: its first L_max positions, as views
        k, v = k_cache[:batch, :length], v_cache[:batch, :length]
    else:
        k = k_cache.reshape(-1, kv_heads, head_dim).index_select(0, kv_rows).view(batch, length, kv_heads, head_dim)
        v = v_cache.reshape(-1, kv_heads, head_dim).index_select(0, kv_rows).view(batch, length, kv_heads, head_dim)
    k, v = k.transpose(1, 2), v.transpose(1, 2)  # [B, Hkv, L, D]
    if lse is None:
        if SDPA_HAS_GQA:
            o = F.scaled_dot_product_attention(qp, k, v, attn_mask=attn_bias, scale=softmax_scale, enable_gqa=True)
        else:
            group = heads // kv_heads
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
            o = F.scaled_dot_product_attention(qp, k, v, attn_mask=attn_bias, scale=softmax_scale)
    else:
        o, row_lse = _attention_with_lse(qp, k, v, attn_bias, softmax_scale)
        if token_slots is None:
            lse.view(batch, n_max, heads).copy_(row_lse.transpose(1, 2))
        else:
            lse.copy_(row_lse.transpose(1, 2).reshape(batch * n_max, heads).index_select(0, token_slots))
    if token_slots is None:
        out.view(batch, n_max, heads, head_dim).copy_(o.transpose(1, 2))
    else:
        out.copy_(o.transpose(1, 2).reshape(batch * n_max, heads, head_dim).index_select(0, token_slots))


def _attention_with_lse(q, k, v, bias, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked softmax attention that also returns the log-sum-exp, in float32 and query chunks.

    q [B, Hq, n, D], k/v [B, Hkv, L, D], bias [B, 1, n, L] -> (out [B, Hq, n, D] in q's dtype,
    lse [B, Hq, n] float32). A row with no visible position gets out 0 and lse -inf.
    """
    batch, heads, n, head_dim = q.shape
    kv_heads, length = k.shape[1], k.shape[2]
    group = heads // kv_heads
    kf, vf = k.float().unsqueeze(2), v.float().unsqueeze(2)  # [B, Hkv, 1, L, D]: broadcast over the group
    out = torch.empty(batch, heads, n, head_dim, dtype=q.dtype, device=q.device)
    lse = torch.empty(batch, heads, n, dtype=torch.float32, device=q.device)
    chunk = max(1, LSE_SCORE_BUDGET // max(1, batch * heads * length))
    for c0 in range(0, n, chunk):
        c1 = min(n, c0 + chunk)
        qc = q[:, :, c0:c1].float().view(batch, kv_heads, group, c1 - c0, head_dim)
        s = torch.matmul(qc, kf.transpose(-1, -2)).mul_(scale).add_(bias[:, :, None, c0:c1].float())
        row_max = s.amax(-1, keepdim=True).nan_to_num_(neginf=0.0)  # an empty row: subtract 0, not -inf
        p = s.sub_(row_max).exp_()
        row_sum = p.sum(-1, keepdim=True)
        o = torch.matmul(p, vf) / row_sum.clamp_min(1e-30)
        out[:, :, c0:c1] = o.view(batch, heads, c1 - c0, head_dim)
        lse[:, :, c0:c1] = (row_max + row_sum.log()).view(batch, heads, c1 - c0)  # log 0 = -inf
    return out, lse


# --------------------------------------------------------------------------------------------
# PyTorch reference (the oracle)
# --------------------------------------------------------------------------------------------


def request_kv(k_cache, v_cache, block_table, b: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Request b's first ``length`` cached K and V, ``[L, Hkv, D]`` each, from either layout."""
    if block_table is None:
        return k_cache[b, :length], v_cache[b, :length]
    # paged: gather whole blocks, then trim: [blocks, block_size, Hkv, D] -> [L, Hkv, D]
    blocks = block_table[b, : -(-length // k_cache.shape[1])].long()
    return k_cache[blocks].flatten(0, 1)[:length], v_cache[blocks].flatten(0, 1)[:length]


def tree_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    q_offsets: torch.Tensor,
    prefix_lens: torch.Tensor,
    tree_mask: torch.Tensor | None,
    block_table: torch.Tensor | None,
    softmax_scale: float,
    tree_start: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Readable tree attention in float64: returns (out [Tq, Hq, D], lse [Tq, Hq]), both float64.

    Query i of request b (prefix p, n queries, tree start s, default p) sees position t of
    its cache iff ``t < s``, or ``s <= t < p + n`` and bit ``t - s`` of its mask row is set
    (``tree_mask=None``: causal, ``t <= p + i``). Inputs are assumed valid.
    """
    tokens, heads, head_dim = q.shape
    group = heads // k_cache.shape[2]
    out = torch.zeros(tokens, heads, head_dim, dtype=torch.float64, device=q.device)
    lse = torch.full((tokens, heads), -math.inf, dtype=torch.float64, device=q.device)
    bounds, prefixes = q_offsets.tolist(), prefix_lens.tolist()
    starts = prefixes if tree_start is None else tree_start.tolist()
    for b, prefix in enumerate(prefixes):
        first, n = bounds[b], bounds[b + 1] - bounds[b]
        if n == 0:
            continue
        length = prefix + n
        k, v = request_kv(k_cache, v_cache, block_table, b, length)
        k = k.double().repeat_interleave(group, dim=1)  # [L, Hq, D]
        v = v.double().repeat_interleave(group, dim=1)
        t = torch.arange(length, device=q.device)
        if tree_mask is None:
            visible = t[None, :] <= prefix + torch.arange(n, device=q.device)[:, None]  # [n, L]
        else:
            s = starts[b]
            bits = unpack_mask_rows(tree_mask[first : first + n], tree_mask.shape[1] * MASK_WORD_BITS)
            bits = F.pad(bits, (0, max(0, length - s - bits.shape[1])))  # bits past W * 64 are unset
            visible = (t < s).expand(n, length).clone()
            visible[:, s:] = bits[:, : length - s]
        scores = torch.einsum("nhd,lhd->hnl", q[first : first + n].double(), k) * softmax_scale
        scores = scores.masked_fill(~visible, -math.inf)
        row_lse = torch.logsumexp(scores, -1)  # [Hq, n]; -inf for a row that sees nothing
        weights = torch.exp(scores - row_lse.nan_to_num(neginf=0.0)[..., None])
        out[first : first + n] = torch.einsum("hnl,lhd->nhd", weights, v)
        lse[first : first + n] = row_lse.T
    return out, lse
