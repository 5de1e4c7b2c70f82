"""KV ops: append and accepted-path compaction (Triton and PyTorch bodies), bit for bit.

Caches are filled with random bit patterns (NaN payloads included), so a move that goes
through a float conversion, misses a row or writes a wrong one cannot pass. Expected
results come from a plain Python oracle that reads a snapshot taken before the op,
independent of both implementations. Past-capacity writes and bad paths: refused by the
checked op, dropped alike by both bodies when unchecked (testing.md items 17, 19, 25).
"""

import contextlib
import doctest
import importlib
import sys

import pytest
import torch
from kv_helpers import (
    assert_same_bits,
    make_cache_tensors,
    pad,
    programs_in_order,
    random_bits_,
    random_path,
    row,
    same_bits,
    slot,
)

from specdec import _backend
from specdec.kernels import kv_append, kv_compact
from specdec.kernels._triton import jit, tl
from specdec.kernels.kv_append import kv_append_op, kv_append_reference
from specdec.kernels.kv_compact import kv_compact_op, kv_compact_reference, slab_groups

interpreted = pytest.mark.skipif(
    not _backend.interpreter_enabled(), reason="reorders the programs of Triton's interpreter"
)


def dev(t, device):
    return None if t is None else t.to(device)


# ---- kv_append ----------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_append_matches_oracle(backend, device, layout, dtype):
    gen = torch.Generator().manual_seed(1)
    L, B, max_len, Hkv, D = 3, 4, 23, 3, 5  # odd sizes: rows of 15 elements, blocks of 4
    data, tables = make_cache_tensors(layout, L, B, max_len, Hkv, D, dtype, gen=gen)
    seq_lens = torch.tensor([0, 7, 3, 15], dtype=torch.int32)
    counts = [5, 0, 9, 8]  # request 1 sends nothing; request 3 fills its last slot
    offsets = torch.tensor([0] + counts, dtype=torch.int32).cumsum(0).to(torch.int32)
    T = sum(counts)
    fused = random_bits_(torch.empty(T, 3, Hkv, D, dtype=dtype))  # k, v as strided views of a fused QKV
    k, v = fused[:, 1], fused[:, 2]
    before = data.clone()
    data_d = data.to(device)
    kv_append(data_d, 1, k.to(device), v.to(device), dev(seq_lens, device), dev(offsets, device), dev(tables, device))
    expected = before.clone()
    t = 0
    for b in range(B):
        for i in range(counts[b]):
            i2, j2 = slot(expected, tables, b, int(seq_lens[b]) + i)
            expected[1, 0, i2, j2] = k[t]
            expected[1, 1, i2, j2] = v[t]
            t += 1
    assert_same_bits(data_d.cpu(), expected, f"{layout} append")


def test_append_reference_equals_kernel_path_on_random_batches(backend, device):
    gen = torch.Generator().manual_seed(2)
    for layout in ("contiguous", "paged"):
        data, tables = make_cache_tensors(layout, 2, 3, 17, 2, 8, torch.float32, gen=gen)
        seq_lens = torch.randint(0, 8, (3,), generator=gen, dtype=torch.int32)
        counts = torch.randint(0, 10, (3,), generator=gen)
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]).to(torch.int32)
        k = random_bits_(torch.empty(int(counts.sum()), 2, 8))
        v = random_bits_(torch.empty_like(k))
        expected = data.clone()
        kv_append_reference(expected, 0, k, v, seq_lens, offsets, tables)
        got = data.to(device)
        kv_append(got, 0, k.to(device), v.to(device), seq_lens.to(device), offsets.to(device),
                  None if tables is None else tables.to(device))  # fmt: skip
        assert_same_bits(got.cpu(), expected, layout)


# ---- kv_compact ---------------------------------------------------------------------------------


def compact_oracle(data, tables, seq_lens, paths):
    """Expected cache and lengths: position s+j gets the snapshot's row at s+path[j]."""
    expected = data.clone()
    for b, path in enumerate(paths):
        s = int(seq_lens[b])
        for j, node in enumerate(path):
            i, p = slot(expected, tables, b, s + j)
            expected[:, :, i, p] = row(data, tables, b, s + node)
    return expected, seq_lens + torch.tensor([len(p) for p in paths], dtype=torch.int32)


def run_compact(data, tables, seq_lens, path, device):
    data_d, lens_d = data.to(device), seq_lens.to(device)
    kv_compact(data_d, lens_d, path.to(device), None if tables is None else tables.to(device))
    return data_d.cpu(), lens_d.cpu()


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_compact_random_paths_mixed_batch(backend, device, layout, dtype):
    """Random tree paths, a chain, an empty path, a lone root: all layers, K and V, ragged prefixes."""
    gen = torch.Generator().manual_seed(3)
    L, B, max_len, Hkv, D = 3, 6, 30, 2, 6
    data, tables = make_cache_tensors(layout, L, B, max_len, Hkv, D, dtype, gen=gen)
    seq_lens = torch.tensor([0, 5, 3, 9, 13, 2], dtype=torch.int32)  # prefixes not aligned to blocks of 4
    paths = [
        random_path(gen, 12),
        [0, 1, 2, 3],  # a chain: nothing moves
        [],  # nothing accepted
        [0],
        [0, 2, 5, 6, 11],  # position s+2 is written (from s+5) and read (for s+1) in the same launch
        [0, 3, 4, 9, 15],  # crosses several block boundaries
    ]
    path = pad(paths, 12)
    expected, lens = compact_oracle(data, tables, seq_lens, paths)
    got, got_lens = run_compact(data, tables, seq_lens, path, device)
    assert_same_bits(got, expected, f"{layout} compact")
    assert got_lens.tolist() == lens.tolist()


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_compact_overlapping_moves(backend, device, layout):
    """Every destination is also a source of a later move: a read-after-write bug shows up here."""
    data, tables = make_cache_tensors(layout, 2, 2, 24, 1, 4, torch.float16)
    seq_lens = torch.tensor([1, 4], dtype=torch.int32)
    paths = [[0, 1, 3, 4, 6, 7, 9, 10], [0, 2, 3, 5, 6, 8, 9, 11]]  # dst j = src of an earlier/later entry
    expected, lens = compact_oracle(data, tables, seq_lens, paths)
    got, got_lens = run_compact(data, tables, seq_lens, pad(paths, 8), device)
    assert_same_bits(got, expected, "overlap")
    assert got_lens.tolist() == lens.tolist() == [9, 12]


def test_compact_chain_and_empty_paths_change_only_lengths(backend, device):
    data, tables = make_cache_tensors("paged", 2, 3, 20, 2, 4, torch.float32)
    seq_lens = torch.tensor([3, 0, 11], dtype=torch.int32)
    path = pad([[0, 1, 2, 3, 4], [], [0]], 6)
    got, got_lens = run_compact(data, tables, seq_lens, path, device)
    assert same_bits(got, data)
    assert got_lens.tolist() == [8, 0, 12]


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_rows_wider_than_one_tile(backend, device, layout):
    """Hkv * D = 1280 elements: the kernels split each token row over two programs (the second partial)."""
    gen = torch.Generator().manual_seed(13)
    data, tables = make_cache_tensors(layout, 1, 2, 12, 5, 256, torch.float16, gen=gen)
    seq_lens = torch.tensor([1, 3], dtype=torch.int32)
    k, v = random_bits_(torch.empty(2, 7, 5, 256, dtype=torch.float16))
    offsets = torch.tensor([0, 4, 7], dtype=torch.int32)
    expected = data.clone()
    kv_append_reference(expected, 0, k, v, seq_lens, offsets, tables)
    paths = [[0, 2, 3], [0, 2]]
    expected, lens = compact_oracle(expected, tables, seq_lens, paths)
    got, got_lens = dev(data, device), dev(seq_lens, device)
    kv_append(got, 0, dev(k, device), dev(v, device), got_lens, dev(offsets, device), dev(tables, device))
    kv_compact(got, got_lens, dev(pad(paths, 3), device), dev(tables, device))
    assert_same_bits(got.cpu(), expected, layout)
    assert got_lens.cpu().tolist() == lens.tolist() == [4, 5]


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_compact_llama_shape_on_gpu(layout):
    """The benchmark's shape compiled: 32 layers, 64 requests, 8 KV heads of 128, bf16, 64-node trees."""
    gen = torch.Generator().manual_seed(14)
    data, tables = make_cache_tensors(layout, 32, 64, 192, 8, 128, torch.bfloat16, page=16, gen=gen)
    seq_lens = torch.randint(0, 128, (64,), generator=gen, dtype=torch.int32)
    paths = [random_path(gen, 64)[:8] for _ in range(64)]
    expected, lens = data.clone(), seq_lens.clone()
    kv_compact_reference(expected, lens, pad(paths, 8), tables)
    got, got_lens = data.cuda(), seq_lens.cuda()
    kv_compact(got, got_lens, pad(paths, 8).cuda(), None if tables is None else tables.cuda())
    assert_same_bits(got.cpu(), expected, layout)
    assert torch.equal(got_lens.cpu(), lens)


# ---- the compaction's programs: any order, any split of the slabs ------------------------------------


@jit
def shift_left_kernel(x_ptr):
    """Program i copies x[i + 1] to x[i]: it reads what program i + 1 writes (a race on a GPU)."""
    i = tl.program_id(0)
    tl.store(x_ptr + i, tl.load(x_ptr + i + 1))


@interpreted
def test_program_order_hook_exposes_a_read_of_another_programs_write():
    """The control for the tests below: reordering the programs changes a racy kernel's result."""
    results = {}
    for order in ("grid", "reverse", 3):
        x = torch.arange(9, dtype=torch.int32)
        with programs_in_order(order) if order != "grid" else contextlib.nullcontext():
            shift_left_kernel[(8,)](x)
        results[order] = x.tolist()
    assert results["grid"] == [1, 2, 3, 4, 5, 6, 7, 8, 8]  # one after another, in grid order: a clean shift
    assert results["reverse"] == [8] * 9
    assert results[3] != results["grid"]


def test_slab_groups_split_large_batches_only():
    """Every slab its own program until the launch fills the GPU; past that, several slabs per program."""
    assert slab_groups(1, 64, 1) == slab_groups(8, 64, 1) == 64  # small batches keep one slab per program
    assert slab_groups(64, 64, 1) == 8  # LLaMA-3-8B at batch 64: 8 slabs per program, 512 programs
    assert slab_groups(64, 64, 2) == 4 and slab_groups(64, 160, 1) == 8
    assert slab_groups(4096, 2, 1) == 1  # never fewer than one program per request and chunk


@interpreted
@pytest.mark.parametrize("order", ["grid", "reverse", 7])
@pytest.mark.parametrize("fill", [1, 12, 512])  # slabs per program: all 10 / 4, 3 or 3 (uneven) / 1
@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_compact_in_any_program_order_and_slab_split(monkeypatch, layout, fill, order):
    """The kernel's result depends neither on the order its programs run nor on how slabs are shared out."""
    monkeypatch.setattr(sys.modules["specdec.kernels.kv_compact"], "FILL_PROGRAMS", fill)
    gen = torch.Generator().manual_seed(15)
    L, B, max_len, Hkv, D = 5, 5, 30, 2, 6
    data, tables = make_cache_tensors(layout, L, B, max_len, Hkv, D, torch.float16, gen=gen)
    seq_lens = torch.tensor([0, 5, 3, 13, 2], dtype=torch.int32)
    paths = [
        random_path(gen, 12),
        [0, 1, 2, 3],  # a chain: nothing moves
        [],  # nothing accepted
        [0, 2, 5, 6, 11],  # overlapping: position s+2 is written (from s+5) and read (for s+1)
        [0, 3, 4, 9, 15],  # crosses several block boundaries
    ]
    expected, lens = compact_oracle(data, tables, seq_lens, paths)
    tickets = torch.zeros(B, dtype=torch.int32)
    with programs_in_order(order) if order != "grid" else contextlib.nullcontext():
        kv_compact_op.body("triton")(data, seq_lens, pad(paths, 12), tables, tickets)
    assert_same_bits(data, expected, f"{layout} compact, FILL_PROGRAMS={fill}, {order} order")
    assert seq_lens.tolist() == lens.tolist() and tickets.tolist() == [0] * B


@interpreted
@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_compact_wide_rows_with_every_slab_in_one_program(monkeypatch, layout):
    """Rows of two chunks, all slabs of a request in one program per chunk, programs in reverse."""
    monkeypatch.setattr(sys.modules["specdec.kernels.kv_compact"], "FILL_PROGRAMS", 1)
    gen = torch.Generator().manual_seed(16)
    data, tables = make_cache_tensors(layout, 3, 2, 12, 5, 256, torch.float16, gen=gen)
    seq_lens = torch.tensor([1, 3], dtype=torch.int32)
    paths = [[0, 2, 3, 7], [0, 5]]
    expected, lens = compact_oracle(data, tables, seq_lens, paths)
    with programs_in_order("reverse"):
        kv_compact_op.body("triton")(data, seq_lens, pad(paths, 4), tables, torch.zeros(2, dtype=torch.int32))
    assert_same_bits(data, expected, layout)
    assert seq_lens.tolist() == lens.tolist()


def test_compact_reference_matches_oracle():
    gen = torch.Generator().manual_seed(4)
    for layout in ("contiguous", "paged"):
        data, tables = make_cache_tensors(layout, 2, 5, 40, 2, 3, torch.float32, gen=gen)
        seq_lens = torch.randint(0, 20, (5,), generator=gen, dtype=torch.int32)
        paths = [random_path(gen, 16) for _ in range(5)]
        expected, lens = compact_oracle(data, tables, seq_lens, paths)
        got, got_lens = data.clone(), seq_lens.clone()
        kv_compact_reference(got, got_lens, pad(paths, 16), tables)
        assert_same_bits(got, expected, layout)
        assert torch.equal(got_lens, lens)


def test_compact_repeated_calls_reuse_tickets(backend, device):
    """The Triton kernel's per-request tickets are left zero, so back-to-back calls keep working."""
    gen = torch.Generator().manual_seed(5)
    data, tables = make_cache_tensors("contiguous", 2, 3, 64, 1, 2, torch.float32, gen=gen)
    seq_lens = torch.zeros(3, dtype=torch.int32)
    tickets = torch.zeros(3, dtype=torch.int32, device=device)
    data_d, lens_d = data.to(device), seq_lens.to(device)
    for _ in range(4):
        paths = [random_path(gen, 6) for _ in range(3)]
        data, seq_lens = compact_oracle(data, None, seq_lens, paths)
        kv_compact(data_d, lens_d, pad(paths, 6).to(device), tickets=tickets)
        assert_same_bits(data_d.cpu(), data, "step")
        assert lens_d.cpu().tolist() == seq_lens.tolist()
    assert tickets.cpu().tolist() == [0, 0, 0]


# ---- capacity, bad block ids and bad paths: checked ops refuse, unchecked bodies drop alike -------


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_append_past_capacity_is_refused_naming_the_request_and_position(layout):
    data, tables = make_cache_tensors(layout, 1, 2, 8, 1, 4, torch.float32)
    before = data.clone()
    k = random_bits_(torch.empty(5, 1, 4))
    offsets = torch.tensor([0, 2, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"request 1 would write position 8 \(6 cached \+ 3 new\), past its capacity"):
        kv_append(data, 0, k, k, torch.tensor([3, 6], dtype=torch.int32), offsets, tables)
    assert same_bits(data, before)
    kv_append(data, 0, k, k, torch.tensor([3, 5], dtype=torch.int32), offsets, tables)  # up to the last slot


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_unchecked_append_past_capacity_drops_the_token_on_both_paths(backend, device, layout):
    # the checks are off (as on a GPU hot path): request 1's last token would land at position 8 of 8
    data, tables = make_cache_tensors(layout, 2, 2, 8, 1, 4, torch.float16)
    k, v = random_bits_(torch.empty(2, 5, 1, 4, dtype=torch.float16))
    seq_lens = torch.tensor([3, 6], dtype=torch.int32)
    offsets = torch.tensor([0, 2, 5], dtype=torch.int32)
    expected = data.clone()
    for t, (b, pos) in enumerate([(0, 3), (0, 4), (1, 6), (1, 7)]):
        i, j = slot(expected, tables, b, pos)
        expected[1, 0, i, j], expected[1, 1, i, j] = k[t], v[t]
    got = data.to(device)
    kv_append(got, 1, dev(k, device), dev(v, device), dev(seq_lens, device), dev(offsets, device),
              dev(tables, device), check_bounds=False)  # fmt: skip
    assert_same_bits(got.cpu(), expected, "past capacity")


def test_append_onto_a_block_id_outside_the_pool(backend, device):
    data, tables = make_cache_tensors("paged", 1, 2, 8, 1, 4, torch.float32)
    tables[1, 1] = data.shape[2]  # one past the last block
    k = random_bits_(torch.empty(3, 1, 4))
    seq_lens, offsets = torch.tensor([0, 3], dtype=torch.int32), torch.tensor([0, 1, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"block_tables row 1 holds block ids outside \[0, 7\)"):
        kv_append(data, 0, k, k, seq_lens, offsets, tables)
    expected = data.clone()
    for t, b, pos in [(0, 0, 0), (1, 1, 3)]:  # token 2 (request 1, position 4) lies on the bad block: dropped
        i, j = slot(expected, tables, b, pos)
        expected[0, 0, i, j] = expected[0, 1, i, j] = k[t]
    got = data.to(device)
    kv_append(got, 0, dev(k, device), dev(k, device), dev(seq_lens, device), dev(offsets, device),
              dev(tables, device), check_bounds=False)  # fmt: skip
    assert_same_bits(got.cpu(), expected, "bad block id")


def test_compact_refuses_a_path_that_does_not_start_at_the_root():
    data, _ = make_cache_tensors("contiguous", 1, 2, 8, 1, 2, torch.float32)
    before, seq_lens = data.clone(), torch.tensor([1, 0], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"accepted_path\[1\] = \[1, 2\] must start at the root, node 0"):
        kv_compact(data, seq_lens, torch.tensor([[0, 1], [1, 2]], dtype=torch.int32))
    assert same_bits(data, before) and seq_lens.tolist() == [1, 0]


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_unchecked_compact_skips_moves_outside_the_capacity_on_both_paths(backend, device, layout):
    # request 0: node 4 would come from position 9 of 8 (skipped); request 1: a negative length skips all
    data, tables = make_cache_tensors(layout, 2, 2, 8, 1, 2, torch.float32)
    seq_lens = torch.tensor([5, -3], dtype=torch.int32)
    path = torch.tensor([[0, 2, 4], [0, 1, 2]], dtype=torch.int32)
    expected = data.clone()
    expected[:, :, slot(data, tables, 0, 6)[0], slot(data, tables, 0, 6)[1]] = row(data, tables, 0, 7)
    got, lens = data.to(device), seq_lens.to(device)
    kv_compact(got, lens, path.to(device), dev(tables, device), check_bounds=False)
    assert_same_bits(got.cpu(), expected, "out-of-capacity moves")
    assert lens.cpu().tolist() == [8, 0]


def test_no_tokens_and_no_path_columns_are_no_ops(backend, device):
    data, tables = make_cache_tensors("paged", 1, 2, 8, 1, 4, torch.float32)
    before = data.clone()
    empty = torch.empty(0, 1, 4, device=device)
    seq_lens = torch.tensor([2, 5], dtype=torch.int32, device=device)
    data_d, tables_d = data.to(device), tables.to(device)
    kv_append(data_d, 0, empty, empty, seq_lens, torch.zeros(3, dtype=torch.int32, device=device), tables_d)
    kv_compact(data_d, seq_lens, torch.empty(2, 0, dtype=torch.int32, device=device), tables_d)
    assert same_bits(data_d.cpu(), before) and seq_lens.cpu().tolist() == [2, 5]


# ---- the registered ops ------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_registered_ops_pass_opcheck(backend, device, layout):
    data, tables = make_cache_tensors(layout, 2, 3, 12, 2, 4, torch.float32)
    data = torch.randn_like(data)  # opcheck compares runs with allclose: no NaN payloads here
    data, tables = data.to(device), dev(tables, device)
    k = torch.randn(5, 2, 4, device=device)
    seq_lens = torch.tensor([1, 4, 0], dtype=torch.int32, device=device)
    offsets = torch.tensor([0, 2, 2, 5], dtype=torch.int32, device=device)
    torch.library.opcheck(torch.ops.specdec.kv_append.default, (data, 1, k, k, seq_lens, offsets, tables))
    path = torch.tensor([[0, 1, -1], [-1, -1, -1], [0, 2, 3]], dtype=torch.int32, device=device)
    tickets = torch.zeros(3, dtype=torch.int32, device=device)
    torch.library.opcheck(torch.ops.specdec.kv_compact.default, (data, seq_lens, path, tables, tickets))
    assert kv_append_op.name == "kv_append" and kv_compact_op.name == "kv_compact"


def test_docstring_examples():
    # (the package re-exports each function under its module's name, so fetch the modules themselves)
    for module in map(importlib.import_module, ("specdec.kernels.kv_append", "specdec.kernels.kv_compact")):
        result = doctest.testmod(module, extraglobs={"torch": torch})
        assert result.attempted > 0 and result.failed == 0, module.__name__


# ---- bad input ----------------------------------------------------------------------------------


def test_bad_op_inputs():
    data = torch.zeros(2, 2, 3, 8, 1, 4)
    seq_lens = torch.zeros(3, dtype=torch.int32)
    offsets = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    k = torch.zeros(3, 1, 4)
    with pytest.raises(TypeError, match="data must have dtype"):
        kv_append(data.long(), 0, k, k, seq_lens, offsets)
    with pytest.raises(ValueError, match=r"data must have shape \[L, 2"):
        kv_append(torch.zeros(2, 3, 3, 8, 1, 4), 0, k, k, seq_lens, offsets)
    with pytest.raises(ValueError, match="layer must be an int in"):
        kv_append(data, 2, k, k, seq_lens, offsets)
    with pytest.raises(TypeError, match="k must have dtype float32"):
        kv_append(data, 0, k.half(), k, seq_lens, offsets)
    with pytest.raises(ValueError, match="v must have shape"):
        kv_append(data, 0, k, k[:, :, :3], seq_lens, offsets)
    with pytest.raises(ValueError, match="k must have a contiguous last dim"):
        kv_append(data, 0, torch.zeros(3, 1, 8)[:, :, ::2], k, seq_lens, offsets)
    with pytest.raises(TypeError, match="q_offsets must have dtype int32"):
        kv_append(data, 0, k, k, seq_lens, offsets.long())
    with pytest.raises(ValueError, match=r"q_offsets\[-1\] must equal the number of rows \(3\)"):
        kv_append(data, 0, k, k, seq_lens, torch.tensor([0, 1, 2, 2], dtype=torch.int32))
    with pytest.raises(TypeError, match="seq_lens must have dtype int32"):
        kv_append(data, 0, k, k, seq_lens.long(), offsets)
    with pytest.raises(ValueError, match="seq_lens is empty"):
        kv_compact(data, seq_lens[:0], torch.zeros(0, 1, dtype=torch.int32))
    with pytest.raises(TypeError, match="block_tables must have dtype int32"):
        kv_compact(data, seq_lens, torch.zeros(3, 1, dtype=torch.int32), torch.zeros(3, 2))
    with pytest.raises(ValueError, match="seq_lens has 3 requests but block_tables has 2 rows"):
        kv_compact(data, seq_lens, torch.zeros(3, 1, dtype=torch.int32), torch.zeros(2, 2, dtype=torch.int32))
    with pytest.raises(TypeError, match="accepted_path must have dtype int32"):
        kv_compact(data, seq_lens, torch.zeros(3, 1))
    with pytest.raises(ValueError, match=r"accepted_path must have shape \(3, '\*'\)"):
        kv_compact(data, seq_lens, torch.zeros(2, 1, dtype=torch.int32))
    bad_paths = {
        r"accepted_path\[1\] = \[0, 2, 2\] must be strictly increasing": [[0, 1, -1], [0, 2, 2], [-1, -1, -1]],
        r"accepted_path\[0\] = \[0, -1, 3\]: only -1 may follow": [[0, -1, 3], [0, 1, 2], [-1, -1, -1]],
        r"accepted_path\[2\] reaches position 8, past the capacity of 8": [[0, 1, -1], [0, 1, 2], [0, 8, -1]],
    }
    for message, rows in bad_paths.items():
        with pytest.raises(ValueError, match=message):
            kv_compact(data, seq_lens, torch.tensor(rows, dtype=torch.int32))


@pytest.mark.gpu
def test_compact_offsets_past_int32_on_gpu():
    """A paged cache of more than 2^31 elements: the last block of the last slab moves correctly."""
    L, page, Hkv, D = 2, 16, 8, 128
    num_blocks = (1 << 31) // (L * 2 * page * Hkv * D) + 8
    data = torch.empty(L, 2, num_blocks, page, Hkv, D, dtype=torch.float16, device="cuda")
    assert data.numel() > 1 << 31
    tables = torch.tensor([[num_blocks - 2, num_blocks - 1]], dtype=torch.int32, device="cuda")
    data[:, :, num_blocks - 2 :].view(torch.int16).random_()
    data[:, :, num_blocks - 1 :].view(torch.int16).random_()
    seq_lens = torch.tensor([10], dtype=torch.int32, device="cuda")
    path = torch.tensor([[0, 9, 21]], dtype=torch.int32, device="cuda")
    tail = data[:, :, num_blocks - 2 :].clone()
    kv_compact(data, seq_lens, path, tables)
    flat = tail.flatten(2, 3)  # positions 0..31 of the request
    expected = flat.clone()
    expected[:, :, 11] = flat[:, :, 19]
    expected[:, :, 12] = flat[:, :, 31]
    assert same_bits(data[:, :, num_blocks - 2 :].flatten(2, 3), expected)
    assert seq_lens.tolist() == [13]


def test_public_ops_compile_to_the_registered_ops(backend, device):
    seen = []

    def record(gm, example_inputs):
        seen.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    data, _ = make_cache_tensors("contiguous", 1, 2, 8, 1, 4, torch.float32)
    data = torch.randn_like(data).to(device)
    k = torch.randn(3, 1, 4, device=device)
    seq_lens = torch.tensor([1, 2], dtype=torch.int32, device=device)
    offsets = torch.tensor([0, 2, 3], dtype=torch.int32, device=device)
    path = torch.tensor([[0, 2], [0, -1]], dtype=torch.int32, device=device)
    tickets = torch.zeros(2, dtype=torch.int32, device=device)
    expected, expected_lens = data.clone(), seq_lens.clone()
    kv_append_reference(expected, 0, k, k, expected_lens, offsets)
    kv_compact_reference(expected, expected_lens, path)

    def step(data, k, seq_lens):
        kv_append(data, 0, k, k, seq_lens, offsets, check_bounds=False)
        kv_compact(data, seq_lens, path, tickets=tickets, check_bounds=False)

    torch.compile(step, backend=record, fullgraph=True)(data, k, seq_lens)
    assert [s for s in seen if s.startswith("specdec.")] == ["specdec.kv_append.default", "specdec.kv_compact.default"]
    assert_same_bits(data.cpu(), expected.cpu(), "compiled")
    assert seq_lens.cpu().tolist() == expected_lens.cpu().tolist() == [3, 3]
