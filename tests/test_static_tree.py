"""Static trees from top-k index paths (specdec.decoding.static_tree): layout, cuts, validation, the best tree."""

import itertools
import random

import pytest

from specdec.decoding.proposal import depths
from specdec.decoding.static_tree import StaticTree, best_paths

CHOICES = [[0], [1], [0, 0], [2], [0, 1], [1, 0], [0, 0, 0], [0, 0, 0, 0], [0, 1, 0]]


def tree_of(choices=CHOICES, max_depth=4, top_k=10, max_nodes=64):
    return StaticTree(choices, max_depth=max_depth, top_k=top_k, max_nodes=max_nodes)


def test_layout_follows_the_paths_in_the_order_given():
    tree = tree_of()
    assert tree.size == len(CHOICES) + 1 and tree.max_depth == 4
    assert tree.choices() == CHOICES
    for i, path in enumerate(CHOICES, start=1):
        parent = tree.parents[i]
        assert tree.paths[parent] == tuple(path[:-1]), f"node {i}: parent {parent}"
        assert tree.depth[i] == len(path) and tree.rank[i] == path[-1]
    assert tree.depth == depths(tree.parents)


@pytest.mark.parametrize("max_depth, max_nodes", [(4, 64), (0, 64), (1, 64), (2, 5), (3, 3), (4, 1), (-1, 0), (9, 7)])
def test_cuts_keep_the_first_nodes_within_the_limits_and_every_parent(max_depth, max_nodes):
    tree = tree_of()
    parents, kept = tree.cut(max_depth, max_nodes)
    within = [i for i in range(tree.size) if tree.depth[i] <= max(max_depth, 0)]
    assert kept == within[: max(max_nodes, 1)]
    assert len(parents) == len(kept) and parents[0] == -1
    for j, node in enumerate(kept[1:], start=1):
        assert kept[parents[j]] == tree.parents[node], f"node {node} lost its parent"


@pytest.mark.parametrize(
    "choices, match",
    [
        ([[0], [0, 1, 0]], r"choices\[1\] = \[0, 1, 0\]: its prefix \[0, 1\] is missing"),
        ([[0, 0], [0]], r"choices\[0\] = \[0, 0\]: its prefix \[0\] is listed after it"),
        ([[0], [10]], r"choices\[1\] = \[10\] takes candidate 10; top_k is 10"),
        ([[0], [0, 0], [0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0, 0]], r"choices\[4\] .* is 5 deep; at most 4 allowed"),
        ([[0], [1], [0]], r"choices\[2\] = \[0\] is listed twice"),
        ([[0], []], r"choices\[1\] must be a non-empty list of ints >= 0, got \[\]"),
        ([[0], [-1]], r"choices\[1\] must be a non-empty list of ints >= 0, got \[-1\]"),
        ([[0], [1.0]], r"choices\[1\] must be a non-empty list of ints >= 0"),
        ([[0], [True]], r"choices\[1\] must be a non-empty list of ints >= 0"),
        ([[0], "01"], r"choices\[1\] must be a non-empty list of ints >= 0, got '01'"),
        ([[i] for i in range(8)], r"choices has 8 paths: with the root that is 9 nodes, more than the budget of 8"),
    ],
)
def test_invalid_choices_are_refused_by_name(choices, match):
    with pytest.raises(ValueError, match=match):
        tree_of(choices, max_nodes=8)


def test_choices_must_be_a_list():
    with pytest.raises(TypeError, match="choices must be a list of paths"):
        tree_of("[[0]]")
    with pytest.raises(TypeError, match="choices must be a list of paths"):
        tree_of(None)


def accepted(tree_paths, observation) -> int:
    """Greedy accepted length of a tree for one rank path: its longest prefix in the tree."""
    n = 0
    while n < len(observation) and tuple(observation[: n + 1]) in tree_paths:
        n += 1
    return n


def random_observations(seed, count=300, top_k=3, depth=3):
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        path = []
        while len(path) < depth and rng.random() < 0.7:
            path.append(min(int(rng.expovariate(1.2)), top_k - 1))
        out.append(tuple(path))
    return out


@pytest.mark.parametrize("seed", range(3))
def test_the_values_sum_to_the_mean_accepted_length(seed):
    observed = random_observations(seed)
    ranked = best_paths(observed, max_nodes=12)
    for m in range(len(ranked) + 1):
        paths = {p for p, _ in ranked[:m]}
        mean = sum(accepted(paths, o) for o in observed) / len(observed)
        assert abs(sum(v for _, v in ranked[:m]) - mean) < 1e-12, f"first {m} paths"
    values = [v for _, v in ranked]
    assert values == sorted(values, reverse=True)
    tree_of([list(p) for p, _ in ranked], top_k=3)  # every prefix of the ranking is a valid tree


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("max_nodes", [2, 4, 6])
def test_best_paths_is_the_best_tree_of_its_size(seed, max_nodes):
    """Against every prefix-closed set of paths (top-k 3, depth 2: 12 possible nodes)."""
    observed = random_observations(seed, top_k=3, depth=2)
    candidates = [(i,) for i in range(3)] + [(i, j) for i in range(3) for j in range(3)]
    best = 0.0
    for subset in itertools.combinations(candidates, max_nodes - 1):
        if all(p[:-1] == () or p[:-1] in subset for p in subset):
            best = max(best, sum(accepted(set(subset), o) for o in observed) / len(observed))
    found = {p for p, _ in best_paths(observed, max_nodes)}
    assert len(found) <= max_nodes - 1
    assert sum(accepted(found, o) for o in observed) / len(observed) == pytest.approx(best, abs=1e-12)
    assert best > 0


def test_paths_nothing_matches_are_left_out():
    assert best_paths([(), (0,), (0,)], max_nodes=64) == [((0,), 2 / 3)]
    assert best_paths([], max_nodes=8) == []
