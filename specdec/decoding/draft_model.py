"""Drafts from a smaller LLaMA-style model: chains (Leviathan; Chen) and token trees (SpecInfer).

The draft keeps its own KV cache, following the committed text (``specdec.decoding.draft_cache``).
Chains decode K tokens one forward at a time, each drawn from the draft's own filtered
distribution ``q`` (one-hot for greedy requests) or, with ``rule="deterministic"``, its argmax.
On the CPU an argmax chain (every greedy chain) runs as one C++ call and a sampled chain's forwards
as one each, ``specdec.model.draft_forward_cpu``, as do a tree's levels.
Trees grow level by level from a static template of branching factors: the
first forward feeds the last committed token and the root; each later one feeds only the
new level's nodes, as tree queries whose ancestors (the earlier levels) are already in the
draft cache (``AttentionMetadata(tree_start=...)``); then every frontier node gets its
children -- the top-k tokens of ``q`` (deterministic rule), k i.i.d. samples from ``q``
(stochastic rule), or a coupled draw then the next most likely tokens (coupled rule). The
levels are cut from the cache once the tree is drafted.

Random numbers, keyed on the position a draft token would take (``specdec.kernels.uniforms``):
the coupled rule draws the draft's token at a position by the target's own exponential race there,
``argmax_i q_i / E_i`` with the clocks E_i of the target's draw ``argmax_i p_i / E_i``, so the draft
agrees with the target's token whenever the two races have the same winner (a Gumbel-max coupling:
with probability at least (1 - TV) / (1 + TV), TV the total variation between p and q, against the
optimal rule's 1 - TV); verification then accepts the draft equal to the target's draw (the
deterministic rule), and a seeded request emits plain sampling's tokens whatever the depths.
The stochastic rule (the optimal rejection rule, the highest acceptance) draws from the
request's seed mixed with a salt, so its draws are independent of the verification's; its
tokens depend on the depths chosen, so they are not reproducible under adaptive depths.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec._transfer import to_device
from specdec.decoding.draft_cache import DraftCacheStrategy
from specdec.decoding.proposal import Proposal, depths, tree_metadata_on
from specdec.decoding.strategy import StepContext, check_same_vocabulary
from specdec.kernels.filtered_probs import filtered_probs
from specdec.kernels.sample_probs import sample_probs
from specdec.kernels.sampling_params import SamplingParams
from specdec.kernels.uniforms import ROLE_TARGET

DRAFT_SEED_SALT = 0x5DEECE66D  # keeps the stochastic rule's draws independent of the verification uniforms
DRAFT_RULES = ("coupled", "stochastic", "deterministic")


class DraftModelStrategy(DraftCacheStrategy):
    """Proposes a chain (``branching=(1,)*K``) or a tree from a draft model.

    Parameters
    ----------
    draft : a ``LlamaModel`` sharing the target's vocabulary.
    branching : children per node at each depth, e.g. ``(1, 1, 1, 1, 1)`` for a chain of 5
        or ``(4, 2, 2, 1)`` for a 4-level tree.
    max_nodes : node budget per tree, root included (the template is cut in BFS order).
    rule : "coupled" (the default: each node's first child drawn from q with the target's own
        race clocks at that position, further children the next most likely tokens of q; verified by
        "sample, then compare", so a seed gives plain sampling's tokens whatever the depths),
        "stochastic" (children sampled i.i.d. from q, verified by the optimal rejection rule:
        Leviathan/Chen chains, SpecInfer's multi-step speculative sampling for trees; the highest
        acceptance for sampled drafts, but reproducible only with fixed depths) or "deterministic"
        (the top-k children of q; a chain drafts the draft's argmax, as one C++ call on the CPU).
    fused : a CPU draft's forwards run in C++ (``specdec.model.draft_forward_cpu``: the same logits up to float
        rounding, without the per-op and per-forward costs) when the extension has them -- a greedy chain step
        as one call, a sampled chain as one call per draft, a tree as one per level; False: every draft forward
        through ``LlamaModel.forward``.
    """

    def __init__(
        self,
        draft,
        branching: Sequence[int],
        *,
        max_nodes: int = 64,
        rule: str = "coupled",
        fused: bool = True,
    ):
        branching = tuple(branching)
        if not branching or any(not isinstance(k, int) or k < 1 for k in branching):
            raise ValueError(f"branching must be a non-empty sequence of positive ints, got {branching!r}")
        if not isinstance(max_nodes, int) or max_nodes < 2:
            raise ValueError(f"max_nodes must be an int >= 2, got {max_nodes!r}")
        if rule not in DRAFT_RULES:
            raise ValueError(f"rule must be one of {DRAFT_RULES}, got {rule!r}")
        super().__init__(draft, fused=fused)
        self.is_chain = all(k == 1 for k in branching)
        self.rule = rule
        self.parents = _template(branching, max_nodes)
        self.depth = depths(self.parents)

    @property
    def name(self) -> str:
        if self.is_chain:
            return f"draft chain (K={len(self.parents) - 1}{'' if self.rule == 'coupled' else ', ' + self.rule})"
        return f"draft tree ({len(self.parents)} nodes, {self.rule})"

    @property
    def max_nodes(self) -> int:
        return len(self.parents)

    @property
    def max_depth(self) -> int:
        return max(self.depth)

    def draft_nodes(self, depth: int) -> int:
        """Nodes (root included) of the tree proposed when ``depth`` levels are allowed (the adaptive
        controller's optional hook, ``specdec.decoding.adaptive``)."""
        return _nodes_within(self.depth, depth)

    # ---- engine hooks (the Strategy protocol) -----------------------------------------------------

    def attach(self, target) -> None:
        check_same_vocabulary(target, self.draft)

    def propose(self, step: StepContext) -> Proposal:
        """Trees for ``step.running``: the template's BFS prefix within each request's depth and node limits."""
        parents = [
            self.parents[: min(_nodes_within(self.depth, depth), max(nodes, 1))]
            for depth, nodes in zip(step.max_depth, step.max_nodes)
        ]
        widest = max(len(p) for p in parents)
        if widest == 1:  # nothing to draft: plain decoding step
            return Proposal(to_device(step.roots, torch.int64, step.device), parents, rule="deterministic")
        if self.is_chain:
            tokens, probs = self._draft_chain(step, widest - 1)
        else:
            tokens, probs = self._draft_tree(step, widest)
        # Coupled and greedy drafts are verified by sampling the target's token and comparing.
        rule = "deterministic" if probs is None else "stochastic"
        if all(len(p) == widest for p in parents):  # every request drafted the whole template
            flat_probs = None if probs is None else probs.flatten(0, 1)
            return Proposal(tokens.flatten(), parents, rule=rule, draft_probs=flat_probs)
        rows = [r * widest + i for r, p in enumerate(parents) for i in range(len(p))]
        keep = to_device(rows, torch.int64, tokens.device)
        flat_probs = None if probs is None else probs.flatten(0, 1).index_select(0, keep)
        return Proposal(tokens.flatten().index_select(0, keep), parents, rule=rule, draft_probs=flat_probs)

    # ---- drafting ------------------------------------------------------------------------------

    def _draft_chain(self, step, k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[R, k+1] tokens (root first) and [R, k+1, V] child distributions (the stochastic rule's; None when the
        drafts are verified by sampling and comparing: coupled, argmax, or a greedy step), one forward per token.
        Draft j (from 0) takes position ``offset + j``."""
        device, rows = self.draft.device, len(step.running)
        first = self._first_rows(step)
        self.forward.start(step.running)  # sampled, or not fused: one forward per draft
        argmax = step.greedy or self.rule == "deterministic"
        if argmax and self.forward.fused:
            return self._fused_chain(step, k, first), None
        feed = first.flatten()
        tokens, probs = [first[:, -1]], []
        for j in range(k):
            per_request = first.shape[1] if j == 0 else 1
            if j < 2:  # the same layout for every later draft token
                counts = step.full_counts(per_request)
                added = to_device(counts, torch.int32, device)  # committed on the device: no upload per token
            self.cache.reserve(counts)
            logits = self.forward.causal(feed.view(rows, per_request), counts)
            self.cache.advance(added)
            if argmax:
                feed = logits.argmax(-1)  # (a NaN row drafts some token; verification decides)
            elif self.rule == "coupled":
                feed = _coupled_draw(filtered_probs(logits, step.params, check=False).probs, step.params, j)
            else:
                q, feed = self._sample(logits, step, position=j)
                probs.append(q)
            tokens.append(feed)
        for b in step.running:
            self.lengths[b] += k + 1  # previous, root and the first k - 1 drafts
        if not probs:
            return torch.stack(tokens, dim=1), None
        probs.append(torch.zeros_like(probs[0]))  # the last draft token has no children
        return torch.stack(tokens, dim=1), torch.stack(probs, dim=1)

    def _fused_chain(self, step, k: int, first: torch.Tensor) -> torch.Tensor:
        """``_draft_chain``'s greedy tokens from one C++ call (``specdec.model.draft_forward_cpu``): the same cache
        rows per request (``first``'s and the first k - 1 drafts'), reserved and committed once instead of per
        forward."""
        counts = step.full_counts(first.shape[1] + k - 1)
        self.cache.reserve(counts)
        drafts = self.forward.chain_greedy(first, k)
        self.cache.advance(to_device(counts, torch.int32, self.draft.device))
        for b in step.running:
            self.lengths[b] += k + 1
        return torch.cat((first[:, -1:], drafts), dim=1)

    def _draft_tree(self, step, n: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[R, n] template tokens and ([R, n, V] child distributions, or None for the deterministic rule and
        greedy steps), one forward per level, each over that level's nodes only."""
        device, rows = self.draft.device, len(step.running)
        parents, depth = self.parents[:n], self.depth[:n]
        first = self._first_rows(step)
        tokens = torch.zeros(rows, n, dtype=torch.int64, device=device)
        tokens[:, 0] = first[:, -1]  # the roots
        sampled = self.rule == "stochastic" and not step.greedy  # (greedy: every q is one-hot, no probs kept)
        probs = torch.zeros(rows, n, self.draft.config.vocab_size, device=device) if sampled else None
        self.forward.start(step.running)  # one forward per level
        # Level 0: up to the root, causal (``_first_rows``); they are committed text, so the cache keeps them.
        counts = step.full_counts(first.shape[1])
        self.cache.reserve(counts)
        logits = self.forward.causal(first, counts)
        self.cache.advance(counts)
        for b in step.running:
            self.lengths[b] += 2
        self._expand(logits, step, [0], parents, tokens, probs)
        # Levels 1..: each level's nodes as tree queries over the levels already in the cache (written from
        # tree_start in template order, which is level order: node i sits at tree_start + i - 1).
        tree_start = self.cache.seq_lens.clone()
        start = tree_start.index_select(0, to_device(step.running, torch.int64, device)).long()
        _, masks = tree_metadata_on([[p - 1 for p in parents[1:]]], device)  # the tree below the root, a forest
        for level in range(1, max(depth)):
            frontier = [i for i in range(n) if depth[i] == level]
            width = len(frontier)
            counts = step.full_counts(width)
            self.cache.reserve(counts)
            nodes = to_device(frontier, torch.int64, device)
            mask = masks.index_select(0, nodes - 1).repeat(rows, 1)
            positions = (start + level - 1)[:, None].expand(rows, width)
            logits = self.forward.tree_level(tokens.index_select(1, nodes), counts, positions, mask, tree_start)
            self.cache.advance(counts)
            self._expand(logits, step, frontier, parents, tokens, probs)
        self.cache.truncate(self.lengths)  # the levels go; verification decides which nodes are text
        return tokens, probs

    def _expand(self, logits, step, frontier, parents, tokens, probs) -> None:
        """Give every frontier node its children (in template order) from the draft's logits; a node at depth d
        gives its children position ``offset + d``."""
        rows, width = len(step.running), len(frontier)
        children = {node: [i for i, p in enumerate(parents) if p == node] for node in frontier}
        most = max(len(c) for c in children.values())
        if most == 0:
            return
        if step.greedy:  # every q is one-hot at the draft's argmax: no filtering, no uniforms
            scores = logits.view(rows, width, -1).float()
            if self.rule == "stochastic":  # i.i.d. draws from a one-hot: every child is the argmax
                best = scores.argmax(-1)  # [R, width] (a NaN row drafts some token; verification decides)
                for f, node in enumerate(frontier):
                    for c in children[node]:
                        tokens[:, c] = best[:, f]
            else:  # the top-k of the draft's logits (the target's argmax may be any of them)
                top = scores.topk(most, dim=-1).indices  # [R, width, most]
                for f, node in enumerate(frontier):
                    for j, c in enumerate(children[node]):
                        tokens[:, c] = top[:, f, j]
            return
        q = filtered_probs(logits, step.params.repeat_rows(width, rows * width), check=False).probs  # [R * width, V]
        for f, node in enumerate(frontier):
            kids = children[node]
            if not kids:
                continue
            q_node = q.view(rows, width, -1)[:, f]
            position = self.depth[node]
            if self.rule == "stochastic":
                probs[:, node] = q_node
                params = _draft_params(step)._replace(offset=step.params.offset + position)
                for rank, c in enumerate(kids):
                    tokens[:, c] = sample_probs(q_node, params, counter=rank, check=False)
                continue
            # Children are the top-k of q (its support, in the order of the scaled logits); greedy rows
            # (q one-hot) take the draft's top-k logits instead, since the target's argmax may be any of them.
            # The coupled rule's first child is its coupled draw, the others the best of the rest.
            greedy = (step.params.temperature <= 0)[:, None]
            draft_logits = logits.view(rows, width, -1)[:, f].float()
            scores = torch.where(greedy, draft_logits, torch.where(q_node > 0, q_node, -1.0))
            if self.rule == "coupled":
                drawn = _coupled_draw(q_node, step.params, position)
                tokens[:, kids[0]] = drawn
                scores = scores.scatter(1, drawn[:, None], float("-inf"))
                kids = kids[1:]
            if kids:
                top = scores.topk(len(kids), dim=-1).indices
                for j, c in enumerate(kids):
                    tokens[:, c] = top[:, j]

    def _sample(self, logits, step, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The stochastic rule's chain draft at ``offset + position``: (q, the token drawn from it)."""
        params = _draft_params(step)
        q = filtered_probs(logits, params, check=False).probs  # one-hot at the argmax for rows that cannot be sampled
        return q, sample_probs(q, params._replace(offset=params.offset + position), counter=0, check=False).long()


def _coupled_draw(q: torch.Tensor, params: SamplingParams, position: int) -> torch.Tensor:
    """int64 ``[R]``: from each row of q, the winner of the race with the target's own clocks at ``offset + position``
    (``argmax_i q_i / E_i``) -- so the draft equals the target's token wherever the races over q and p agree."""
    return sample_probs(q, params._replace(offset=params.offset + position), counter=ROLE_TARGET, check=False).long()


def _draft_params(step: StepContext) -> SamplingParams:
    """The running requests' sampling parameters with the draft's own seeds (salted)."""
    return step.params._replace(seed=step.params.seed ^ DRAFT_SEED_SALT)


def _template(branching: tuple[int, ...], max_nodes: int) -> list[int]:
    """Parents of the static tree in BFS order, cut at ``max_nodes`` nodes."""
    parents, level = [-1], [0]
    for k in branching:
        nxt = []
        for node in level:
            for _ in range(k):
                if len(parents) == max_nodes:
                    return parents
                parents.append(node)
                nxt.append(len(parents) - 1)
        level = nxt
    return parents


def _nodes_within(depth: list[int], limit: int) -> int:
    """Length of the BFS prefix holding the nodes of depth <= limit (at least the root)."""
    return sum(1 for d in depth if d <= max(limit, 0))
