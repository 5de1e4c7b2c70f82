"""Token trees over a block drafter's per-position distributions, best first (DDTree).

A parallel draft gives, in one forward, a distribution for each of the next D positions, each from
the committed prefix alone. Every node at depth d therefore draws its children from the same
distribution q_d, and a path's score is the product of its tokens' probabilities (a sum of
log-probabilities here). The best tree under a node budget n is the ``n - 1`` highest-scoring
paths (DDTree's best-first expansion). A child's score never exceeds its parent's, so those paths
always contain their prefixes: the selection is a tree.

It is built on the device, without a read-back: each depth keeps its ``n - 1`` best nodes (a
node among the best ``n - 1`` overall is among the best ``n - 1`` of its depth, its parent is
kept at the depth above, and its token is among the ``n - 1`` best of its q_d), and
``eagle_trees.rerank`` picks the best ``n - 1`` of everything kept.
"""

from __future__ import annotations

import torch

from specdec.decoding.eagle_trees import rerank


def best_first_trees(
    log_probs: torch.Tensor, roots: torch.Tensor, max_depth: torch.Tensor, keep: torch.Tensor, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each request's root and its ``keep[r]`` most probable paths of at most ``max_depth[r]`` tokens, as a tree.

    Parameters
    ----------
    log_probs : fp32 ``[R, D, V]``: row r's log-probabilities of the token at depth d + 1 (-inf: never drafted).
    roots : int64 ``[R]`` the roots' tokens.
    max_depth : int64 ``[R]`` deepest level each request may keep (<= D).
    keep : int64 ``[R]`` drafted nodes each request keeps (<= width - 1).
    width : a host int >= 2: nodes per row of the outputs (the largest tree).

    Returns
    -------
    (tokens int64 ``[R, width]``, parents int32 ``[R, width]``), root first, then the kept nodes level by level,
    local parent indices; row r's entries past ``1 + keep[r]`` are padding (``eagle_trees.rerank``).

    Example
    -------
    >>> q = torch.tensor([[[0.6, 0.3, 0.1], [0.7, 0.2, 0.1]]]).log()   # depth 1 and depth 2 distributions
    >>> t, p = best_first_trees(q, torch.tensor([7]), torch.tensor([2]), torch.tensor([3]), 4)
    >>> t.tolist(), p.tolist()                                          # paths 0 (.6), 0-0 (.42), 1 (.3)
    ([[7, 0, 1, 0]], [[-1, 0, 0, 1]])
    """
    rows, levels, vocab = log_probs.shape
    beam = min(width - 1, vocab)
    best_score, best_token = log_probs.topk(beam, dim=-1)  # [R, D, beam], best first
    score = best_score[:, 0]
    scores, tokens = [score], [best_token[:, 0]]
    parents = [torch.full((rows, beam), -1, dtype=torch.int64, device=log_probs.device)]
    for level in range(1, levels):  # level d's kept nodes are numbered d * beam .. d * beam + beam - 1
        score, pick = (score[:, :, None] + best_score[:, level, None, :]).flatten(1).topk(beam, dim=-1)
        scores.append(score)
        tokens.append(best_token[:, level].gather(1, pick % beam))
        parents.append(pick // beam + (level - 1) * beam)
    node_depth = torch.arange(1, levels + 1, device=log_probs.device).repeat_interleave(beam)
    return rerank(
        torch.cat(scores, dim=1), torch.cat(tokens, dim=1), torch.cat(parents, dim=1), node_depth, roots, max_depth,
        keep, width,
    )  # fmt: skip
