"""The C++ CPU bodies of verify_chain_greedy and verify_tree_greedy (csrc/verify_greedy.cpp) against the PyTorch
bodies and the readable references: bad rows (NaN, +inf, all -inf), argmax ties, empty and ragged drafts, trees
with duplicate and out-of-vocabulary children, truncating widths, fp32/fp16/bf16/fp64 logits; the CPU dispatch
picks them, and without the extension the PyTorch bodies run."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from specdec import _backend
from specdec.kernels import ChainVerifyResult, TreeVerifyResult
from specdec.kernels.verify_greedy import (
    _chain_greedy_host,
    _chain_greedy_torch,
    _has_cpp_greedy,
    _tree_greedy_host,
    _tree_greedy_torch,
    verify_chain_greedy_reference,
    verify_tree_greedy_reference,
)

needs_cpp = pytest.mark.skipif(
    not _has_cpp_greedy(), reason=f"specdec._C without the greedy C++ bodies: {_backend.extension_status()[1]}"
)
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


def empty_result(batch: int, width: int) -> ChainVerifyResult:
    """Poisoned buffers, so a body that leaves an entry unwritten fails the comparison."""
    return ChainVerifyResult(
        torch.full((batch, width), 77, dtype=torch.int32),
        torch.full((batch,), 77, dtype=torch.int32),
        torch.ones(batch, dtype=torch.bool),
    )


def run_body(body, logits, tokens, offsets, width) -> ChainVerifyResult:
    out = empty_result(offsets.numel() - 1, width)
    body(logits, tokens, offsets, *out)
    return out


def cpp(logits, tokens, offsets, width) -> ChainVerifyResult:
    return run_body(torch.ops.specdec.verify_chain_greedy_cpu, logits, tokens, offsets, width)


def empty_tree_result(batch: int, width: int) -> TreeVerifyResult:
    tokens, accepted, invalid = empty_result(batch, width)
    return TreeVerifyResult(tokens, accepted, tokens.clone(), invalid)


def run_tree_body(body, logits, tokens, parents, offsets, width) -> TreeVerifyResult:
    out = empty_tree_result(offsets.numel() - 1, width)
    body(logits, tokens, parents, offsets, *out)
    return out


def assert_same(got, expected):
    for name, x, y in zip(type(got)._fields, got, expected):
        assert torch.equal(x, y.to(x.dtype)), f"{name} differs:\n{x}\n{y}"


def bad_rows_and_ties(logits: torch.Tensor, gen: torch.Generator) -> None:
    """A third of the rows made bad (NaN, +inf, no finite logit) or awkward (-inf beside finite logits, all tied)."""
    rows, vocab = logits.shape
    for row in torch.randperm(rows, generator=gen)[: rows // 3].tolist():
        kind = int(torch.randint(0, 5, (), generator=gen))
        col = int(torch.randint(0, vocab, (), generator=gen))
        if kind == 0:
            logits[row, col] = float("nan")
        elif kind == 1:
            logits[row, col] = float("inf")
        elif kind == 2:
            logits[row] = float("-inf")  # no finite logit
        elif kind == 3:
            logits[row, col] = float("-inf")  # a -inf beside finite logits is fine
        else:
            logits[row, :] = 1.0  # every entry ties: the first wins


def random_chains(gen: torch.Generator, dtype: torch.dtype, vocab: int):
    """Ragged chains (some empty) whose drafts often follow the argmax, with bad rows and argmax ties."""
    batch = int(torch.randint(1, 7, (), generator=gen))
    ks = torch.randint(0, 6, (batch,), generator=gen)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), ks.cumsum(0)]).to(torch.int32)
    rows = int(ks.sum()) + batch
    # Few distinct values in low precision, so rows often hold their maximum twice or more.
    logits = torch.randint(-4, 5, (rows, vocab), generator=gen).to(dtype)
    bad_rows_and_ties(logits, gen)
    argmax = logits.float().nan_to_num(nan=-1e9).argmax(-1).to(torch.int32)
    tokens = torch.randint(-1, vocab + 1, (int(ks.sum()),), generator=gen, dtype=torch.int32)
    for b in range(batch):
        lo, k = int(offsets[b]), int(ks[b])
        follow = torch.rand(k, generator=gen) < 0.8
        tokens[lo : lo + k] = torch.where(follow, argmax[lo + b : lo + b + k], tokens[lo : lo + k])
    return logits, tokens, offsets, int(ks.max())


@needs_cpp
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cpp_body_equals_the_pytorch_body_and_the_reference(dtype):
    gen = torch.Generator().manual_seed(17)
    for trial in range(60):
        vocab = [1, 3, 17, 40][trial % 4]
        logits, tokens, offsets, longest = random_chains(gen, dtype, vocab)
        for width in sorted({1, max(1, longest), longest + 1, longest + 2}):
            got = cpp(logits, tokens, offsets, width)
            assert_same(got, run_body(_chain_greedy_torch, logits, tokens, offsets, width))
            if width == longest + 1:  # the reference's width is the longest chain's
                assert_same(got, verify_chain_greedy_reference(logits, tokens, offsets, max_draft_len=longest))


def random_trees(gen: torch.Generator, dtype: torch.dtype, vocab: int):
    """Random trees (some a lone root) whose children often carry their parent's argmax, duplicates included."""
    sizes = torch.randint(1, 9, (int(torch.randint(1, 6, (), generator=gen)),), generator=gen).tolist()
    parents = [p for n in sizes for p in [-1] + [int(torch.randint(0, i, (), generator=gen)) for i in range(1, n)]]
    parents = torch.tensor(parents, dtype=torch.int32)
    offsets = torch.tensor([0, *sizes]).cumsum(0).to(torch.int32)
    logits = torch.randint(-4, 5, (parents.numel(), vocab), generator=gen).to(dtype)
    bad_rows_and_ties(logits, gen)
    argmax = logits.float().nan_to_num(nan=-1e9).argmax(-1).to(torch.int32)
    tokens = torch.randint(-1, vocab + 1, (parents.numel(),), generator=gen, dtype=torch.int32)
    start = offsets[:-1].long().repeat_interleave(torch.tensor(sizes))
    parent_argmax = argmax[(start + parents.long()).clamp(min=0)]
    tokens = torch.where(torch.rand(parents.numel(), generator=gen) < 0.7, parent_argmax, tokens)
    return logits, tokens, parents, offsets, max(sizes)


@needs_cpp
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cpp_tree_body_equals_the_pytorch_body_and_the_reference(dtype):
    gen = torch.Generator().manual_seed(29)
    for trial in range(60):
        vocab = [1, 3, 17, 40][trial % 4]
        logits, tokens, parents, offsets, largest = random_trees(gen, dtype, vocab)
        for width in sorted({1, 2, largest, largest + 1}):
            args = (logits, tokens, parents, offsets, width)
            got = run_tree_body(torch.ops.specdec.verify_tree_greedy_cpu, *args)
            assert_same(got, run_tree_body(_tree_greedy_torch, *args))
            expected = verify_tree_greedy_reference(logits, tokens, parents, offsets, max_depth=width - 1)
            assert_same(got, expected)


@needs_cpp
def test_cpp_tree_body_refuses_malformed_trees():
    logits, tokens, offsets = (
        torch.randn(3, 5),
        torch.zeros(3, dtype=torch.int32),
        torch.tensor([0, 3], dtype=torch.int32),
    )
    for parents, match in (([-1, 0, 2], r"parents\[2\] = 2"), ([0, 0, 1], "must be -1")):
        with pytest.raises(ValueError, match=match):
            run_tree_body(torch.ops.specdec.verify_tree_greedy_cpu, logits, tokens,
                          torch.tensor(parents, dtype=torch.int32), offsets, 2)  # fmt: skip
    with pytest.raises(ValueError, match="one per node"):
        run_tree_body(torch.ops.specdec.verify_tree_greedy_cpu, logits[:2], tokens,
                      torch.tensor([-1, 0, 1], dtype=torch.int32), offsets, 2)  # fmt: skip


@needs_cpp
def test_ties_take_the_first_maximum_and_bad_rows_invalidate_their_request_only():
    logits = torch.tensor(
        [[1.0, 5.0, 5.0], [0.0, 0.0, 0.0], [2.0, 1.0, 0.0],  # request 0: argmax 1, then 0 (a tie), then 0
         [0.0, float("nan"), 9.0], [1.0, 0.0, 0.0],  # request 1: a NaN in its first row
         [float("-inf")] * 3,  # request 2: no draft, no finite logit
         [float("-inf"), -1.0, -1.0]]  # request 3: -inf beside finite logits, a tie
    )  # fmt: skip
    tokens = torch.tensor([1, 0, 9], dtype=torch.int32)
    offsets = torch.tensor([0, 2, 3, 3, 3], dtype=torch.int32)
    got = cpp(logits, tokens, offsets, 3)
    assert got.output_tokens.tolist() == [[1, 0, 0], [-1, -1, -1], [-1, -1, -1], [1, -1, -1]]
    assert got.num_accepted.tolist() == [2, 0, 0, 0]
    assert got.invalid.tolist() == [False, True, True, False]
    assert_same(got, run_body(_chain_greedy_torch, logits, tokens, offsets, 3))


@needs_cpp
def test_empty_batches_drafts_and_strided_logits():
    assert_same(cpp(torch.randn(0, 5), torch.zeros(0, dtype=torch.int32), torch.zeros(1, dtype=torch.int32), 1),
                empty_result(0, 1))  # fmt: skip
    logits = torch.randn(3, 11)
    no_drafts = cpp(logits, torch.zeros(0, dtype=torch.int32), torch.zeros(4, dtype=torch.int32), 2)
    assert no_drafts.output_tokens[:, 0].tolist() == logits.argmax(-1).tolist()
    assert no_drafts.output_tokens[:, 1].tolist() == [-1] * 3 and no_drafts.num_accepted.tolist() == [0] * 3
    wide = torch.randn(4, 30)
    tokens, offsets = wide[:2, :13].argmax(-1).int(), torch.tensor([0, 2, 2], dtype=torch.int32)
    strided = cpp(wide[:, :13], tokens, offsets, 3)  # rows 30 apart
    assert_same(strided, cpp(wide[:, :13].contiguous(), tokens, offsets, 3))
    assert strided.num_accepted.tolist() == [2, 0]


@needs_cpp
def test_cpp_ops_pass_opcheck():
    """Schemas (the mutated outputs), fake implementations and dispatch agree, as for every registered op."""
    gen = torch.Generator().manual_seed(5)
    logits, tokens, offsets, longest = random_chains(gen, torch.float32, 17)
    outputs = empty_result(offsets.numel() - 1, longest + 1)
    torch.library.opcheck(torch.ops.specdec.verify_chain_greedy_cpu.default, (logits, tokens, offsets, *outputs))
    logits, tokens, parents, offsets, largest = random_trees(gen, torch.float32, 17)
    torch.library.opcheck(
        torch.ops.specdec.verify_tree_greedy_cpu.default,
        (logits, tokens, parents, offsets, *empty_tree_result(offsets.numel() - 1, largest)),
    )


@needs_cpp
def test_cpp_body_refuses_malformed_offsets_and_dtypes():
    logits, tokens = torch.randn(4, 5), torch.zeros(2, dtype=torch.int32)
    for offsets, match in (([1, 2, 2], "start at 0"), ([0, 3, 2], "must not decrease"), ([0, 1, 1], r"\[-1\]")):
        with pytest.raises(ValueError, match=match):
            cpp(logits, tokens, torch.tensor(offsets, dtype=torch.int32), 2)
    with pytest.raises(ValueError, match="T \\+ B"):
        cpp(logits[:3], tokens, torch.tensor([0, 1, 2], dtype=torch.int32), 2)
    with pytest.raises(TypeError, match="draft_tokens must have dtype int32"):
        cpp(logits, tokens.long(), torch.tensor([0, 1, 2], dtype=torch.int32), 2)


@needs_cpp
def test_the_cpu_dispatch_runs_the_cpp_body_unless_torch_is_forced(monkeypatch):
    import specdec.kernels.verify_greedy as verify_greedy

    calls = []
    monkeypatch.setattr(verify_greedy, "_chain_greedy_torch", lambda *args: calls.append("torch"))
    logits = torch.randn(3, 9)
    tokens, offsets = logits[:2].argmax(-1).int(), torch.tensor([0, 2], dtype=torch.int32)
    with _backend.use_backend("auto"):
        got = run_body(_chain_greedy_host, logits, tokens, offsets, 3)
    assert calls == [] and got.output_tokens[0].tolist() == logits.argmax(-1).tolist()
    with _backend.use_backend("torch"):
        run_body(_chain_greedy_host, logits, tokens, offsets, 3)
    assert calls == ["torch"]
    monkeypatch.setattr(verify_greedy, "_tree_greedy_torch", lambda *args: calls.append("tree torch"))
    parents = torch.tensor([-1, 0, 1], dtype=torch.int32)
    node_tokens = torch.cat([torch.zeros(1, dtype=torch.int32), tokens])
    with _backend.use_backend("auto"):
        tree = run_tree_body(
            _tree_greedy_host, logits, node_tokens, parents, torch.tensor([0, 3], dtype=torch.int32), 3
        )
    assert calls == ["torch"] and tree.accepted_path.tolist() == [[0, 1, 2]]
    with _backend.use_backend("torch"):
        run_tree_body(_tree_greedy_host, logits, node_tokens, parents, torch.tensor([0, 3], dtype=torch.int32), 3)
    assert calls == ["torch", "tree torch"]


def test_without_the_extension_the_pytorch_body_answers():
    code = textwrap.dedent(
        """
        import torch
        from specdec import _backend
        from specdec.kernels import verify_chain_greedy, verify_tree_greedy
        from specdec.kernels.verify_greedy import _has_cpp_greedy, verify_chain_greedy_reference
        from specdec.kernels.verify_greedy import verify_tree_greedy_reference
        assert _backend.extension_status()[0] is None and not _has_cpp_greedy()
        logits = torch.randn(7, 19)
        logits[6, 2] = float("nan")
        offsets = torch.tensor([0, 3, 3, 4], dtype=torch.int32)
        tokens = logits[[0, 1, 4, 5]].argmax(-1).int()
        tokens[1] = 18 - int(logits[1].argmax())
        got = verify_chain_greedy(logits, tokens, offsets, None, max_draft_len=3, check=False)
        ref = verify_chain_greedy_reference(logits, tokens, offsets, max_draft_len=3)
        assert all(torch.equal(a, b) for a, b in zip(got, ref)), (got, ref)
        assert got.invalid.tolist() == [False, False, True]
        parents = torch.tensor([-1, 0, 0, 1, -1, 0, -1], dtype=torch.int32)
        nodes = torch.tensor([0, 4, 6, 7], dtype=torch.int32)
        node_tokens = logits[[0, 0, 0, 1, 4, 4, 6]].argmax(-1).int()
        tree = verify_tree_greedy(logits, node_tokens, parents, nodes, None, max_depth=3, check=False)
        tree_ref = verify_tree_greedy_reference(logits, node_tokens, parents, nodes, max_depth=3)
        assert all(torch.equal(a, b) for a, b in zip(tree, tree_ref)), (tree, tree_ref)
        assert tree.accepted_path.tolist()[0][:2] == [0, 1] and tree.invalid.tolist() == [False, False, True]
        print("fallback ok")
        """
    )
    env = {**os.environ, "SPECDEC_DISABLE_EXTENSION": "1", "TRITON_INTERPRET": "0"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0 and "fallback ok" in result.stdout, result.stderr
