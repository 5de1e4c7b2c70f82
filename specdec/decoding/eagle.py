"""EAGLE drafting from an ``EagleHead`` or ``Eagle3Head``: static token trees (EAGLE-1) and dynamic ones (EAGLE-2).

The head (``specdec.model.eagle``) extrapolates the target's features: its row t reads the
target's final-norm hidden state of token t and the token t + 1, writes K/V at position t of the
head's own KV cache and predicts the feature and the logits of token t + 2. Per step, drafting
a tree of depth d costs d head forwards, each over rows the head has not seen:

1. catch-up: the nodes the target accepted last step (for the first step, the last prompt
   token), with the target's true features and the tokens that follow them -- ragged, causal.
   Its last row per request is the root's: its logits give the depth-1 candidates.
2. level k = 1 .. d-1: the depth-k nodes that get children, fed with their parent's predicted
   feature as tree queries whose ancestors (the earlier levels) are already in the head cache
   (``AttentionMetadata(tree_start=...)``): never the tree so far again.

After drafting the head cache is cut back to the committed text (``KVCache.truncate``): the next
catch-up writes the accepted nodes again from the target's true features, as the authors'
implementation does, rather than keeping K/V computed from the head's own predictions.

Trees. EAGLE-1 (``static_tree``): fixed top-k index paths (``StaticTree``), node i's token the
``rank[i]``-th best of its parent's logits. EAGLE-2 (default): each level expands the ``top_k`` most
confident nodes of the level before, each with its ``top_k`` best children, and the ``tree_budget - 1``
most confident drafted nodes form the tree (``eagle_trees``), chosen on the device (``DeviceTrees``). At ``top_k`` 1
that tree is a chain of each level's best token, which on the CPU the head drafts in one C++ call (``chain_greedy``:
the levels' forwards and their argmax feedback without a Python loop between them).

Children are the head's best tokens, not samples: the deterministic rule verifies them, so outputs are the target's
(greedy, or exactly its distribution). An ``Eagle3Head`` reads the target's layers (``feature_layers``, the
contract's item 4); its draft ids are mapped to target ids as drafted.
"""

from __future__ import annotations

import itertools

import torch

from specdec._transfer import offsets_to_device, to_device
from specdec.decoding.eagle_trees import default_static_tree, levels_on, log_probs, rerank, static_levels
from specdec.decoding.proposal import DeviceTrees, Proposal
from specdec.decoding.static_tree import StaticTree
from specdec.decoding.strategy import BaseStrategy, Prefill, StepContext, StepResult
from specdec.kernels import pack_mask_rows
from specdec.model import Eagle3Head, EagleHead
from specdec.model.attention_metadata import AttentionMetadata, causal_positions
from specdec.model.draft_forward_cpu import head_chain_available
from specdec.model.parallel_eagle import MASK


class EagleStrategy(BaseStrategy):
    """Drafts token trees with an EAGLE head (see the module docstring).

    Parameters
    ----------
    head : an ``EagleHead`` built for the target it will serve (``EagleHead.from_pretrained(path, target)``).
    tree_budget : nodes per verified tree, root included (>= 1; 1 drafts nothing).
    depth : deepest draft level (>= 1); a depth-d tree costs d head forwards.
    top_k : candidates per expanded node (1 .. vocabulary); EAGLE-2 also expands ``top_k`` nodes per level.
    static_tree : None for EAGLE-2's dynamic tree; a list of top-k index paths for an EAGLE-1 static
        tree (each path after its prefix, at most ``depth`` long, indices below ``top_k``, at most
        ``tree_budget - 1`` paths), or "default" for ``default_static_tree(tree_budget, depth, top_k)``.
    confidence_temperature : EAGLE-2's path confidences are the products of the head's probabilities
        at this temperature (1: the paper's). A head whose probabilities run flatter than its
        accuracy (deep levels read its own predicted features) ranks deep nodes too low; a
        temperature below 1 sharpens them. Only which nodes are drafted changes, never exactness.

    Example
    -------
    >>> from specdec.testing import ASSETS
    >>> from specdec.decoding import SpeculativeDecoder
    >>> from specdec.model import LlamaModel
    >>> target = LlamaModel.from_pretrained(ASSETS / "target")
    >>> head = EagleHead.from_pretrained(ASSETS.parent / "eagle", target)
    >>> decoder = SpeculativeDecoder(target, EagleStrategy(head, tree_budget=32, depth=5, top_k=4))
    >>> result = decoder.generate([[1, 15, 27, 4, 9]], max_new_tokens=24, eos_token_id=None)
    >>> len(result.tokens[0]), result.stats[0].target_forwards < 24
    (24, True)
    """

    def __init__(
        self,
        head,
        *,
        tree_budget: int = 64,
        depth: int = 6,
        top_k: int = 8,
        static_tree=None,
        confidence_temperature: float = 1.0,
    ):
        if not isinstance(head, (EagleHead, Eagle3Head)):
            raise TypeError(f"head must be an EagleHead or Eagle3Head, got {type(head).__name__}")
        for name, value in (("tree_budget", tree_budget), ("depth", depth), ("top_k", top_k)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        vocab = head.draft_vocab_size
        if top_k > vocab:
            raise ValueError(f"top_k must be at most the vocabulary ({vocab}), got {top_k}")
        if not isinstance(confidence_temperature, (int, float)) or not 0 < confidence_temperature < float("inf"):
            raise ValueError(f"confidence_temperature must be a positive number, got {confidence_temperature!r}")
        self.head, self.top_k, self.depth, self.tree_budget = head, top_k, depth, tree_budget
        self.confidence_temperature = confidence_temperature
        if isinstance(static_tree, str) and static_tree == "default":
            static_tree = default_static_tree(tree_budget, depth, top_k)
        self.static = None
        if static_tree is not None:
            self.static = StaticTree(
                static_tree, max_depth=depth, top_k=top_k, max_nodes=tree_budget, name="static_tree"
            )
            self._levels = static_levels(self.static)
            self._layouts: dict[int, tuple[list[int], dict[int, int]]] = {}
        self.cache = None
        self.lengths: list[int] = []  # host: rows committed in the head cache per batch slot
        self.pending = None  # (slots, features [R, P, H], counts): rows the next catch-up feeds

    @property
    def name(self) -> str:
        head = "EAGLE-3 head, " if self.head.feature_layers else ""
        if self.static is not None:
            return f"EAGLE-1 ({head}{self.static.size} nodes)"
        return f"EAGLE-2 ({head}budget {self.tree_budget}, depth {self.depth}, top-k {self.top_k})"

    @property
    def feature_layers(self) -> tuple[int, ...] | None:
        return self.head.feature_layers  # EAGLE-3 reads the target's layers; EAGLE-1/2 its final norm

    @property
    def max_nodes(self) -> int:
        return self._nodes_within(self.depth)

    @property
    def max_depth(self) -> int:
        if self.static is not None:
            return self.static.max_depth
        return self.depth if self.max_nodes > 1 else 0

    # ---- engine hooks (the Strategy protocol) -----------------------------------------------------

    def attach(self, target) -> None:
        if self.head.target is not target:
            raise ValueError("head was built for another target model: load it with EagleHead.from_pretrained(path, "
                             "target) for the target it drafts (it reads its features and LM head)")  # fmt: skip

    def prefill(self, prefill: Prefill) -> None:
        """Allocate the head cache for every slot, then ``join`` the requests of the non-empty prompts."""
        if self.static is not None:
            tree_rows = sum(len(level) for level in self._levels[1])
        else:
            tree_rows = self.top_k * (self.depth - 1)
        batch = len(prefill.prompts)
        self.cache = self.head.new_cache(batch, prefill.max_len + tree_rows, **prefill.cache_options)
        self.lengths, self.pending = [0] * batch, None
        self.join(prefill)

    def join(self, prefill: Prefill) -> None:
        """Feed each joining prompt's rows 0 .. P-2 into its (empty) slot of the head cache (the last row waits for
        its next token); the other slots keep their rows."""
        prompts, device = prefill.prompts, self.head.device
        counts = [max(len(p) - 1, 0) for p in prompts]
        for b, p in enumerate(prompts):
            if p:
                self.lengths[b] = counts[b]
        if sum(counts) == 0:
            return
        starts = itertools.accumulate((len(p) for p in prompts), initial=0)
        rows = to_device([s + i for s, n in zip(starts, counts) for i in range(n)], torch.int64, device)
        tokens = to_device([t for p in prompts for t in p[1:]], torch.int64, device)
        q_offsets = offsets_to_device(counts, device)
        self.cache.reserve(counts)
        positions = causal_positions(q_offsets, self.cache.seq_lens, sum(counts))
        no_rows = torch.zeros(0, dtype=torch.int64, device=device)
        self.head(self.head.features_from_target(prefill.hidden.index_select(0, rows)), tokens, positions,
                  AttentionMetadata(q_offsets), self.cache, logits_rows=no_rows)  # fmt: skip
        self.cache.advance(counts)

    def propose(self, step: StepContext) -> Proposal:
        rows = len(step.running)
        root_feature, root_logits = self._catch_up(step)
        limits = [max(min(d, self.max_depth), 0) for d in step.max_depth]
        nodes = [1 if d == 0 else min(n, self._nodes_within(d)) for d, n in zip(limits, step.max_nodes)]
        roots = to_device(step.roots, torch.int64, step.device)
        if max(nodes) == 1:  # nothing to draft (the catch-up kept the head in step)
            return Proposal(roots, [[-1]] * rows, rule="deterministic")
        tree_start = self.cache.seq_lens.clone()  # the drafted levels are written from here
        if self.static is not None:
            proposal = self._draft_static(step, root_feature, root_logits, roots, limits, nodes, tree_start)
        elif self.top_k == 1 and head_chain_available(self.head, self.cache):
            proposal = self._draft_chain(step, root_feature, root_logits, roots, limits, nodes)
        else:
            proposal = self._draft_dynamic(step, root_feature, root_logits, roots, limits, nodes, tree_start)
        self.cache.truncate(self.lengths)  # the levels go; the accepted nodes come back with true features
        return proposal

    def commit(self, result: StepResult) -> None:
        """Keep the target's features of the accepted nodes for the next catch-up; free finished slots."""
        path = result.accepted_path.long()
        rows = result.node_offsets[:-1, None].long() + path.clamp(min=0)  # [R, P] rows of result.hidden
        features = self.head.features_from_target(result.hidden.index_select(0, rows.flatten())).view(*path.shape, -1)
        slots, counts = list(result.running), [a + 1 for a in result.accepted]
        if self.pending is not None:  # a request paused for cache blocks keeps its features until it resumes
            old_slots, old_features, old_counts = self.pending
            gone = set(slots) | set(result.finished)
            carried = [i for i, b in enumerate(old_slots) if b not in gone]
            if carried:
                width = max(features.shape[1], old_features.shape[1])
                kept = old_features.index_select(0, to_device(carried, torch.int64, features.device))
                features = torch.cat([_pad_width(features, width), _pad_width(kept, width)])
                slots += [old_slots[i] for i in carried]
                counts += [old_counts[i] for i in carried]
        self.pending = (slots, features, counts)
        if result.finished:
            self.leave(result.finished)

    def leave(self, slots) -> None:
        """Free the slots' head-cache rows and the features they were owed."""
        self.cache.release(list(slots))
        for b in slots:
            self.lengths[b] = 0
        if self.pending is not None:
            gone = set(slots)
            old_slots, features, counts = self.pending
            kept = [i for i, b in enumerate(old_slots) if b not in gone]
            if len(kept) < len(old_slots):
                rows = to_device(kept, torch.int64, features.device)
                self.pending = ([old_slots[i] for i in kept], features.index_select(0, rows), [counts[i] for i in kept])

    # ---- drafting ------------------------------------------------------------------------------

    def _catch_up(self, step: StepContext, masks: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed the accepted nodes (true features, next tokens), each request's followed by ``masks`` mask rows (a
        ``ParallelEagleHead``'s); the predicted features ``[R * (masks + 1), H]`` and logits ``[R * (masks + 1), V]``
        of each request's last accepted row (the root's) and its mask rows. Only the accepted rows count as committed
        (``self.lengths``): the mask rows go with the next ``truncate``."""
        device = self.head.device
        slots, features, pending = self.pending
        index = {b: i for i, b in enumerate(slots)}
        counts = [pending[index[b]] for b in step.running]
        width = features.shape[1]
        starts = [index[b] * width for b in step.running]  # a mask row's feature is never read: row 0 stands in
        picked = [i for s, c in zip(starts, counts) for i in [*range(s, s + c), *[0] * masks]]
        feed = features.flatten(0, 1).index_select(0, to_device(picked, torch.int64, device))
        tokens = to_device([t for h, c in zip(step.histories, counts) for t in [*h[len(h) - c :], *[MASK] * masks]],
                           torch.int64, device)  # fmt: skip
        rows = [c + masks for c in counts]
        full = step.full_counts(rows)
        q_offsets = offsets_to_device(full, device)
        self.cache.reserve(full)
        positions = causal_positions(q_offsets, self.cache.seq_lens, len(picked))
        read = [s + c - 1 + j for s, c in zip(itertools.accumulate(rows, initial=0), counts) for j in range(masks + 1)]
        read = to_device(read, torch.int64, device)
        predicted, logits = self.head(feed, tokens, positions, AttentionMetadata(q_offsets), self.cache, read)
        self.cache.advance(full)
        for b, c in zip(step.running, counts):
            self.lengths[b] += c
        return predicted.index_select(0, read), logits

    def _level(self, step, features, tokens, level: int, mask, tree_start) -> tuple[torch.Tensor, torch.Tensor]:
        """One head forward over ``w`` new nodes of depth ``level`` per running request (``features [R*w, H]``,
        ``tokens [R*w]``, ancestor-or-self ``mask [R*w, W]`` over the levels written from ``tree_start``)."""
        rows = len(step.running)
        width = tokens.numel() // rows
        full = step.full_counts(width)
        q_offsets = offsets_to_device(full, self.head.device)
        self.cache.reserve(full)
        start = tree_start.index_select(0, to_device(step.running, torch.int64, self.head.device)).long()  # [R]
        positions = (start + level - 1)[:, None].expand(rows, width).flatten()  # row t of the head sits at t
        metadata = AttentionMetadata(q_offsets, mask, tree_start=tree_start)
        out = self.head(features, tokens, positions, metadata, self.cache)
        self.cache.advance(full)
        return out

    def _draft_dynamic(self, step, root_feature, root_logits, roots, limits, nodes, tree_start) -> Proposal:
        """EAGLE-2: expand the ``top_k`` most confident nodes per level, rerank everything drafted, keep the best."""
        k, rows, device, temperature = self.top_k, len(step.running), self.head.device, self.confidence_temperature
        levels, hidden = max(limits), root_feature.shape[-1]
        score, draft_ids = log_probs(root_logits, temperature).topk(k, dim=-1)  # [R, k]: depth 1
        token = self.head.target_ids(draft_ids)
        scores, tokens = [score], [token]
        parents = [torch.full((rows, k), -1, dtype=torch.int64, device=device)]
        feed_features = root_feature[:, None].expand(rows, k, hidden)
        number = torch.arange(k, device=device).expand(rows, k)  # drafted numbers of the nodes to expand
        tree_bits = k * max(levels - 1, 1)
        ancestors = torch.zeros(rows, k, tree_bits, dtype=torch.bool, device=device)
        drafted = k
        identity = torch.eye(k, dtype=torch.bool, device=device)
        for level in range(1, levels):
            own = torch.zeros(k, tree_bits, dtype=torch.bool, device=device)
            own[:, (level - 1) * k : level * k] = identity  # level-order slots in the head cache (no host scalar)
            ancestors = ancestors | own
            mask = pack_mask_rows(ancestors.flatten(0, 1))
            predicted, logits = self._level(step, feed_features.flatten(0, 1), token.flatten(), level, mask, tree_start)
            child_score, child_token = log_probs(logits, temperature).view(rows, k, -1).topk(k, dim=-1)  # [R, k, k]
            child_score = (score[:, :, None] + child_score).flatten(1)  # path confidence, [R, k*k]
            scores.append(child_score)
            tokens.append(self.head.target_ids(child_token.flatten(1)))
            parents.append(number[:, :, None].expand(rows, k, k).flatten(1))
            if level + 1 < levels:  # the next level expands the k most confident children
                best = child_score.topk(k, dim=-1).indices  # [R, k]
                parent_slot = best // k
                feed_features = predicted.view(rows, k, hidden).gather(1, parent_slot[..., None].expand(-1, -1, hidden))
                ancestors = ancestors.gather(1, parent_slot[:, :, None].expand(-1, -1, tree_bits))
                score, token, number = child_score.gather(1, best), tokens[-1].gather(1, best), drafted + best
            drafted += k * k
        node_depth = self._node_depths(levels, device)
        keep = to_device([n - 1 for n in nodes], torch.int64, device)
        width = max(nodes)
        tree_tokens, tree_parents = rerank(
            torch.cat(scores, dim=1), torch.cat(tokens, dim=1), torch.cat(parents, dim=1), node_depth, roots,
            to_device(limits, torch.int64, device), keep, width,
        )  # fmt: skip
        if any(n != width for n in nodes):
            kept = to_device([r * width + i for r, n in enumerate(nodes) for i in range(n)], torch.int64, device)
            tree_tokens = tree_tokens.flatten().index_select(0, kept)
            tree_parents = tree_parents.flatten().index_select(0, kept)
        depths = [min(d, n - 1) for d, n in zip(limits, nodes)]
        trees = DeviceTrees(tree_parents.flatten(), list(nodes), depths)
        return Proposal(tree_tokens.flatten(), trees, rule="deterministic")

    def _draft_chain(self, step, root_feature, root_logits, roots, limits, nodes) -> Proposal:
        """EAGLE-2 at ``top_k`` 1 on the CPU: each level's one node is the best child of the last, so the tree is a
        chain, drafted in one C++ call (the head's ``chain_greedy``) where the levels would cost a Python loop."""
        lengths = [min(d, n - 1) for d, n in zip(limits, nodes)]
        levels = max(lengths)
        self.cache.reserve(step.full_counts(levels - 1))  # the levels' rows, dropped after drafting like a tree's
        slots = to_device(step.running, torch.int64, self.head.device)
        drafts = self.head.chain_greedy(root_feature, root_logits, slots, levels, self.cache)  # [R, levels]
        chains = torch.cat((roots[:, None], drafts), dim=1)
        if any(n != levels for n in lengths):
            width = levels + 1
            kept = [r * width + i for r, n in enumerate(lengths) for i in range(n + 1)]
            tokens = chains.flatten().index_select(0, to_device(kept, torch.int64, chains.device))
        else:
            tokens = chains.flatten()
        return Proposal(tokens, [list(range(-1, n)) for n in lengths], rule="deterministic")

    def _draft_static(self, step, root_feature, root_logits, roots, limits, nodes, tree_start) -> Proposal:
        """EAGLE-1: each level's tokens are fixed ranks of the logits of the level above."""
        rows, device, tree = len(step.running), self.head.device, self.static
        choose, fed, masks = levels_on(self._levels, device)
        levels = max(limits)
        logits, feats = root_logits, root_feature
        by_depth = []
        for level in range(1, levels + 1):
            take, parent_slot, widest = choose[level - 1]  # tokens: entry take of the parents' top ranks
            token = self.head.target_ids(logits.float().topk(widest, dim=-1).indices.view(rows, -1)[:, take])
            by_depth.append(token)  # [R, nodes of this level]
            if level < levels:
                which = fed[level - 1]  # the level's nodes with children, in head-cache order
                feed = feats.view(rows, -1, feats.shape[-1]).index_select(1, parent_slot.index_select(0, which))
                mask = masks[level - 1].repeat(rows, 1)
                feats, logits = self._level(step, feed.flatten(0, 1), token.index_select(1, which).flatten(), level,
                                            mask, tree_start)  # fmt: skip
        order, position = self._static_layout(levels)
        template = torch.cat([roots[:, None]] + by_depth, dim=1).index_select(1, to_device(order, torch.int64, device))
        cuts = [tree.cut(d, n) for d, n in zip(limits, nodes)]
        width = len(order)
        kept = [r * width + position[i] for r, (_, keep) in enumerate(cuts) for i in keep]
        tokens = template.flatten().index_select(0, to_device(kept, torch.int64, device))
        return Proposal(tokens, [p for p, _ in cuts], rule="deterministic")

    # ---- host facts, computed once ------------------------------------------------------------

    def _nodes_within(self, depth: int) -> int:
        """The most nodes a tree of ``depth`` levels can have, root included (the static tree cuts itself)."""
        if self.static is not None:
            return self.static.size
        return min(self.tree_budget, 1 + self.top_k + (depth - 1) * self.top_k**2)  # drafted: k, then k*k a level

    def _node_depths(self, levels: int, device) -> torch.Tensor:
        depth = [1] * self.top_k + [d for d in range(2, levels + 1) for _ in range(self.top_k**2)]
        return to_device(depth, torch.int64, device)

    def _static_layout(self, levels: int) -> tuple[list[int], dict[int, int]]:
        """The static tree's nodes of depth <= ``levels``: (their columns in [root, depth-1 nodes, depth-2
        nodes, ...], in template order; template node -> its position in that list)."""
        if levels not in self._layouts:
            tree = self.static
            by_depth = sorted((i for i in range(tree.size) if tree.depth[i] <= levels), key=lambda i: tree.depth[i])
            column = {node: c for c, node in enumerate(by_depth)}
            within = [i for i in range(tree.size) if tree.depth[i] <= levels]
            self._layouts[levels] = ([column[i] for i in within], {i: j for j, i in enumerate(within)})
        return self._layouts[levels]


def _pad_width(features: torch.Tensor, width: int) -> torch.Tensor:
    """``features [R, P, H]`` padded with zero rows to ``[R, width, H]`` (rows past a request's count are never fed)."""
    return torch.nn.functional.pad(features, (0, 0, 0, width - features.shape[1]))
