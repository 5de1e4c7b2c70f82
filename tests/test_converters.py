"""SGLang tree lists and FlashInfer packed masks <-> specdec's parents and mask rows, against brute force."""

import numpy as np
import pytest
import torch

from specdec.integrations.converters import (
    flashinfer_mask_to_rows,
    parents_to_sglang,
    rows_to_flashinfer_mask,
    sglang_to_parents,
)
from specdec.kernels import build_tree_metadata


def random_parents(n: int, generator: torch.Generator) -> list[int]:
    return [-1] + [int(torch.randint(i, (1,), generator=generator)) for i in range(1, n)]


def sglang_lists(parents: list[int], sibling_order) -> tuple[list[int], list[int]]:
    """First-child / next-sibling lists written out by hand, children in ``sibling_order(children)``."""
    n = len(parents)
    first, sibling = [-1] * n, [-1] * n
    for p in range(n):
        children = sibling_order([c for c in range(n) if parents[c] == p])
        if children:
            first[p] = children[0]
            for a, b in zip(children, children[1:]):
                sibling[a] = b
    return first, sibling


def ancestors(parents: list[int]) -> list[set[int]]:
    out = []
    for i in range(len(parents)):
        chain, j = set(), i
        while j != -1:
            chain.add(j)
            j = parents[j]
        out.append(chain)
    return out


@pytest.mark.parametrize("n", [1, 2, 7, 64, 65])
def test_sglang_round_trip(n):
    generator = torch.Generator().manual_seed(n)
    trees = [random_parents(n, generator) for _ in range(3)]
    shuffled = [sglang_lists(t, lambda cs: cs[::-1]) for t in trees]  # SGLang lists siblings in any order
    first = torch.tensor([f for f, _ in shuffled], dtype=torch.int64)
    sibling = torch.tensor([s for _, s in shuffled], dtype=torch.int64)
    parents = sglang_to_parents(first, sibling)
    assert parents.dtype == torch.int32 and parents.tolist() == sum(trees, [])
    ours_first, ours_sibling = parents_to_sglang(parents, n)
    in_order = [sglang_lists(t, lambda cs: cs) for t in trees]
    assert ours_first.tolist() == [f for f, _ in in_order] and ours_sibling.tolist() == [s for _, s in in_order]


def test_sglang_bad_lists_named():
    first = torch.tensor([[1, 2, -1]])
    with pytest.raises(ValueError, match="exactly once"):
        sglang_to_parents(first, torch.tensor([[-1, 2, -1]]))  # node 2 reached as a child and as a sibling
    with pytest.raises(ValueError, match="topological"):
        sglang_to_parents(torch.tensor([[2, -1, 1]]), torch.tensor([[-1, -1, -1]]))  # node 1's parent is node 2
    with pytest.raises(TypeError, match="retrive_next_token"):
        sglang_to_parents(first.float(), first)
    with pytest.raises(ValueError, match=r"\[-1, 3\)"):
        sglang_to_parents(torch.tensor([[3, -1, -1]]), torch.tensor([[-1, -1, -1]]))


def flashinfer_brute_force(trees: list[list[int]], prefix_lens: list[int]) -> tuple[np.ndarray, list[int]]:
    """Each request's [n, prefix + n] bool matrix, flattened and packed with numpy (FlashInfer's stated semantics)."""
    segments, indptr = [], [0]
    for parents, prefix in zip(trees, prefix_lens):
        n = len(parents)
        full = np.zeros((n, prefix + n), dtype=bool)
        full[:, :prefix] = True
        for i, chain in enumerate(ancestors(parents)):
            full[i, [prefix + j for j in chain]] = True
        packed = np.packbits(full.reshape(-1), bitorder="little")
        segments.append(packed)
        indptr.append(indptr[-1] + packed.size)
    return np.concatenate(segments), indptr


@pytest.mark.parametrize("sizes", [[1], [3, 5, 2], [64, 1, 65, 9]])
def test_flashinfer_round_trip(sizes):
    generator = torch.Generator().manual_seed(len(sizes))
    trees = [random_parents(n, generator) for n in sizes]
    prefix_lens = [int(torch.randint(0, 20, (1,), generator=generator)) for _ in sizes]
    offsets = torch.tensor([0] + sizes, dtype=torch.int32).cumsum(0).to(torch.int32)
    rows = build_tree_metadata(torch.tensor(sum(trees, []), dtype=torch.int32), offsets).ancestor_mask
    packed, indptr = rows_to_flashinfer_mask(rows, offsets, torch.tensor(prefix_lens))
    expected, expected_indptr = flashinfer_brute_force(trees, prefix_lens)
    assert packed.dtype == torch.uint8 and np.array_equal(packed.numpy(), expected)
    assert indptr.tolist() == expected_indptr
    kv_lens = torch.tensor(prefix_lens) + torch.tensor(sizes)
    back = flashinfer_mask_to_rows(torch.from_numpy(expected), torch.tensor(expected_indptr), offsets, kv_lens)
    assert torch.equal(back, rows)


def test_flashinfer_mask_hiding_the_prefix_is_refused():
    packed, indptr = flashinfer_brute_force([[-1, 0]], [3])
    packed[0] &= 0b11111110  # node 0 no longer sees prefix token 0
    offsets = torch.tensor([0, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match="hides part of a prefix"):
        flashinfer_mask_to_rows(torch.from_numpy(packed), torch.tensor(indptr), offsets, torch.tensor([5]))
    with pytest.raises(TypeError, match="packed_mask"):
        flashinfer_mask_to_rows(torch.from_numpy(packed).int(), torch.tensor(indptr), offsets, torch.tensor([5]))
