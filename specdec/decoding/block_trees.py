"""A block drafter's proposals from its per-position distributions: chains, and token trees best first (DDTree).

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

from specdec._transfer import to_device
from specdec.decoding.draft_model import DRAFT_SEED_SALT
from specdec.decoding.eagle_trees import rerank
from specdec.decoding.proposal import DeviceTrees, Proposal
from specdec.decoding.strategy import StepContext
from specdec.kernels.filtered_probs import filtered_probs
from specdec.kernels.sample_probs import sample_probs
from specdec.kernels.uniforms import ROLE_TARGET

CHAIN_RULES = ("coupled", "stochastic", "deterministic")


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


def block_tree_nodes(max_nodes: int | None, depth: int, levels: int, vocab: int) -> int:
    """Nodes, root included, that a block drafter of ``depth`` positions proposes when ``levels`` are allowed: a chain's
    ``1 + levels`` (``max_nodes`` None), or a tree's share of its budget, ``ceil((max_nodes - 1) * levels / depth)``
    drafted nodes, so that a shallower tree is a cheaper one (the adaptive controller's ``draft_nodes`` hook)."""
    levels = min(max(levels, 0), depth)
    if max_nodes is None:
        return 1 + levels
    drafted = -(-(max_nodes - 1) * levels // depth)
    per_level = min(max_nodes - 1, vocab)  # paths kept per depth
    return 1 + min(drafted, per_level * levels)


def tree_proposal(log_probs: torch.Tensor, roots: list[int], limits: list[int], nodes: list[int]) -> Proposal:
    """The best-first trees of ``nodes[r]`` nodes and at most ``limits[r]`` levels over ``log_probs [R, D, V]``, as a
    ``Proposal`` for the deterministic rule (greedy requests get the target's tokens, sampled ones are exact)."""
    device, width = log_probs.device, max(nodes)
    tokens, parents = best_first_trees(
        log_probs, to_device(roots, torch.int64, device), to_device(limits, torch.int64, device),
        to_device([n - 1 for n in nodes], torch.int64, device), width,
    )  # fmt: skip
    if any(n != width for n in nodes):
        kept = to_device([r * width + i for r, n in enumerate(nodes) for i in range(n)], torch.int64, device)
        tokens, parents = tokens.flatten().index_select(0, kept), parents.flatten().index_select(0, kept)
    return Proposal(tokens.flatten(), DeviceTrees(parents.flatten(), list(nodes), limits), rule="deterministic")


def block_rule(rule: str | None, max_nodes: int | None, drafter: str) -> str:
    """The rule a block drafter's proposals take: ``rule`` checked, or the default (chains "coupled", trees
    "deterministic", the only rule trees take). Raises ValueError naming ``rule``."""
    if max_nodes is not None and rule not in (None, "deterministic"):
        raise ValueError(f"trees from {drafter} are verified by the deterministic rule; got rule={rule!r}")
    rule = ("coupled" if max_nodes is None else "deterministic") if rule is None else rule
    if rule not in CHAIN_RULES:
        raise ValueError(f"rule must be one of {CHAIN_RULES}, got {rule!r}")
    return rule


def chain_proposal(step: StepContext, logits: torch.Tensor, nodes: list[int], rule: str) -> Proposal:
    """Each request's root and a chain of ``nodes[r] - 1`` drafts from ``logits [R, k, V]`` (position j's
    distribution in row j): their argmax (``rule="deterministic"``, and every greedy request), a draw with the
    target's own race clocks at that position (``"coupled"``: a seed gives plain sampling's tokens), or an independent
    draw verified by the optimal rejection rule (``"stochastic"``: row j of ``draft_probs`` is q_{j+1}, the
    distribution node j's child was drawn from, whatever the drafts before it)."""
    rows, k, vocab = logits.shape
    roots = to_device(step.roots, torch.int64, logits.device)
    probs = None
    if step.greedy or rule == "deterministic":
        drafts = logits.argmax(-1)  # (a NaN row drafts some token; verification decides)
    else:
        params = step.params if rule == "coupled" else step.params._replace(seed=step.params.seed ^ DRAFT_SEED_SALT)
        params = params.repeat_rows(k, rows * k)
        params = params._replace(offset=params.offset + torch.arange(k, device=roots.device).repeat(rows))
        q = filtered_probs(logits.reshape(rows * k, vocab), params, check=False).probs
        counter = ROLE_TARGET if rule == "coupled" else 0  # coupled: the target's own clocks there
        drafts = sample_probs(q, params, counter=counter, check=False).long().view(rows, k)
        if rule == "stochastic":
            probs = torch.cat((q.view(rows, k, vocab), q.new_zeros(rows, 1, vocab)), dim=1)  # the last: no child
    tokens = torch.cat((roots[:, None], drafts), dim=1)
    parents = [list(range(-1, n - 1)) for n in nodes]
    tokens, probs = tokens.flatten(), None if probs is None else probs.flatten(0, 1)
    if any(n != k + 1 for n in nodes):  # cut each chain to its request's limit
        keep = to_device([r * (k + 1) + i for r, n in enumerate(nodes) for i in range(n)], torch.int64, roots.device)
        tokens, probs = tokens.index_select(0, keep), None if probs is None else probs.index_select(0, keep)
    return Proposal(tokens, parents, rule="deterministic" if probs is None else "stochastic", draft_probs=probs)
