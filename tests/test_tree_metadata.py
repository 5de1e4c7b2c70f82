"""Tree metadata: the C++ op (CPU, and CUDA on a GPU) and the PyTorch body against an independent oracle."""

import pytest
import torch

from specdec import _backend
from specdec.kernels import build_tree_metadata, pack_mask_rows, unpack_mask_rows
from specdec.kernels.tree_metadata import tree_metadata_reference, tree_metadata_torch

HAS_EXT = _backend.extension_status()[0] is not None
needs_ext = pytest.mark.skipif(not HAS_EXT, reason=f"specdec._C unavailable: {_backend.extension_status()[1]}")


def random_tree(n: int, gen: torch.Generator) -> list[int]:
    return [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]


def chain(n: int) -> list[int]:
    return list(range(-1, n - 1))


def star(n: int) -> list[int]:
    return [-1] + [0] * (n - 1)


def batch_of(trees: list[list[int]], device="cpu"):
    parents = torch.tensor([p for t in trees for p in t], dtype=torch.int32, device=device)
    offsets = torch.tensor([0] + [len(t) for t in trees], dtype=torch.int32).cumsum(0).to(torch.int32)
    return parents, offsets.to(device)


def brute_force(trees: list[list[int]], max_nodes: int):
    """Independent oracle: walk every node to its root."""
    depth, rows = [], []
    for tree in trees:
        for i in range(len(tree)):
            path = []
            node = i
            while node >= 0:
                path.append(node)
                node = tree[node]
            depth.append(len(path) - 1)
            row = [False] * max_nodes
            for j in path:
                row[j] = True
            rows.append(row)
    return (
        torch.tensor(depth, dtype=torch.int32),
        pack_mask_rows(torch.tensor(rows, dtype=torch.bool).view(-1, max_nodes)),
    )


def shapes_batch(gen):
    return [
        random_tree(37, gen),
        chain(70),
        star(65),
        [-1],
        random_tree(300, gen),  # more than four 64-bit words per row
        chain(1),
        random_tree(129, gen),
    ]


def implementations():
    impls = [("reference", tree_metadata_reference), ("torch", tree_metadata_torch)]
    if HAS_EXT:
        impls.append(("cpp", lambda p, o, m: torch.ops.specdec.tree_metadata(p, o, m)))
    return impls


@pytest.mark.parametrize("name,impl", implementations(), ids=[n for n, _ in implementations()])
@pytest.mark.parametrize("kind", ["random", "chain", "star", "single", "mixed"], ids=lambda k: k)
def test_matches_brute_force(name, impl, kind):
    gen = torch.Generator().manual_seed(hash(kind) % 1000)
    trees = {
        "random": [random_tree(n, gen) for n in (5, 64, 65, 200)],
        "chain": [chain(n) for n in (2, 63, 64, 130)],
        "star": [star(n) for n in (2, 64, 257)],
        "single": [[-1]],
        "mixed": shapes_batch(gen),
    }[kind]
    max_nodes = max(len(t) for t in trees)
    parents, offsets = batch_of(trees)
    got = impl(parents, offsets, max_nodes)
    want = brute_force(trees, max_nodes)
    assert len(got) == 2
    for field, g, w in zip(("depth", "mask"), got, want):
        assert g.dtype == w.dtype, field
        assert torch.equal(g, w), f"{name} {kind}: {field} differs"


def test_implementations_agree_on_many_random_batches():
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        trees = [random_tree(int(torch.randint(1, 90, (1,), generator=gen)), gen) for _ in range(5)]
        parents, offsets = batch_of(trees)
        for width in (90, 256):
            ref = tree_metadata_reference(parents, offsets, width)
            for name, impl in implementations()[1:]:
                for a, b in zip(ref, impl(parents, offsets, width)):
                    assert torch.equal(a, b), name


def test_public_op_and_mask_round_trip():
    parents, offsets = batch_of([[-1, 0, 0, 1]])
    meta = build_tree_metadata(parents, offsets)
    assert meta.depth.tolist() == [0, 1, 1, 2]
    assert meta.ancestor_mask[:, 0].tolist() == [1, 3, 5, 11]
    bits = unpack_mask_rows(meta.ancestor_mask, 4)
    assert torch.equal(pack_mask_rows(bits), meta.ancestor_mask)


def test_bit_63_is_packed_as_the_sign_bit():
    parents, offsets = batch_of([chain(64)])
    mask = build_tree_metadata(parents, offsets).ancestor_mask
    assert mask[63, 0].item() == -1  # all 64 bits set
    assert mask[62, 0].item() == (1 << 63) - 1


@needs_ext
def test_opcheck():
    gen = torch.Generator().manual_seed(3)
    parents, offsets = batch_of([random_tree(20, gen), chain(7), [-1]])
    for check in (True, False):
        torch.library.opcheck(torch.ops.specdec.tree_metadata.default, (parents, offsets, 20, check))


@pytest.mark.parametrize("backend_name", ["torch", "auto"])
def test_output_shapes_come_from_sizes_alone(backend_name):
    # meta tensors have no values: with max_nodes given and no checks, nothing is read back
    parents = torch.empty(300, dtype=torch.int32, device="meta")
    offsets = torch.empty(9, dtype=torch.int32, device="meta")
    with _backend.use_backend(backend_name):
        meta = build_tree_metadata(parents, offsets, 130, check=False)
    assert meta.depth.shape == (300,) and meta.depth.dtype == torch.int32
    assert meta.ancestor_mask.shape == (300, 3) and meta.ancestor_mask.dtype == torch.int64


@pytest.mark.gpu
@needs_ext
def test_cuda_op_matches_cpu():
    if not _backend.extension_has_cuda():
        pytest.skip("extension built without CUDA")
    gen = torch.Generator().manual_seed(5)
    parents, offsets = batch_of(shapes_batch(gen))
    cpu = torch.ops.specdec.tree_metadata(parents, offsets, 300)
    cuda = torch.ops.specdec.tree_metadata(parents.cuda(), offsets.cuda(), 300)
    for a, b in zip(cpu, cuda):
        assert b.is_cuda and torch.equal(a, b.cpu())
    with pytest.raises(ValueError, match=r"parents\[1\] = 1 in tree 0 must lie in \[0, 1\)"):
        torch.ops.specdec.tree_metadata(*batch_of([[-1, 1]], "cuda"), 2)
    # unchecked: no read-back; a malformed parent ends its node's walk, bad offsets give depth -1, in bounds
    depth, mask = torch.ops.specdec.tree_metadata(*batch_of([[-1, 0, 5, 1]], "cuda"), 4, False)
    assert depth.tolist() == [0, 1, 0, 2] and mask[:, 0].tolist() == [1, 3, 4, 11]
    parents, offsets = batch_of([[-1, 0, 0]], "cuda")
    depth, _ = torch.ops.specdec.tree_metadata(parents, offsets + 2, 1, False)  # offsets [2, 5]: nodes 0, 1 unplaced
    assert depth.tolist()[:2] == [-1, -1]


BAD_INPUTS = [
    ("parent not smaller than child", [[-1, 1]], None, None, r"parents\[1\] = 1 .* \[0, 1\)"),
    ("parent below -1", [[-1, 0, -2]], None, None, r"parents\[2\] = -2"),
    ("root not -1", [[0, 0]], None, None, r"parents\[0\] .* must be -1"),
    ("offsets do not add up", [[-1, 0, 0]], [0, 2], None, r"offsets\[-1\] must equal"),
    ("offsets not starting at 0", [[-1, 0]], [1, 2], None, r"offsets must start at 0"),
    ("empty tree", [[-1], [-1]], [0, 1, 1, 2], None, r"tree 1 .* at least its root"),
    ("tree wider than max_nodes", [[-1, 0, 0]], None, 2, r"max_nodes"),
]


@pytest.mark.parametrize("why,trees,offsets,max_nodes,match", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
@pytest.mark.parametrize("backend_name", ["torch", "cpp"])
def test_malformed_input_is_refused(why, trees, offsets, max_nodes, match, backend_name):
    if backend_name == "cpp" and not HAS_EXT:
        pytest.skip(f"specdec._C unavailable: {_backend.extension_status()[1]}")
    parents, default_offsets = batch_of(trees)
    offsets = default_offsets if offsets is None else torch.tensor(offsets, dtype=torch.int32)
    width = max_nodes or max(len(t) for t in trees)
    with _backend.use_backend("torch" if backend_name == "torch" else "auto"):
        with pytest.raises(ValueError, match=match):
            build_tree_metadata(parents, offsets, width)


def test_wrong_dtypes_are_refused():
    parents, offsets = batch_of([[-1, 0]])
    with pytest.raises(TypeError, match="parents must have dtype int32"):
        build_tree_metadata(parents.long(), offsets)
    with pytest.raises(TypeError, match="offsets must have dtype int32"):
        build_tree_metadata(parents, offsets.long())
    with pytest.raises(ValueError, match="parents must have 1 dimensions"):
        build_tree_metadata(parents.view(1, 2), offsets)
    with pytest.raises(ValueError, match="max_nodes must be a positive int"):
        build_tree_metadata(parents, offsets, 0)
    # Without max_nodes the width comes from the offsets, which are checked first (not "max_nodes ... -1").
    with pytest.raises(ValueError, match="offsets must be non-decreasing"):
        build_tree_metadata(parents, torch.tensor([0, 3, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match="offsets must start at 0"):
        build_tree_metadata(parents[:0], torch.tensor([1, 0], dtype=torch.int32))


@needs_ext
def test_the_cpp_op_raises_the_packages_error_types():
    # called directly, without the Python wrapper's checks
    parents, offsets = batch_of([[-1, 0]])
    with pytest.raises(TypeError, match="parents must have dtype int32"):
        torch.ops.specdec.tree_metadata(parents.long(), offsets, 2)
    with pytest.raises(ValueError, match="max_nodes must be positive"):
        torch.ops.specdec.tree_metadata(parents, offsets, 0)
    with pytest.raises(ValueError, match=r"offsets\[-1\] must equal the number of parents"):
        torch.ops.specdec.tree_metadata(parents, offsets[:1], 2)


def test_docstring_example():
    import doctest
    import importlib

    module = importlib.import_module("specdec.kernels.tree_metadata")
    result = doctest.testmod(module, extraglobs={"torch": torch})
    assert result.attempted > 0 and result.failed == 0
