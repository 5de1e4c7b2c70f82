"""Token-tree metadata: depths and bit-packed ancestor-or-self masks.

A batch of token trees is given by its parent arrays, flattened across requests:

    parents  [N]    int32   parents[i] is the *local* index of node i's parent in
                            its own tree; -1 for the root, which is node 0 of each
                            tree; parents come first (parents[i] < i locally)
    offsets  [B+1]  int32   tree b owns nodes offsets[b] .. offsets[b+1]-1; every
                            tree has at least its root

and the op returns, with shapes from N and ``max_nodes`` only,

    depth          [N]     int32  root = 0; RoPE position = prefix + depth
    ancestor_mask  [N, W]  int64  W = ceil(max_nodes / 64); bit j of row i
                                  (word j // 64, bit j % 64) is set when local
                                  node j is i itself or an ancestor

Because parents precede children, mask row i is row parents[i] plus bit i.

The C++ op ``torch.ops.specdec.tree_metadata`` (csrc/tree_metadata.cpp, and a CUDA
version in the GPU build) does the work when the extension is built; otherwise
``tree_metadata_torch`` does it with device ops (pointer doubling, no host loop).
``tree_metadata_reference`` is the readable oracle. Validating the values reads them
(one sync on a GPU); with ``max_nodes`` given and ``check=False`` no value is read, so
the call can sit inside a captured or compiled step.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from specdec import _backend
from specdec.kernels._checks import check_offsets, check_same_device, check_tensor

MASK_WORD_BITS = 64


class TreeMetadata(NamedTuple):
    depth: torch.Tensor
    ancestor_mask: torch.Tensor


def mask_words(max_nodes: int) -> int:
    """Number of int64 words in one ancestor-mask row for trees of ``max_nodes``."""
    return (max_nodes + MASK_WORD_BITS - 1) // MASK_WORD_BITS


# --------------------------------------------------------------------------------------------
# PyTorch body (used without the extension)
# --------------------------------------------------------------------------------------------


def tree_metadata_torch(parents: torch.Tensor, offsets: torch.Tensor, max_nodes: int) -> TreeMetadata:
    """Depths and masks by pointer doubling: after step k every node holds its ancestors up to 2^k - 1 hops.

    Device ops only, ``ceil(log2(max_nodes))`` steps; inputs assumed valid (see ``build_tree_metadata``).
    """
    nodes = parents.numel()
    index = torch.arange(nodes, device=parents.device)
    tree = torch.searchsorted(offsets[1:].contiguous(), index.to(offsets.dtype), right=True).clamp_(
        max=offsets.numel() - 2
    )
    start = offsets.long()[tree]
    local = (index - start).clamp_(0, max_nodes - 1)
    ancestors = torch.zeros(nodes, max_nodes, dtype=torch.bool, device=parents.device)
    ancestors[index, local] = True
    jump = torch.where(parents >= 0, start + parents.long(), -1)  # global index of the parent, -1 past the root
    for _ in range(max(0, max_nodes - 1).bit_length()):
        has = (jump >= 0)[:, None]
        target = jump.clamp(min=0)
        ancestors |= ancestors[target] & has
        jump = torch.where(jump >= 0, jump[target], -1)
    depth = (ancestors.sum(1) - 1).to(torch.int32)
    return TreeMetadata(depth, pack_mask_rows(ancestors))


# --------------------------------------------------------------------------------------------
# Public op
# --------------------------------------------------------------------------------------------


def build_tree_metadata(
    parents: torch.Tensor, offsets: torch.Tensor, max_nodes: int | None = None, *, check: bool = True
) -> TreeMetadata:
    """Depths and ancestor-or-self bit masks of a batch of token trees.

    Parameters
    ----------
    parents : int32 ``[N]``; local parent index of each node, -1 for each tree's root.
    offsets : int32 ``[B+1]``; cu_seqlens-style node offsets of the B trees.
    max_nodes : mask width in nodes (default: the largest tree, read from ``offsets``).
        Passing it keeps output shapes fixed across steps.
    check : validate the values (offsets, roots, parents before children), raising ValueError
        naming the bad entry. On a GPU that reads them back (one sync); ``check=False`` with
        ``max_nodes`` given reads nothing. Unchecked malformed trees give undefined rows (the
        kernels stay inside their buffers).

    Returns
    -------
    TreeMetadata(depth [N] int32, ancestor_mask [N, ceil(max_nodes/64)] int64), on the device
    of ``parents``.

    Example
    -------
    >>> parents = torch.tensor([-1, 0, 0, 1], dtype=torch.int32)   # root, two children, a grandchild
    >>> meta = build_tree_metadata(parents, torch.tensor([0, 4], dtype=torch.int32))
    >>> meta.depth.tolist(), meta.ancestor_mask[:, 0].tolist()
    ([0, 1, 1, 2], [1, 3, 5, 11])
    """
    check_tensor("parents", parents, dtype=torch.int32, ndim=1)
    check_tensor("offsets", offsets, dtype=torch.int32, ndim=1)
    check_same_device(parents=parents, offsets=offsets)
    if offsets.numel() < 1:
        raise ValueError("offsets must hold B+1 >= 1 entries, got none")
    if max_nodes is None:  # the largest tree, from offsets that must make sense first (one read)
        bounds = check_offsets("offsets", offsets, total=parents.numel())
        max_nodes = max((end - start for start, end in zip(bounds, bounds[1:])), default=1) or 1
    if not isinstance(max_nodes, int) or isinstance(max_nodes, bool) or max_nodes < 1:
        raise ValueError(f"max_nodes must be a positive int, got {max_nodes!r}")
    ext, _ = _backend.extension_status()
    use_ext = ext is not None and _backend.forced_backend() != "torch"
    if use_ext and (parents.is_cpu or _backend.extension_has_cuda()):
        return TreeMetadata(*torch.ops.specdec.tree_metadata(parents, offsets, max_nodes, check))
    if check:
        check_trees(parents, offsets, max_nodes)
    if offsets.numel() == 1:  # no trees
        return TreeMetadata(parents.new_empty(0), parents.new_empty(0, mask_words(max_nodes), dtype=torch.int64))
    return tree_metadata_torch(parents, offsets, max_nodes)


def check_trees(parents: torch.Tensor, offsets: torch.Tensor, max_nodes: int) -> None:
    """Validate the values of a batch of trees (reads them to the host)."""
    bounds = check_offsets("offsets", offsets, total=parents.numel())
    parents_host = parents.cpu()
    for b in range(len(bounds) - 1):
        start, end = bounds[b], bounds[b + 1]
        local = parents_host[start:end]
        n = end - start
        if n == 0:
            raise ValueError(f"offsets give tree {b} no nodes; every tree needs at least its root")
        if n > max_nodes:
            raise ValueError(f"tree {b} has {n} nodes, more than max_nodes={max_nodes}")
        if int(local[0]) != -1:
            raise ValueError(f"parents[{start}] (root of tree {b}) must be -1, got {int(local[0])}")
        bad = ((local < 0) | (local >= torch.arange(n)))[1:].nonzero().flatten()
        if bad.numel():
            i = int(bad[0]) + 1
            raise ValueError(
                f"parents[{start + i}] = {int(local[i])} in tree {b} must lie in [0, {i}) "
                "(local index of an earlier node: parents come before children)"
            )


def pack_mask_rows(bits: torch.Tensor) -> torch.Tensor:
    """Pack a bool ``[rows, n]`` matrix into int64 ``[rows, ceil(n/64)]`` words, bit j -> word j//64."""
    rows, n = bits.shape
    words = mask_words(n)
    padded = torch.zeros(rows, words * MASK_WORD_BITS, dtype=torch.int64, device=bits.device)
    padded[:, :n] = bits.to(torch.int64)
    weights = torch.ones(MASK_WORD_BITS, dtype=torch.int64, device=bits.device) << torch.arange(
        MASK_WORD_BITS, device=bits.device
    )
    # Distinct powers of two never carry, so the (wrapping) int64 sum is the bitwise OR.
    return (padded.view(rows, words, MASK_WORD_BITS) * weights).sum(-1)


def unpack_mask_rows(words: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of ``pack_mask_rows``: int64 ``[rows, W]`` -> bool ``[rows, n]``."""
    shifts = torch.arange(MASK_WORD_BITS, device=words.device)
    bits = (words.unsqueeze(-1) >> shifts) & 1
    return bits.flatten(1)[:, :n].bool()


# --------------------------------------------------------------------------------------------
# PyTorch reference
# --------------------------------------------------------------------------------------------


def tree_metadata_reference(parents: torch.Tensor, offsets: torch.Tensor, max_nodes: int) -> TreeMetadata:
    """Readable ``build_tree_metadata``: tree by tree, node by node (checks the values first)."""
    check_tensor("parents", parents, dtype=torch.int32, ndim=1)
    check_trees(parents, offsets, max_nodes)
    bounds, parents_host = offsets.tolist(), parents.tolist()
    depth = torch.zeros(parents.numel(), dtype=torch.int32)
    ancestors = torch.zeros(parents.numel(), max_nodes, dtype=torch.bool)
    for b in range(len(bounds) - 1):
        start = bounds[b]
        for i in range(bounds[b + 1] - start):  # parents precede children, so one pass suffices
            ancestors[start + i, i] = True
            p = parents_host[start + i]
            if p >= 0:
                ancestors[start + i] |= ancestors[start + p]
                depth[start + i] = depth[start + p] + 1
    return TreeMetadata(depth.to(parents.device), pack_mask_rows(ancestors).to(parents.device))


def _register_fake() -> None:
    """Shape-only implementation (shapes from N and max_nodes) for torch.compile and opcheck."""

    @torch.library.register_fake("specdec::tree_metadata")
    def _(parents, offsets, max_nodes, check=True):
        n = parents.shape[0]
        return parents.new_empty(n), parents.new_empty(n, mask_words(max_nodes), dtype=torch.int64)


if _backend.extension_status()[0] is not None:
    _register_fake()
