"""Medusa drafting (Cai et al. 2024): K heads on the target's last hidden state guess the next tokens.

No draft model and no forward of its own: after every verification, the target's final-norm
hidden state of each request's last accepted token (``StepResult.hidden``; after the prefill,
its last prompt token) goes through the K heads in one batched call, and each head's top-k
tokens are kept. Head d guesses the token d + 2 positions after that hidden state's token,
i.e. the depth-(d + 1) token under the next root (the target itself gave the root). The next
step's tree is a static one (``StaticTree``, Medusa "choices"): the node with path
``[i0, ..., id]`` carries candidate ``id`` of head d -- its token depends on its depth and
index only.

Verification uses the deterministic rule (children picked, not sampled): try the children in
order, accept c with probability p(c), on rejection zero p(c) and renormalise. So every
request's output is distributed exactly as the target's own sampling, at any temperature,
top-k and top-p, and greedy requests get the target's greedy tokens. (The Medusa authors'
"typical acceptance" changes the output distribution; it is not offered.)

Requests are batched with ragged acceptance through the engine's loop: the heads' candidates
live in a ``[B, depth, top-k]`` buffer, one row per batch slot, rewritten in ``commit`` for the
requests still running; each request's tree is cut to its own node and depth limits.

The shipped tree for the embedded heads (``specdec/assets/medusa``) was found by measurement,
``scripts/search_medusa_tree.py``; its results are in ``specdec/assets/medusa/tree_search.json``
(greedy tau by node budget, estimated and measured in real runs) and summarised in
``TREE_SEARCH`` below.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import torch

from specdec._transfer import to_device
from specdec.decoding.proposal import Proposal
from specdec.decoding.static_tree import StaticTree
from specdec.decoding.strategy import BaseStrategy, Prefill, StepContext, StepResult
from specdec.model.head_loading import check_fits_target
from specdec.model.medusa import MedusaHeads

TREE_SEARCH = Path(__file__).resolve().parents[1] / "assets" / "medusa" / "tree_search.json"


@functools.lru_cache(maxsize=1)
def presets() -> dict[str, list[list[int]]]:
    """The trees searched for the embedded heads, smallest first: ``tree-8`` ... ``tree-64`` (nodes, root included), and
    ``default``, the one of them ``choices=None`` takes. (``choices="chain"`` is the other name
    ``MedusaStrategy`` knows: every head's best guess, one path as deep as the heads.)"""
    search = json.loads(TREE_SEARCH.read_text())
    named = {f"tree-{n}": tree["choices"] for n, tree in search["trees"].items()}
    named["default"] = named[f"tree-{search['default']}"]
    return named


class MedusaStrategy(BaseStrategy):
    """Drafts a static token tree per request from Medusa heads (see the module docstring).

    Parameters
    ----------
    heads : ``MedusaHeads`` of the target (same hidden size, vocabulary, dtype and device).
    choices : the tree as top-k index paths (``StaticTree``), e.g. ``[[0], [1], [0, 0]]``; a name:
        "chain" (one path, every head's best guess) or a preset (``presets()``: "default",
        "tree-8", "tree-12", "tree-16", "tree-24", "tree-32", "tree-64"); or None for "default", the tree searched for
        the embedded heads, cut to the heads' depth.
    top_k : candidates kept per head; every index in ``choices`` must be below it.
    max_nodes : node budget, root included; ``choices`` may not exceed it.

    Example
    -------
    >>> from specdec.decoding import SpeculativeDecoder
    >>> from specdec.model import LlamaModel, ModelConfig, MedusaHeads
    >>> config = ModelConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=1,
    ...                      num_heads=2, num_kv_heads=1, head_dim=16)
    >>> target = LlamaModel(config).requires_grad_(False)                 # random weights
    >>> heads = MedusaHeads(32, 32, num_heads=3).requires_grad_(False)   # random heads
    >>> strategy = MedusaStrategy(heads, [[0], [1], [0, 0], [0, 0, 0]])
    >>> strategy.max_nodes, strategy.max_depth
    (5, 3)
    >>> result = SpeculativeDecoder(target, strategy).generate([[1, 2, 3]], max_new_tokens=12)
    >>> result.stats[0].generated
    12
    """

    def __init__(self, heads: MedusaHeads, choices=None, *, top_k: int = 10, max_nodes: int = 64):
        if not isinstance(heads, MedusaHeads):
            raise TypeError(f"heads must be MedusaHeads, got {type(heads).__name__}")
        for name, value, low in (("top_k", top_k, 1), ("max_nodes", max_nodes, 2)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if choices is None:
            choices = [path for path in presets()["default"] if len(path) <= heads.num_heads]
        elif choices == "chain":
            choices = [[0] * depth for depth in range(1, heads.num_heads + 1)]
        elif isinstance(choices, str):
            if choices not in presets():
                names = ["chain", "default", *(name for name in presets() if name != "default")]
                raise ValueError(f"choices {choices!r} is not a preset; the presets are {names}")
            choices = presets()[choices]
        self.heads = heads
        self.tree = StaticTree(choices, max_depth=heads.num_heads, top_k=top_k, max_nodes=max_nodes)
        # Node i > 0 carries candidate rank[i] of head depth[i] - 1: its column in the flat [depth * k] candidates.
        self.k = max(self.tree.rank) + 1
        self.columns = [(d - 1) * self.k + r for d, r in zip(self.tree.depth[1:], self.tree.rank[1:])]
        self.candidates: torch.Tensor | None = None  # [B, depth, k] int64, per batch slot
        self._columns: torch.Tensor | None = None  # ``columns`` on the device

    @classmethod
    def from_pretrained(cls, path: str | Path, target, choices=None, **options) -> MedusaStrategy:
        """Heads from a directory in the Medusa authors' layout (``MedusaHeads.from_pretrained``), on the
        target's dtype and device; ``choices`` and ``options`` as the constructor takes them."""
        return cls(MedusaHeads.from_pretrained(path, target), choices, **options)

    @property
    def name(self) -> str:
        return f"medusa ({self.tree.size} nodes)"

    @property
    def max_nodes(self) -> int:
        return self.tree.size

    @property
    def max_depth(self) -> int:
        return self.tree.max_depth

    # ---- engine hooks (the Strategy protocol) -----------------------------------------------------

    def attach(self, target) -> None:
        check_fits_target(self.heads.hidden_size, self.heads.vocab_size, target, "MedusaStrategy(heads=...)")
        for what in ("dtype", "device"):
            mine, theirs = getattr(self.heads, what), getattr(target, what)
            if mine != theirs:
                raise ValueError(
                    f"the Medusa heads must be on the target's {what}: theirs is {mine}, the target's {theirs} "
                    "(MedusaStrategy.from_pretrained(path, target) loads them so)"
                )

    def prefill(self, prefill: Prefill) -> None:
        """Room for every slot's candidates; the prefill's ``commit`` fills them from the last prompt tokens."""
        batch, device = len(prefill.prompts), prefill.hidden.device
        self.candidates = torch.zeros(batch, self.max_depth, self.k, dtype=torch.int64, device=device)

    def join(self, prefill: Prefill) -> None:
        """Nothing to set up: the joining requests' ``commit`` (after their first token) writes their slots' rows."""

    def commit(self, result: StepResult) -> None:
        """Run the heads on the hidden state of each running request's last accepted node; keep their top-k."""
        finished = set(result.finished)
        keep = [r for r, b in enumerate(result.running) if b not in finished]
        if not keep:
            return
        device = result.hidden.device
        rows = to_device(keep, torch.int64, device)
        last = to_device([result.accepted[r] for r in keep], torch.int64, device)
        node = result.accepted_path.index_select(0, rows).gather(1, last[:, None]).squeeze(1)
        row = result.node_offsets.index_select(0, rows) + node  # the last accepted node's row of hidden
        logits = self.heads(result.hidden.index_select(0, row.long()))[: self.max_depth]  # [depth, R', V]
        top = logits.topk(self.k, dim=-1).indices.transpose(0, 1)  # [R', depth, k]
        slots = to_device([result.running[r] for r in keep], torch.int64, device)
        self.candidates.index_copy_(0, slots, top)

    def propose(self, step: StepContext) -> Proposal:
        """Each request's tree, cut to its limits: the root, then the heads' candidates at their nodes."""
        device, n = step.device, self.tree.size
        cuts = [self.tree.cut(depth, nodes) for depth, nodes in zip(step.max_depth, step.max_nodes)]
        parents = [p for p, _ in cuts]
        roots = to_device(step.roots, torch.int64, device)
        if all(len(p) == 1 for p in parents):  # nothing to draft: a plain decoding step
            return Proposal(roots, parents, rule="deterministic")
        if self._columns is None or self._columns.device != device:
            self._columns = to_device(self.columns, torch.int64, device)
        candidates = self.candidates.index_select(0, to_device(step.running, torch.int64, device))
        drafts = candidates.flatten(1).index_select(1, self._columns)  # [R, n - 1]
        tokens = torch.cat((roots[:, None], drafts), dim=1).flatten()  # [R * n]
        if any(len(p) < n for p in parents):
            keep = [r * n + node for r, (_, kept) in enumerate(cuts) for node in kept]
            tokens = tokens.index_select(0, to_device(keep, torch.int64, device))
        return Proposal(tokens, parents, rule="deterministic")
