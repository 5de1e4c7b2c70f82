"""The token trees EAGLE drafts: a default static tree (EAGLE-1) and the dynamic tree's rerank (EAGLE-2).

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

import torch


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
