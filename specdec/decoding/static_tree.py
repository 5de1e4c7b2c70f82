"""Static token trees written as top-k index paths ("choices"), and the best such tree for measured ranks.

Medusa and EAGLE-1 publish their trees as lists of paths, e.g. ``[[0], [1], [0, 0], [0, 1]]``:
path ``[i0, i1, ..., id]`` is the node reached from the root by taking the drafter's
``i0``-th best token at depth 1, then the ``i1``-th best (given that token) at depth 2, and so
on. The root (the last emitted token) is implicit. ``StaticTree`` turns such a list into the
engine's form -- parents in topological order, node 0 the root -- and cuts it to per-request
node and depth limits.

Which tree? With a drafter whose candidates at each depth are distinct tokens, at most one
node per depth matches the target's greedy text, and the matching nodes form a path from the
root. So the number of draft tokens a greedy step accepts is the number of tree nodes whose path
matches, and its mean over a set of positions is the sum, over the nodes, of the share of
positions at which that node's path matches (its "value"). Observe, at each position, the ranks
of the true tokens among the drafter's candidates (``observed``: one rank path per position, cut
at the first true token outside the candidates) and a node's value is the share of observations
it prefixes. A path never has more value than its prefix, so the ``n - 1`` most valuable paths
form a tree, and it is the best tree of ``n`` nodes for those observations (``best_paths``).
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Iterable, Sequence


class StaticTree:
    """A token tree given by top-k index paths, validated and laid out for the engine.

    Parameters
    ----------
    choices : the paths (lists of ints >= 0, the root excluded), each listed after its prefix
        (e.g. sorted by length, as the Medusa authors list theirs). Order is kept: node i + 1
        is ``choices[i]``, so a tree listed most valuable first (``best_paths``) keeps its best
        nodes when a node limit cuts it.
    max_depth : the longest path allowed (e.g. the number of Medusa heads).
    top_k : candidates per depth; every index must be below it.
    max_nodes : node budget, root included.
    name : the argument's name in error messages.

    Attributes
    ----------
    paths : node paths as tuples, ``()`` for the root.
    parents, depth, rank : per node, root first: local parent (-1 for the root), depth, and the
        last index of its path (the candidate it takes at its depth; -1 for the root).

    Example
    -------
    >>> tree = StaticTree([[0], [1], [0, 0], [0, 1], [1, 0]], max_depth=4, top_k=10, max_nodes=64)
    >>> tree.parents, tree.depth, tree.rank
    ([-1, 0, 0, 1, 1, 2], [0, 1, 1, 2, 2, 2], [-1, 0, 1, 0, 1, 0])
    >>> tree.cut(max_depth=2, max_nodes=4)
    ([-1, 0, 0, 1], [0, 1, 2, 3])
    """

    def __init__(self, choices, *, max_depth: int, top_k: int, max_nodes: int, name: str = "choices"):
        if isinstance(choices, (str, bytes)) or not isinstance(choices, Sequence):
            raise TypeError(f"{name} must be a list of paths (lists of ints), got {type(choices).__name__}")
        if len(choices) + 1 > max_nodes:
            raise ValueError(
                f"{name} has {len(choices)} paths: with the root that is {len(choices) + 1} nodes, "
                f"more than the budget of {max_nodes} (max_nodes)"
            )
        index: dict[tuple[int, ...], int] = {(): 0}
        listed = {tuple(p) for p in choices if isinstance(p, Sequence) and not isinstance(p, (str, bytes))}
        self.parents, self.depth, self.rank = [-1], [0], [-1]
        for i, path in enumerate(choices):
            path = _as_path(path, f"{name}[{i}]")
            if len(path) > max_depth:
                raise ValueError(f"{name}[{i}] = {list(path)} is {len(path)} deep; at most {max_depth} allowed")
            if path[-1] >= top_k:
                raise ValueError(f"{name}[{i}] = {list(path)} takes candidate {path[-1]}; top_k is {top_k}")
            if path in index:
                raise ValueError(f"{name}[{i}] = {list(path)} is listed twice")
            if path[:-1] not in index:
                where = "listed after it" if path[:-1] in listed else "missing"
                raise ValueError(
                    f"{name}[{i}] = {list(path)}: its prefix {list(path[:-1])} is {where} "
                    "(every path must come after its prefix)"
                )
            index[path] = len(self.parents)
            self.parents.append(index[path[:-1]])
            self.depth.append(len(path))
            self.rank.append(path[-1])
        self.paths = list(index)

    @property
    def size(self) -> int:
        """Nodes, root included."""
        return len(self.parents)

    @property
    def max_depth(self) -> int:
        return max(self.depth)

    def choices(self) -> list[list[int]]:
        """The paths as lists, root excluded (what the constructor takes)."""
        return [list(p) for p in self.paths[1:]]

    def cut(self, max_depth: int, max_nodes: int) -> tuple[list[int], list[int]]:
        """(parents, kept nodes) of the tree within the limits: the nodes of depth <= ``max_depth`` in
        order, the first ``max_nodes`` of them (at least the root). A subsequence that keeps every
        parent, since parents come first and are shallower."""
        return _cut(tuple(self.parents), tuple(self.depth), max(max_depth, 0), max(max_nodes, 1))


@functools.lru_cache(maxsize=256)
def _cut(parents, depth, max_depth, max_nodes) -> tuple[list[int], list[int]]:
    kept = [i for i, d in enumerate(depth) if d <= max_depth][:max_nodes]
    local = {node: j for j, node in enumerate(kept)}
    return [-1] + [local[parents[i]] for i in kept[1:]], kept


def _as_path(path, name: str) -> tuple[int, ...]:
    if isinstance(path, (str, bytes)) or not isinstance(path, Sequence) or not path:
        raise ValueError(f"{name} must be a non-empty list of ints >= 0, got {path!r}")
    if any(not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in path):
        raise ValueError(f"{name} must be a non-empty list of ints >= 0, got {path!r}")
    return tuple(path)


def best_paths(observed: Iterable[Sequence[int]], max_nodes: int) -> list[tuple[tuple[int, ...], float]]:
    """The best tree of at most ``max_nodes`` nodes (root included) for observed rank paths, with each node's value.

    ``observed``: one rank path per position (the ranks of the true tokens at depths 1, 2, ...
    among the drafter's candidates, cut before the first one outside them; ``()`` when even the
    first is outside). Returns ``(path, value)`` pairs, most valuable first (ties: shorter, then
    smaller indices), each path after its prefix; ``value`` = the share of positions whose rank
    path starts with it. The mean greedy accepted length of the tree made of the first ``m``
    paths is the sum of their values (module docstring). Paths no position matches are left out.

    Example
    -------
    >>> best_paths([(0, 0), (0, 1), (1,), (0, 0, 2)], max_nodes=3)
    [((0,), 0.75), ((0, 0), 0.5)]
    """
    counts: Counter[tuple[int, ...]] = Counter()
    total = 0
    for path in observed:
        total += 1
        path = tuple(path)
        for d in range(1, len(path) + 1):
            counts[path[:d]] += 1
    ranked = sorted(counts.items(), key=lambda item: (-item[1], len(item[0]), item[0]))
    return [(path, count / total) for path, count in ranked[: max(max_nodes - 1, 0)]]
