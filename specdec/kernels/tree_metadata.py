"""Token-tree metadata: depths, bit-packed ancestor-or-self masks, root-to-leaf paths.

A batch of token trees is given by its parent arrays, flattened across requests:

    parents  [N]    int32   parents[i] is the *local* index of node i's parent in
                            its own tree; -1 for the root, which is node 0 of each
                            tree; parents come first (parents[i] < i locally)
    offsets  [B+1]  int32   tree b owns nodes offsets[b] .. offsets[b+1]-1; every
                            tree has at least its root

and the op returns

    depth          [N]              int32  root = 0; RoPE position = prefix + depth
    ancestor_mask  [N, W]           int64  W = ceil(max_nodes / 64); bit j of row i
                                           (word j // 64, bit j % 64) is set when
                                           local node j is i itself or an ancestor
    leaf_paths     [L, max_nodes]   int32  local node indices root..leaf, -1 padded
    leaf_offsets   [B+1]            int32  tree b owns leaf rows leaf_offsets[b]..

Because parents precede children, a root-to-leaf path lists increasing indices,
and mask row i is row parents[i] plus bit i.

The C++ op ``torch.ops.specdec.tree_metadata`` (csrc/tree_metadata.cpp, and a
CUDA version in the GPU build) does the work when the extension is built; the
PyTorch reference below is used otherwise and is the tests' oracle. The number
of leaves L depends on the data, so on CUDA the op reads one count back to the
host: build tree metadata once per tree shape, outside the decode loop's hot part.
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
    leaf_paths: torch.Tensor
    leaf_offsets: torch.Tensor


def mask_words(max_nodes: int) -> int:
    """Number of int64 words in one ancestor-mask row for trees of ``max_nodes``."""
    return (max_nodes + MASK_WORD_BITS - 1) // MASK_WORD_BITS


def build_tree_metadata(parents: torch.Tensor, offsets: torch.Tensor, max_nodes: int | None = None) -> TreeMetadata:
    """Depths, ancestor-or-self bit masks and leaf paths of a batch of token trees.

    Parameters
    ----------
    parents : int32 ``[N]``; local parent index of each node, -1 for each tree's root.
    offsets : int32 ``[B+1]``; cu_seqlens-style node offsets of the B trees.
    max_nodes : mask/path width in nodes (default: the largest tree). Passing it
        keeps output shapes fixed across steps.

    Returns
    -------
    TreeMetadata(depth [N] int32, ancestor_mask [N, ceil(max_nodes/64)] int64,
    leaf_paths [L, max_nodes] int32 padded with -1, leaf_offsets [B+1] int32),
    on the device of ``parents``.

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
    if max_nodes is None:
        sizes = torch.diff(offsets)
        max_nodes = int(sizes.max()) if sizes.numel() else 1
    if not isinstance(max_nodes, int) or max_nodes < 1:
        raise ValueError(f"max_nodes must be a positive int, got {max_nodes!r}")
    ext, _ = _backend.extension_status()
    use_ext = ext is not None and _backend.forced_backend() != "torch"
    if use_ext and (parents.is_cpu or _backend.extension_has_cuda()):
        return TreeMetadata(*torch.ops.specdec.tree_metadata(parents, offsets, max_nodes))
    return tree_metadata_reference(parents, offsets, max_nodes)


def tree_metadata_reference(parents: torch.Tensor, offsets: torch.Tensor, max_nodes: int) -> TreeMetadata:
    """Readable PyTorch implementation of ``build_tree_metadata`` (same contract)."""
    check_tensor("parents", parents, dtype=torch.int32, ndim=1)
    bounds = check_offsets("offsets", offsets, total=parents.numel())
    device = parents.device
    parents_host = parents.cpu().long()
    depth = torch.zeros(parents.numel(), dtype=torch.int32)
    ancestors = torch.zeros(parents.numel(), max_nodes, dtype=torch.bool)
    paths, leaf_counts = [], []
    for b in range(len(bounds) - 1):
        start, end = bounds[b], bounds[b + 1]
        local = parents_host[start:end]
        _check_tree_parents(local, b, start, max_nodes)
        n = end - start
        tree_anc = torch.eye(n, max_nodes, dtype=torch.bool)
        tree_depth = torch.zeros(n, dtype=torch.int32)
        for i in range(1, n):  # parents precede children, so one pass suffices
            p = int(local[i])
            tree_anc[i] |= tree_anc[p]
            tree_depth[i] = tree_depth[p] + 1
        ancestors[start:end] = tree_anc
        depth[start:end] = tree_depth
        is_parent = torch.zeros(n, dtype=torch.bool)
        is_parent[local[1:]] = True
        leaves = (~is_parent).nonzero().flatten()
        leaf_counts.append(leaves.numel())
        for leaf in leaves.tolist():
            path = tree_anc[leaf].nonzero().flatten().to(torch.int32)  # increasing = root to leaf
            paths.append(torch.cat([path, path.new_full((max_nodes - path.numel(),), -1)]))
    leaf_paths = torch.stack(paths) if paths else torch.empty(0, max_nodes, dtype=torch.int32)
    leaf_offsets = torch.tensor([0] + leaf_counts, dtype=torch.int32).cumsum(0).to(torch.int32)
    return TreeMetadata(
        depth.to(device), pack_mask_rows(ancestors).to(device), leaf_paths.to(device), leaf_offsets.to(device)
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


def _check_tree_parents(local: torch.Tensor, tree: int, start: int, max_nodes: int) -> None:
    n = local.numel()
    if n == 0:
        raise ValueError(f"offsets give tree {tree} no nodes; every tree needs at least its root")
    if n > max_nodes:
        raise ValueError(f"tree {tree} has {n} nodes, more than max_nodes={max_nodes}")
    if int(local[0]) != -1:
        raise ValueError(f"parents[{start}] (root of tree {tree}) must be -1, got {int(local[0])}")
    index = torch.arange(n)
    bad = ((local < 0) | (local >= index))[1:].nonzero().flatten()
    if bad.numel():
        i = int(bad[0]) + 1
        raise ValueError(
            f"parents[{start + i}] = {int(local[i])} in tree {tree} must lie in [0, {i}) "
            "(local index of an earlier node: parents come before children)"
        )


def _register_fake() -> None:
    """Shape-only implementation so the op works under torch.compile and opcheck."""

    @torch.library.register_fake("specdec::tree_metadata")
    def _(parents, offsets, max_nodes):
        ctx = torch.library.get_ctx()
        leaves = ctx.new_dynamic_size()
        n = parents.shape[0]
        return (
            parents.new_empty(n),
            parents.new_empty(n, mask_words(max_nodes), dtype=torch.int64),
            parents.new_empty(leaves, max_nodes),
            offsets.new_empty(offsets.shape[0]),
        )


if _backend.extension_status()[0] is not None:
    _register_fake()
