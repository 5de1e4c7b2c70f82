"""The token trees EAGLE drafts: a default static tree (EAGLE-1) and what its levels gather, and the dynamic tree's
rerank (EAGLE-2).

EAGLE-2 (Li et al. 2024, "EAGLE-2: Faster Inference of Language Models with Dynamic Draft
Trees") scores every drafted node by its path confidence, the product of the head's
probabilities along its root path (a sum of log-probabilities here). Each level expands the
``top_k`` most confident nodes of the level before; when drafting ends, every drafted node is
reranked by confidence and the best ``n - 1`` become the verified tree. A child's confidence never
exceeds its parent's (a log-probability is <= 0), and a stable sort puts the parent (drafted
first) ahead of a child with the same value, so the best ``n - 1`` always contain their
ancestors: the selection is a tree. Everything here runs on the device, without a read-back.
"""

from __future__ import annotations

import heapq
import itertools

import torch

from specdec._transfer import to_device
from specdec.decoding.static_tree import StaticTree
from specdec.kernels import pack_mask_rows


def log_probs(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """fp32 log-softmax of ``logits [..., V] / temperature``; NaN entries become -inf (never chosen before a number)."""
    return torch.log_softmax(logits.float() / temperature, dim=-1).nan_to_num(nan=-torch.inf, posinf=-torch.inf)


def rerank(
    scores: torch.Tensor,
    tokens: torch.Tensor,
    parents: torch.Tensor,
    node_depth: torch.Tensor,
    roots: torch.Tensor,
    max_depth: torch.Tensor,
    keep: torch.Tensor,
    width: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The verified trees: each request's root and its ``keep[r]`` most confident drafted nodes within ``max_depth[r]``.

    Parameters
    ----------
    scores : fp32 ``[R, M]`` path confidences (log) of the drafted nodes, numbered level by level
        (a parent's number is below its children's).
    tokens : int64 ``[R, M]`` their tokens.
    parents : int64 ``[R, M]`` the drafted number of each node's parent, -1 for the root.
    node_depth : int64 ``[M]`` depth of each drafted number (1 for the root's children).
    roots : int64 ``[R]`` the roots' tokens.
    max_depth : int64 ``[R]`` deepest level each request may keep.
    keep : int64 ``[R]`` drafted nodes each request keeps (at most its nodes within ``max_depth``).
    width : a host int >= 1 + max(keep): nodes per row of the outputs.

    Returns
    -------
    (tokens int64 ``[R, width]``, parents int32 ``[R, width]``): root first, then the kept nodes in
    drafted order (topological), local parent indices; row r's entries past ``1 + keep[r]`` are padding.

    Example
    -------
    >>> s = torch.tensor([[-0.1, -2.0, -0.3, -0.2, -3.0]])      # nodes 0, 1 at depth 1; 2, 3, 4 children of 0
    >>> t, p = rerank(s, torch.tensor([[10, 11, 12, 13, 14]]), torch.tensor([[-1, -1, 0, 0, 0]]),
    ...               torch.tensor([1, 1, 2, 2, 2]), torch.tensor([7]), torch.tensor([2]), torch.tensor([3]), 4)
    >>> t.tolist(), p.tolist()
    ([[7, 10, 12, 13]], [[-1, 0, 1, 1]])
    """
    rows, drafted = scores.shape
    device = scores.device
    slots = width - 1
    valid = node_depth[None, :] <= max_depth[:, None]
    key = torch.where(valid, scores, -torch.inf)
    # Stable: equal confidences keep drafted order, so parents (and valid nodes) come first.
    best = torch.sort(key, dim=1, descending=True, stable=True).indices[:, :slots]
    rank = torch.arange(slots, device=device)
    # Kept nodes in drafted order; the dropped ones get numbers past every drafted node and sort last.
    chosen = torch.where(rank[None, :] < keep[:, None], best, drafted + rank[None, :]).sort(dim=1).values
    local = torch.zeros(rows, drafted + slots, dtype=torch.int64, device=device)
    local.scatter_(1, chosen, (rank + 1).expand(rows, slots))  # drafted number -> local index
    picked = chosen.clamp(max=drafted - 1)
    parent = parents.gather(1, picked)
    local_parent = torch.where(parent < 0, 0, local.gather(1, parent.clamp(min=0)))
    tree_tokens = torch.cat((roots[:, None], tokens.gather(1, picked)), dim=1)
    minus_one = torch.full((rows, 1), -1, dtype=torch.int64, device=device)
    return tree_tokens, torch.cat((minus_one, local_parent), dim=1).to(torch.int32)


def default_static_tree(tree_budget: int, depth: int, top_k: int, *, top1: float = 0.8, decay: float = 0.15):
    """An EAGLE-1 static tree: the ``tree_budget - 1`` most likely top-k index paths, best first.

    A path's prior value is the product over its depths of ``top1 * decay ** rank`` (the head's
    rank-r candidate is right with a probability falling geometrically in r); a path's value is
    below its prefix's, so the best paths form a tree. Ties: shorter, then smaller indices.

    Example
    -------
    >>> default_static_tree(6, depth=3, top_k=2)
    [[0], [0, 0], [0, 0, 0], [1], [0, 1]]
    """
    heap = [(-top1 * decay**r, 1, (r,)) for r in range(top_k)]
    heapq.heapify(heap)
    paths = []
    while heap and len(paths) < tree_budget - 1:
        value, length, path = heapq.heappop(heap)
        paths.append(list(path))
        if length < depth:
            for r in range(top_k):
                heapq.heappush(heap, (value * top1 * decay**r, length + 1, path + (r,)))
    return paths


def static_levels(tree: StaticTree):
    """Per level of a static tree (host tensors): what ``EagleStrategy._draft_static`` gathers and feeds.

    Returns (choose, fed, masks): ``choose[l] = (take, parent_slot, widest)``: the level-(l+1) nodes' tokens are
    ``topk(parents' logits).view(R, -1)[:, take]`` (take = parent slot * widest + rank), ``parent_slot`` each node's
    slot among the fed nodes above; ``fed[l]``: the level-(l+1) nodes with children (positions within the level),
    fed in that order; ``masks[l]``: their ancestor-or-self rows over every fed node, in head-cache order.
    """
    depth, parents, rank = tree.depth, tree.parents, tree.rank
    by_level = [[i for i in range(tree.size) if depth[i] == d] for d in range(1, tree.max_depth + 1)]
    has_children = {p for p in parents if p >= 0}
    fed_nodes = [[i for i in level if i in has_children] for level in by_level]
    head_index = {i: j for j, i in enumerate(itertools.chain.from_iterable(fed_nodes))}
    bits = max(len(head_index), 1)
    choose, fed, masks = [], [], []
    for d, level in enumerate(by_level):
        above = [0] if d == 0 else fed_nodes[d - 1]
        slot = {node: s for s, node in enumerate(above)}
        widest = max(rank[i] for i in level) + 1
        parent_slot = [slot[parents[i]] for i in level]
        take = [s * widest + rank[i] for s, i in zip(parent_slot, level)]
        choose.append((torch.tensor(take), torch.tensor(parent_slot), widest))  # widest stays a host int
        fed.append(torch.tensor([level.index(i) for i in fed_nodes[d]], dtype=torch.int64))
        rows = []
        for i in fed_nodes[d]:
            row, node = [False] * bits, i
            while node > 0:
                row[head_index[node]] = True
                node = parents[node]
            rows.append(row)
        masks.append(pack_mask_rows(torch.tensor(rows, dtype=torch.bool).view(len(rows), bits)))
    return choose, fed, masks


def levels_on(values, device):
    """Host tensors (or tuples and lists of them) on ``device``, sent without waiting."""
    if isinstance(values, torch.Tensor):
        return to_device(values, values.dtype, device)
    if isinstance(values, (list, tuple)):
        return type(values)(levels_on(v, device) for v in values)
    return values
