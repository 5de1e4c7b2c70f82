"""Drafts from a parallel EAGLE head (``specdec.model.ParallelEagleHead``): a step's drafts from one head forward.

An EAGLE-2 tree of depth d costs d head forwards a step. Here each step's catch-up forward (the
rows the target accepted last step, with their true features, as in ``EagleStrategy``) carries
``depth - 1`` mask rows after each request's last row: that one forward gives the distribution of
every position ahead, q_1 from the root's row and q_{j+1} from mask row j. The mask rows are cut
from the head cache after it, which keeps committed rows only. Two shapes, as for
PARD's (``ParallelDraftStrategy``); greedy requests get the target's greedy tokens, sampled ones are exact:

- a chain: token j drawn from q_j (``block_trees.chain_proposal``: its argmax, or a draw coupled with the
  target's own sampling, or an independent draw for the optimal rejection rule);
- a tree (``max_nodes``): the best paths by the product of the q_j under a node budget, built on
  the device (``block_trees.best_first_trees``, DDTree), verified by the deterministic rule.

Per-request state (the head cache, the accepted nodes' features) attaches and detaches per slot
as ``EagleStrategy``'s does; a draft vocabulary on the head is honoured.
"""

from __future__ import annotations

import torch

from specdec._transfer import to_device
from specdec.decoding.block_trees import block_rule, block_tree_nodes, chain_proposal, tree_proposal
from specdec.decoding.eagle import EagleStrategy
from specdec.decoding.eagle_trees import log_probs
from specdec.decoding.proposal import Proposal
from specdec.decoding.strategy import StepContext
from specdec.model.parallel_eagle import ParallelEagleHead

# A head distilled by KL is as flat as the target's own distributions, flatter than its argmax is right: sharpened,
# trees go deeper (the shipped head's greedy tree tau by temperature: bench/RESULTS.md, "Parallel drafting").
CONFIDENCE_TEMPERATURE = 0.3


class ParallelEagleStrategy(EagleStrategy):
    """Proposes a chain, or a best-first tree, from one forward of a parallel EAGLE head per step.

    Parameters
    ----------
    head : a ``ParallelEagleHead`` for the target (``ParallelEagleHead.from_pretrained(path, target)``).
    depth : positions drafted per step, at most the head's ``block_size`` (default: all of them).
    max_nodes : None for a chain of ``depth`` tokens; an int >= 2 for trees of that many nodes, root included, at full
        depth (a tree cut to d levels by the adaptive controller keeps ``ceil((max_nodes - 1) * d / depth)`` drafted
        nodes).
    rule : for chains, "coupled" (default), "stochastic" or "deterministic" (``block_trees.chain_proposal``); trees
        are verified by the deterministic rule only.
    confidence_temperature : trees rank paths by the product of ``softmax(logits / confidence_temperature)`` (default
        0.3); below 1 it favours deeper paths over wider ones (it changes which tree is drafted, never what is
        emitted).

    Example
    -------
    >>> from specdec.testing import ASSETS
    >>> from specdec.decoding import SpeculativeDecoder
    >>> from specdec.model import LlamaModel
    >>> target = LlamaModel.from_pretrained(ASSETS / "target")
    >>> head = ParallelEagleHead.from_pretrained(ASSETS.parent / "parallel_eagle", target)
    >>> decoder = SpeculativeDecoder(target, ParallelEagleStrategy(head, max_nodes=16))
    >>> result = decoder.generate([[1, 15, 27, 4, 9]], max_new_tokens=24, eos_token_id=None)
    >>> len(result.tokens[0]), result.stats[0].target_forwards < 24
    (24, True)
    """

    def __init__(
        self,
        head: ParallelEagleHead,
        *,
        depth: int | None = None,
        max_nodes: int | None = None,
        rule: str | None = None,
        confidence_temperature: float = CONFIDENCE_TEMPERATURE,
    ):
        if not isinstance(head, ParallelEagleHead):
            raise TypeError(f"head must be a ParallelEagleHead (ParallelEagleHead.from_pretrained), got "
                            f"{type(head).__name__}")  # fmt: skip
        depth = head.block_size if depth is None else depth
        if not isinstance(depth, int) or isinstance(depth, bool) or not 1 <= depth <= head.block_size:
            raise ValueError(f"depth must be an int in [1, {head.block_size}] (the head's block_size), got {depth!r}")
        if max_nodes is not None and (not isinstance(max_nodes, int) or isinstance(max_nodes, bool) or max_nodes < 2):
            raise ValueError(f"max_nodes must be None (a chain) or an int >= 2, got {max_nodes!r}")
        rule = block_rule(rule, max_nodes, "a parallel EAGLE head")
        # top_k 1: EagleStrategy.prefill then leaves top_k * (depth - 1) rows past the text, the mask rows' room.
        super().__init__(head, tree_budget=depth + 1 if max_nodes is None else max_nodes, depth=depth, top_k=1,
                         confidence_temperature=confidence_temperature)  # fmt: skip
        self.tree_nodes, self.rule = max_nodes, rule

    @property
    def name(self) -> str:
        if self.tree_nodes is None:
            return f"parallel EAGLE chain (K={self.depth}{'' if self.rule == 'coupled' else ', ' + self.rule})"
        return f"parallel EAGLE tree ({self.tree_nodes} nodes, depth {self.depth})"

    @property
    def max_nodes(self) -> int:
        return self.draft_nodes(self.depth)

    @property
    def max_depth(self) -> int:
        return self.depth

    def draft_nodes(self, depth: int) -> int:
        """Nodes (root included) proposed when ``depth`` levels are allowed (the adaptive controller's hook)."""
        return block_tree_nodes(self.tree_nodes, self.depth, depth, self.head.draft_vocab_size)

    def propose(self, step: StepContext) -> Proposal:
        """One chain or tree per running request, within its depth and node limits, from the catch-up forward."""
        limits = [min(max(d, 0), self.depth) for d in step.max_depth]
        nodes = [min(n, self.draft_nodes(d)) for n, d in zip(step.max_nodes, limits)]
        limits = [min(d, n - 1) for d, n in zip(limits, nodes)]
        _, logits = self._catch_up(step, masks=max(max(limits) - 1, 0))
        logits = logits.view(len(step.running), -1, logits.shape[-1])  # [R, k, V]: the root's row, then the masks'
        self.cache.truncate(self.lengths)  # the mask rows go
        if max(nodes) == 1:  # nothing to draft (the catch-up kept the head in step)
            return Proposal(to_device(step.roots, torch.int64, step.device), [[-1]] * len(nodes), rule="deterministic")
        if self.head.draft_ids is not None:  # the draft vocabulary's logits at their target ids, -inf elsewhere
            full = logits.new_full((*logits.shape[:2], self.head.config.vocab_size), -torch.inf)
            logits = full.index_copy_(2, self.head.draft_ids, logits)
        if self.tree_nodes is not None:
            return tree_proposal(log_probs(logits, self.confidence_temperature), step.roots, limits, nodes)
        return chain_proposal(step, logits, nodes, self.rule)
