"""Drafts from a parallel draft model (PARD): every draft token of a step from one draft forward.

Each step feeds the draft the committed tokens its cache lacks (``specdec.decoding.draft_cache``)
followed by ``depth - 1`` mask tokens, and reads one distribution per position ahead: q_1 from the
root's row, q_{j+1} from mask row j, each conditioned on the committed text only. The mask rows
are cut from the draft cache right after the forward, so it keeps committed text only. Two shapes:

- a chain: token j is drafted from q_j -- its argmax (``rule="deterministic"``, and every greedy
  request), a draw with the target's own race clocks at that position (``"coupled"``, the default:
  verified by "sample, then compare", so a seed gives plain sampling's tokens), or an independent
  draw verified by the optimal rejection rule (``"stochastic"``: row j of ``draft_probs`` is q_{j+1},
  the distribution node j's child was drawn from, whatever the drafts before it);
- a tree (``max_nodes``): the best paths by the product of the q_j under a node budget, built on
  the device (``block_trees.best_first_trees``, DDTree), verified by the deterministic rule: greedy
  requests get the target's greedy tokens and sampled ones are exact.
"""

from __future__ import annotations

import torch

from specdec._transfer import to_device
from specdec.decoding.block_trees import block_rule, block_tree_nodes, chain_proposal, tree_proposal
from specdec.decoding.draft_cache import DraftCacheStrategy
from specdec.decoding.eagle_trees import log_probs
from specdec.decoding.proposal import Proposal
from specdec.decoding.strategy import StepContext
from specdec.model.parallel_draft import ParallelDraft

CONFIDENCE_TEMPERATURE = 0.45  # the shipped draft's per-position distributions run flat (bench/e2e_parallel.py)


class ParallelDraftStrategy(DraftCacheStrategy):
    """Proposes a chain, or a best-first tree, from one forward of a parallel draft model per step.

    Parameters
    ----------
    draft : a ``ParallelDraft`` for the target (``ParallelDraft.from_pretrained``).
    depth : positions drafted per step, at most the draft's ``block_size`` (default: all of them).
    max_nodes : None for a chain of ``depth`` tokens; an int >= 2 for trees of that many nodes, root
        included (DDTree), at full depth: a tree cut to d levels (the adaptive controller's choice) keeps its
        share, ``ceil((max_nodes - 1) * d / depth)`` drafted nodes, so a shallower tree is a cheaper one.
    rule : for chains, "coupled" (default), "stochastic" or "deterministic" (module docstring); trees are
        verified by the deterministic rule only.
    confidence_temperature : trees rank paths by the product of ``softmax(logits / confidence_temperature)``;
        below 1 it sharpens the per-position distributions, which favours deeper paths over wider ones (it changes
        which tree is drafted, never what is emitted).
    fused : the draft's forward runs in C++ on the CPU where the extension can run it.
    """

    def __init__(
        self,
        draft: ParallelDraft,
        *,
        depth: int | None = None,
        max_nodes: int | None = None,
        rule: str | None = None,
        confidence_temperature: float = CONFIDENCE_TEMPERATURE,
        fused: bool = True,
    ):
        if not isinstance(draft, ParallelDraft):
            raise TypeError(f"draft must be a ParallelDraft (see ParallelDraft.from_pretrained), got {type(draft)}")
        depth = draft.block_size if depth is None else depth
        if not isinstance(depth, int) or not 1 <= depth <= draft.block_size:
            raise ValueError(f"depth must be an int in [1, {draft.block_size}] (the draft's block_size), got {depth!r}")
        if max_nodes is not None and (not isinstance(max_nodes, int) or max_nodes < 2):
            raise ValueError(f"max_nodes must be None (a chain) or an int >= 2, got {max_nodes!r}")
        if not isinstance(confidence_temperature, (int, float)) or not confidence_temperature > 0:
            raise ValueError(f"confidence_temperature must be a positive number, got {confidence_temperature!r}")
        rule = block_rule(rule, max_nodes, "a parallel draft")
        super().__init__(draft.model, fused=fused)
        self.parallel = draft
        self.depth = depth
        self.tree_nodes = max_nodes
        self.rule = rule
        self.confidence_temperature = float(confidence_temperature)

    @property
    def name(self) -> str:
        if self.tree_nodes is None:
            return f"parallel draft chain (K={self.depth}{'' if self.rule == 'coupled' else ', ' + self.rule})"
        return f"parallel draft tree ({self.tree_nodes} nodes, depth {self.depth})"

    @property
    def max_nodes(self) -> int:
        return self.depth + 1 if self.tree_nodes is None else self.tree_nodes

    @property
    def max_depth(self) -> int:
        return self.depth

    def draft_nodes(self, depth: int) -> int:
        """Nodes (root included) of the tree proposed when ``depth`` levels are allowed (the adaptive controller's
        optional hook)."""
        return block_tree_nodes(self.tree_nodes, self.depth, depth, self.parallel.vocab_size)

    def attach(self, target) -> None:
        if target.config.vocab_size != self.parallel.vocab_size:
            raise ValueError(
                f"the parallel draft drafts from a vocabulary of {self.parallel.vocab_size} tokens, the target has "
                f"{target.config.vocab_size}: load it for this target (ParallelDraft.from_pretrained(path, target))"
            )

    def propose(self, step: StepContext) -> Proposal:
        """One chain or tree per running request, within its depth and node limits, from one draft forward."""
        limits = [min(max(d, 0), self.depth) for d in step.max_depth]
        nodes = [min(n, self.draft_nodes(d)) for n, d in zip(step.max_nodes, limits)]
        limits = [min(d, n - 1) for d, n in zip(limits, nodes)]
        if max(nodes) == 1:  # nothing to draft: plain decoding step
            return Proposal(to_device(step.roots, torch.int64, step.device), [[-1]] * len(nodes), rule="deterministic")
        logits = self._block_forward(step, max(limits))
        if self.tree_nodes is not None:
            return tree_proposal(log_probs(logits, self.confidence_temperature), step.roots, limits, nodes)
        return chain_proposal(step, logits, nodes, self.rule)

    # ---- drafting ------------------------------------------------------------------------------

    def _block_forward(self, step: StepContext, k: int) -> torch.Tensor:
        """``[R, k, V]`` logits of the next k positions: one causal forward of each request's first rows and k - 1
        mask tokens; the mask rows are cut from the cache after it."""
        first = self._first_rows(step)  # committed tokens, the root last
        rows, n = first.shape
        feed = torch.cat((first, first.new_full((rows, k - 1), self.parallel.mask_token)), dim=1)
        counts = step.full_counts(n + k - 1)
        self.forward.start(step.running)
        self.cache.reserve(counts)
        logits = self.forward.causal(feed, counts, kept=k)
        self.cache.advance(to_device(counts, torch.int32, self.draft.device))
        for b, history in zip(step.running, step.histories):
            self.lengths[b] = len(history)  # the committed text through the root; the masks go
        self.cache.truncate(self.lengths)
        return self.parallel.target_logits(logits.view(rows, k, -1))
