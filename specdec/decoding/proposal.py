"""What a drafting strategy hands the engine each step: one token tree per running request.

Every strategy's output has the same form. A chain is the tree whose parents are
``i - 1``; "nothing proposed" (plain autoregressive decoding) is the one-node tree.
Node 0 of each tree is its root: the last emitted token, which the target has not
seen yet. Trees are laid out in topological order with local parent indices, as
``build_tree_metadata`` and ``verify_tree`` expect.

The tree *shapes* (parents, node counts) are usually host data the strategy already knows,
so their metadata is built from those lists on the host and sent to the device without
a sync; only the tokens and the draft distributions are device tensors. A dynamic tree
(EAGLE-2: the shape follows the draft's confidences) is chosen on the device instead: the
strategy passes ``DeviceTrees`` -- its parents as a device tensor, its node counts and a depth
bound per tree as host ints -- and the engine builds the mask on the device, reading nothing back.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec._transfer import to_device
from specdec.kernels import build_tree_metadata, pack_mask_rows
from specdec.kernels._checks import check_tensor
from specdec.kernels.sampling_params import check_rule


@dataclass(frozen=True)
class DeviceTrees:
    """Tree shapes chosen on the device: what the host knows of them is their sizes.

    parents  [N] int32 (device)  local parents of every node, tree after tree, -1 at each root
                                 (topological order: 0 <= parent < node within its tree)
    counts   list[int] (host)    nodes per tree, root included
    depths   list[int] (host)    an upper bound of each tree's depth (its drafted levels)

    The engine cannot check the parents without reading them back; the strategy vouches for
    them (``build_tree_metadata``'s contract, ``check=False``).
    """

    parents: torch.Tensor
    counts: list[int]
    depths: list[int]


@dataclass(frozen=True)
class Proposal:
    """Token trees of the running requests, flattened in running order.

    tokens       [N] int64 (device)     node tokens; node 0 of each tree is its root
    parents      list[list[int]] (host) local parents per tree, -1 for the root; or ``DeviceTrees``
                                        for shapes chosen on the device (module docstring)
    rule         "stochastic" or "deterministic": how the children were chosen (see
                 ``specdec.kernels.sampling_params``)
    draft_probs  [N, V] fp32 or None    stochastic rule only: row i is the distribution node i's
                                        children were drawn from, i.i.d.

    Example
    -------
    >>> p = Proposal(torch.tensor([5, 7, 9, 4]), [[-1, 0, 0], [-1]], rule="deterministic")
    >>> p.counts, p.num_drafted, p.max_depth()
    ([3, 1], [2, 0], 1)
    """

    tokens: torch.Tensor
    parents: list[list[int]]
    rule: str
    draft_probs: torch.Tensor | None = None

    def __post_init__(self):
        check_rule(self.rule, self.draft_probs)

    @property
    def on_host(self) -> bool:
        """The tree shapes are host lists (else ``DeviceTrees``)."""
        return not isinstance(self.parents, DeviceTrees)

    @property
    def counts(self) -> list[int]:
        return [len(p) for p in self.parents] if self.on_host else list(self.parents.counts)

    @property
    def num_drafted(self) -> list[int]:
        return [n - 1 for n in self.counts]

    @property
    def depths(self) -> list[int]:
        """Depth of each tree (for ``DeviceTrees``, its bound)."""
        return [max(depths(p)) for p in self.parents] if self.on_host else list(self.parents.depths)

    def max_depth(self) -> int:
        return max(self.depths, default=0)


def depths(parents: list[int]) -> list[int]:
    """Depth of every node of one tree (parents before children)."""
    out = []
    for p in parents:
        out.append(0 if p < 0 else out[p] + 1)
    return out


def check_proposal(proposal, who: str, running: int, max_nodes: Sequence[int], max_depth: Sequence[int]) -> None:
    """Refuse a proposal that breaks the contract (``strategy.py``), naming the strategy ``who``.

    Host checks only: one tree per running request, each topologically ordered with its root at
    node 0, within its node and depth limits; as many tokens (and draft rows) as nodes.
    """
    if not isinstance(proposal, Proposal):
        raise TypeError(f"{who}.propose must return a Proposal, got {type(proposal).__name__}")
    if proposal.on_host:
        for r, tree in enumerate(proposal.parents):
            if not tree or tree[0] != -1 or any(not 0 <= p < i for i, p in enumerate(tree) if i):
                raise ValueError(
                    f"{who} proposed tree {r} with parents {tree}: need -1 at node 0, then 0 <= parent < node"
                )
    counts, tree_depths = proposal.counts, proposal.depths
    if len(counts) != running or len(tree_depths) != running:
        raise ValueError(f"{who} proposed {len(counts)} trees for {running} running requests")
    if not proposal.on_host:
        check_tensor(f"{who}'s DeviceTrees.parents", proposal.parents.parents, dtype=torch.int32,
                     shape=(sum(counts),), device=proposal.tokens.device)  # fmt: skip
    for r, (n, d, nodes, depth) in enumerate(zip(counts, tree_depths, max_nodes, max_depth)):
        if not 1 <= n <= nodes or not 0 <= d <= max(depth, 0) or d > n - 1:
            raise ValueError(
                f"{who} proposed tree {r} with {n} nodes and depth {d}; "
                f"the limits were {nodes} nodes and depth {max(depth, 0)}"
            )
    total = sum(counts)
    if proposal.tokens.shape != (total,):
        raise ValueError(f"{who} proposed tokens of shape {tuple(proposal.tokens.shape)} for {total} nodes")
    if proposal.draft_probs is not None and proposal.draft_probs.shape[0] != total:
        raise ValueError(f"{who} proposed {proposal.draft_probs.shape[0]} draft_probs rows for {total} nodes")


def tree_metadata_on(parents: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(depth [N] int32, ancestor_mask [N, W] int64) of host trees on ``device``, laid out as ``build_tree_metadata``.

    Built from the host lists (no tensor is read back), each distinct tree shape once, and sent
    without waiting. W = ceil(largest tree / 64) words per row, as the attention op expects.

    Example
    -------
    >>> depth, mask = tree_metadata_on([[-1, 0, 0, 1], [-1]], torch.device("cpu"))
    >>> depth.tolist(), mask.flatten().tolist()
    ([0, 1, 1, 2, 0], [1, 3, 5, 11, 1])
    """
    width = max(len(t) for t in parents)
    shapes = [_tree_shape(tuple(tree), width) for tree in parents]
    depth = to_device([d for tree_depth, _ in shapes for d in tree_depth], torch.int32, device)
    mask = to_device(torch.cat([tree_mask for _, tree_mask in shapes]), torch.int64, device)
    return depth, mask


def device_tree_metadata(trees: DeviceTrees, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(depth [N] int32, ancestor_mask [N, W] int64) of ``DeviceTrees`` whose node offsets are ``offsets [R+1]``,
    built on the device (nothing read back; W from the host counts)."""
    meta = build_tree_metadata(trees.parents, offsets, max(trees.counts), check=False)
    return meta.depth, meta.ancestor_mask


@functools.lru_cache(maxsize=1024)
def _tree_shape(parents: tuple[int, ...], width: int) -> tuple[list[int], torch.Tensor]:
    """Depths and the packed ancestor-or-self rows ``[n, ceil(width / 64)]`` int64 of one tree (host)."""
    rows: list[list[bool]] = []
    for i, p in enumerate(parents):
        row = [False] * width if p < 0 else list(rows[p])
        row[i] = True
        rows.append(row)
    return depths(list(parents)), pack_mask_rows(torch.tensor(rows, dtype=torch.bool))
