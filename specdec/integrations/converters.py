"""Token-tree layouts of other engines, to and from specdec's (``verify_tree``, ``tree_attention``).

specdec's trees: nodes of all requests flattened, request b's nodes at ``offsets[b]:offsets[b+1]``
(int32 ``[B+1]``), ``parents`` int32 local indices with -1 for the root (node 0), parents before
children. Tree masks: int64 ``[N, ceil(n_max/64)]``, bit j of row i (word j // 64, bit j % 64)
set when local node j is an ancestor-or-self of node i; prefix tokens are not in the mask
(every node sees the whole prefix).

SGLang (EAGLE / n-gram tree verification) keeps fixed-width trees, ``n`` nodes per request,
node 0 the last verified token, as int64 ``[B, n]`` lists of local indices, -1 = none:
``retrive_next_token[b, i]`` is node i's first child and ``retrive_next_sibling[b, i]`` the next
child of node i's parent. Its kernels try children in that sibling order; specdec tries them
in node order, which changes which draws decide but not the distribution of the output.

FlashInfer (``BatchPrefillWithPagedKVCacheWrapper.plan(custom_mask=... | packed_custom_mask=...)``)
takes per request a boolean ``[qo_len, kv_len]`` matrix, True = attend, flattened row-major and
the requests concatenated; packed, each request's bits are packed on their own into whole
uint8 bytes (``segment_packbits(..., bitorder="little")``: element 8k + t is bit t, counted
from the least significant, of byte k) and ``mask_indptr`` [B+1] gives byte offsets. For a
tree the query rows are its nodes and the key columns the ``kv_len - qo_len`` prefix tokens
followed by the nodes themselves.
"""

from __future__ import annotations

import torch

from specdec.kernels import pack_mask_rows, unpack_mask_rows

_BYTE_BITS = 8


def sglang_to_parents(retrive_next_token: torch.Tensor, retrive_next_sibling: torch.Tensor) -> torch.Tensor:
    """SGLang's first-child / next-sibling lists -> specdec ``parents``.

    Parameters
    ----------
    retrive_next_token, retrive_next_sibling : int ``[B, n]``, local indices, -1 = none.

    Returns
    -------
    parents : int32 ``[B * n]`` (request b's nodes at ``b*n:(b+1)*n``, so offsets are ``arange(B+1) * n``).

    Example
    -------
    >>> first_child = torch.tensor([[4, 2, 3, -1, 5, -1]])
    >>> next_sibling = torch.tensor([[-1, -1, -1, -1, 1, -1]])
    >>> sglang_to_parents(first_child, next_sibling).tolist()
    [-1, 0, 1, 2, 0, 4]
    """
    for name, t in (("retrive_next_token", retrive_next_token), ("retrive_next_sibling", retrive_next_sibling)):
        if t.dim() != 2 or t.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{name} must be an int32/int64 [B, n] tensor, got {t.dtype} {tuple(t.shape)}")
    if retrive_next_token.shape != retrive_next_sibling.shape:
        raise ValueError("retrive_next_token and retrive_next_sibling must have the same shape")
    batch, n = retrive_next_token.shape
    child, sibling = retrive_next_token.long(), retrive_next_sibling.long()
    if ((child < -1) | (child >= n) | (sibling < -1) | (sibling >= n)).any():
        raise ValueError(f"retrive_next_token / retrive_next_sibling entries must lie in [-1, {n})")
    rows = torch.arange(batch, device=child.device)[:, None].expand(batch, n)
    nodes = torch.arange(n, device=child.device).expand(batch, n)
    links = torch.zeros(batch, n + 1, dtype=torch.long, device=child.device)  # column n collects the -1s
    links.scatter_add_(1, child.where(child >= 0, n), torch.ones_like(child))
    links.scatter_add_(1, sibling.where(sibling >= 0, n), torch.ones_like(sibling))
    expected = torch.ones(batch, n, dtype=torch.long, device=child.device)
    expected[:, 0] = 0
    if not torch.equal(links[:, :n], expected):
        raise ValueError("retrive_next_token / retrive_next_sibling must reach every node but the root exactly once")
    unset = n  # sentinel while parents propagate along sibling chains
    parent = torch.full((batch, n + 1), unset, dtype=torch.long, device=child.device)
    parent[:, 0] = -1
    has_child = child >= 0
    parent[rows[has_child], child[has_child]] = nodes[has_child]
    previous = torch.full((batch, n + 1), n, dtype=torch.long, device=child.device)
    has_sibling = sibling >= 0
    previous[rows[has_sibling], sibling[has_sibling]] = nodes[has_sibling]
    for _ in range(n):  # each pass moves every parent one step along its sibling chain
        inherited = parent.gather(1, previous)
        parent = torch.where((parent == unset) & (previous < n), inherited, parent)
    parent = parent[:, :n]
    if ((parent == unset) | (parent >= nodes)).any():
        raise ValueError("retrive_next_token must list parents before children (node order must be topological)")
    return parent.flatten().to(torch.int32)


def parents_to_sglang(parents: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """specdec ``parents`` of B trees of ``n`` nodes each -> SGLang's int64 ``(next_token, next_sibling)`` ``[B, n]``.

    Children are listed in node order (first child = the lowest-numbered child).
    """
    if parents.dim() != 1 or parents.numel() % n:
        raise ValueError(f"parents must be a 1-D tensor of B * n = B * {n} entries, got shape {tuple(parents.shape)}")
    local = parents.long().view(-1, n)
    batch = local.shape[0]
    next_token = torch.full((batch, n + 1), -1, dtype=torch.long, device=parents.device)
    next_sibling = torch.full((batch, n), -1, dtype=torch.long, device=parents.device)
    for i in range(n - 1, 0, -1):  # from the last node back, so each list ends up in node order
        p = local[:, i]
        rows = torch.arange(batch, device=parents.device)
        slot = p.where(p >= 0, n)
        next_sibling[:, i] = next_token[rows, slot]
        next_token[rows, slot] = i
    return next_token[:, :n], next_sibling


def _mask_element_index(offsets: torch.Tensor, kv_lens: torch.Tensor, byte_offsets: torch.Tensor):
    """Bit position, in FlashInfer's packed layout, of every (node row, tree column) of every request."""
    sizes = (offsets[1:] - offsets[:-1]).long()
    n_max = int(sizes.max()) if sizes.numel() else 0
    request = torch.repeat_interleave(torch.arange(sizes.numel(), device=offsets.device), sizes)
    row_in_tree = torch.arange(request.numel(), device=offsets.device) - offsets[:-1].long()[request]
    kv = kv_lens.long()[request]
    column = torch.arange(n_max, device=offsets.device)
    start = byte_offsets.long()[request] * _BYTE_BITS + row_in_tree * kv + (kv - sizes[request])
    return start[:, None] + column, column < sizes[request][:, None], n_max, request, kv - sizes[request]


def flashinfer_mask_to_rows(
    packed_mask: torch.Tensor, mask_indptr: torch.Tensor, offsets: torch.Tensor, kv_lens: torch.Tensor
) -> torch.Tensor:
    """FlashInfer's packed custom mask of B trees -> specdec int64 mask rows.

    Parameters
    ----------
    packed_mask : uint8, the concatenated per-request segments (see the module docstring).
    mask_indptr : int ``[B+1]``, byte offset of each request's segment.
    offsets : int32 ``[B+1]``, the trees' node offsets (FlashInfer's ``qo_indptr``).
    kv_lens : int ``[B]``, keys per request: prefix length + tree size.

    Returns
    -------
    int64 ``[N, ceil(n_max/64)]`` tree mask rows. Every node must see its whole prefix
    (ValueError otherwise: such a mask is not a tree mask over a shared prefix).
    """
    if packed_mask.dtype != torch.uint8 or packed_mask.dim() != 1:
        raise TypeError(f"packed_mask must be a 1-D uint8 tensor, got {packed_mask.dtype} {tuple(packed_mask.shape)}")
    bits = ((packed_mask.long()[:, None] >> torch.arange(_BYTE_BITS, device=packed_mask.device)) & 1).flatten()
    index, valid, n_max, request, prefix = _mask_element_index(offsets, kv_lens, mask_indptr)
    if valid.any() and int(index[valid].max()) >= bits.numel():
        raise ValueError("packed_mask is shorter than mask_indptr, offsets and kv_lens say")
    tree = torch.where(valid, bits[index.clamp_max(max(bits.numel() - 1, 0))], 0).bool()
    row_start = index[:, 0] - prefix
    context = torch.arange(int(prefix.max()) if prefix.numel() else 0, device=packed_mask.device)
    seen = context < prefix[:, None]
    context_bits = bits[(row_start[:, None] + context).clamp_max(max(bits.numel() - 1, 0))].bool()
    if (seen & ~context_bits).any():
        raise ValueError("packed_mask hides part of a prefix from a tree node: not a tree mask over a shared prefix")
    return pack_mask_rows(tree) if n_max else torch.zeros(0, 1, dtype=torch.int64)


def rows_to_flashinfer_mask(
    mask_rows: torch.Tensor, offsets: torch.Tensor, prefix_lens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """specdec mask rows of B trees over prefixes of ``prefix_lens`` -> FlashInfer ``(packed_mask, mask_indptr)``.

    ``kv_lens`` for FlashInfer are ``prefix_lens + tree sizes``; the packed mask is what
    ``plan(packed_custom_mask=...)`` takes, ``mask_indptr`` int32 ``[B+1]`` its byte offsets.
    """
    sizes = (offsets[1:] - offsets[:-1]).long()
    kv_lens = prefix_lens.long() + sizes
    segment_bytes = (sizes * kv_lens + _BYTE_BITS - 1) // _BYTE_BITS
    mask_indptr = torch.zeros(sizes.numel() + 1, dtype=torch.int32, device=mask_rows.device)
    mask_indptr[1:] = segment_bytes.cumsum(0)
    bits = torch.zeros(int(mask_indptr[-1]) * _BYTE_BITS, dtype=torch.long, device=mask_rows.device)
    index, valid, n_max, request, prefix = _mask_element_index(offsets, kv_lens, mask_indptr)
    bits[index[valid]] = unpack_mask_rows(mask_rows, n_max)[valid].long()
    context = torch.arange(int(prefix.max()) if prefix.numel() else 0, device=mask_rows.device)
    seen = context < prefix[:, None]
    bits[((index[:, :1] - prefix[:, None]) + context)[seen]] = 1
    shifts = torch.arange(_BYTE_BITS, device=mask_rows.device)
    weights = torch.ones(_BYTE_BITS, dtype=torch.long, device=mask_rows.device) << shifts
    return (bits.view(-1, _BYTE_BITS) * weights).sum(1).to(torch.uint8), mask_indptr
