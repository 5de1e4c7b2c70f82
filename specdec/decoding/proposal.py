"""What a drafting strategy hands the engine each step: one token tree per running request.

Every strategy's output has the same form. A chain is the tree whose parents are
``i - 1``; "nothing proposed" (plain autoregressive decoding) is the one-node tree.
Node 0 of each tree is its root: the last emitted token, which the target has not
seen yet. Trees are laid out in topological order with local parent indices, as
``build_tree_metadata`` and ``verify_tree`` expect.

The tree *shapes* (parents, node counts) are host data the strategy already knows,
so their metadata is built on the CPU and sent to the device without a sync; only
the tokens and the draft distributions are device tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec.kernels import build_tree_metadata


@dataclass(frozen=True)
class Proposal:
    """Token trees of the running requests, flattened in running order.

    tokens       [N] int64 (device)     node tokens; node 0 of each tree is its root
    parents      list[list[int]] (host) local parents per tree, -1 for the root
    child_probs  [N, V] fp32 or None    row i: the distribution node i's children were drawn
                                        from i.i.d. (stochastic rule); None: children were
                                        chosen deterministically (top-k, n-gram, greedy)
    """

    tokens: torch.Tensor
    parents: list[list[int]]
    child_probs: torch.Tensor | None = None

    @property
    def counts(self) -> list[int]:
        return [len(p) for p in self.parents]

    @property
    def num_drafted(self) -> list[int]:
        return [len(p) - 1 for p in self.parents]

    def max_depth(self) -> int:
        return max((max(depths(p)) for p in self.parents), default=0)


def depths(parents: list[int]) -> list[int]:
    """Depth of every node of one tree (parents before children)."""
    out = []
    for p in parents:
        out.append(0 if p < 0 else out[p] + 1)
    return out


def tree_metadata_on(parents: list[list[int]], device: torch.device):
    """(depth [N] int32, ancestor_mask [N, W] int64) on ``device``, computed on the host.

    Strategies repeat a few tree shapes across requests, so each distinct shape is built once.
    """
    width = max(len(t) for t in parents)
    shapes: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}
    for tree in parents:
        key = tuple(tree)
        if key not in shapes:
            flat = torch.tensor(key, dtype=torch.int32)
            meta = build_tree_metadata(flat, torch.tensor([0, len(key)], dtype=torch.int32), width)
            shapes[key] = (meta.depth, meta.ancestor_mask)
    depth = torch.cat([shapes[tuple(t)][0] for t in parents])
    mask = torch.cat([shapes[tuple(t)][1] for t in parents])
    return _send(depth, device), _send(mask, device)


def _send(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
