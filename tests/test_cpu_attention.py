"""Tree attention's padded batch on the CPU through the extension's kernel (``specdec.kernels.cpu_attention``,
``csrc/padded_attention_cpu.cpp``): the op against float64, the switch in ``tree_attention_torch`` and where it
stays on SDPA, the generic version, threads, bad arguments, and the embedded pair's greedy tokens."""

import math

import pytest
import torch
from helpers import assert_close, generic_version_runs, run_bench, table_rows

from specdec import use_backend
from specdec.kernels import build_tree_metadata, cpu_attention, plan_attention, tree_attention
from specdec.kernels.tree_attention_torch import tree_attention_reference

needs_kernel = pytest.mark.skipif(not cpu_attention.available(), reason="the extension (padded_attention) is not built")
uses_kernel = pytest.mark.skipif(
    not (cpu_attention.available() and cpu_attention.vector_cpu()), reason="tree attention uses the kernel on AVX2 CPUs"
)
ATOL, RTOL = 2e-5, 2e-5  # float32 against float64: a softmax-weighted mean of values ~1


def padded_reference(q, k_cache, v_cache, attn_bias, scale):
    """float64 ``out [B * n, Hq, D]`` of the op: a plain softmax over ``scale q.k + bias`` per row."""
    batch, _, n, length = attn_bias.shape
    heads, head_dim = q.shape[1], q.shape[2]
    group = heads // k_cache.shape[2]
    qb = q.double().view(batch, n, heads, head_dim).transpose(1, 2)  # [B, Hq, n, D]
    k = k_cache[:batch, :length].double().repeat_interleave(group, 2).transpose(1, 2)  # [B, Hq, L, D]
    v = v_cache[:batch, :length].double().repeat_interleave(group, 2).transpose(1, 2)
    scores = qb @ k.transpose(-1, -2) * scale + attn_bias.double()
    weights = torch.softmax(scores, -1).nan_to_num(0.0)  # a row that sees nothing: 0
    return (weights @ v).transpose(1, 2).reshape(batch * n, heads, head_dim)


def causal_bias(contexts, n, length, gen=None):
    """[B, 1, n, L]: query i of request b (context c_b) sees positions up to c_b - n + i; with ``gen`` the visible
    scores also get random finite offsets (the op adds any bias, not only 0)."""
    pos, i = torch.arange(length), torch.arange(n)
    last = torch.tensor(contexts)[:, None] - n + i  # [B, n]
    visible = pos <= last[:, :, None]
    bias = torch.zeros(len(contexts), 1, n, length)
    if gen is not None:
        bias.normal_(generator=gen)
    return bias.masked_fill_(~visible[:, None], -math.inf)


def operands(batch, n, heads, kv_heads, head_dim, contexts, gen, spare_rows=1, spare_len=5):
    """q as a slice of a fused qkv (strided rows), caches with spare rows and positions (NaN past every request's
    context: the kernel must never read them), out poisoned with NaN."""
    length = max(contexts)
    qkv = torch.randn(batch * n, (heads + 2 * kv_heads) * head_dim, generator=gen)
    q = qkv[:, : heads * head_dim].view(batch * n, heads, head_dim)
    shape = (batch + spare_rows, length + spare_len, kv_heads, head_dim)
    k_cache, v_cache = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    for b, context in enumerate(contexts):
        k_cache[b, context:] = math.nan
        v_cache[b, context:] = math.nan
    out = torch.full((batch * n, heads, head_dim), math.nan)
    return q, k_cache, v_cache, out


@needs_kernel
@pytest.mark.parametrize("batch, n", [(1, 1), (6, 1), (1, 6), (3, 4)])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 4), (8, 2), (4, 1)])
@pytest.mark.parametrize("head_dim", [32, 64, 128, 20])
def test_op_equals_float64(batch, n, heads, kv_heads, head_dim):
    """Decode (n = 1) and chains (causal n x n blocks), ragged contexts in one batch (masked tails of NaN), GQA
    groups 1 / 2 / 4 / 4, head dims on the 8-wide vector path and one off it (20), a random finite bias."""
    gen = torch.Generator().manual_seed(batch * 1000 + n * 100 + heads * 10 + head_dim)
    contexts = [n + int(torch.randint(0, 90, (1,), generator=gen)) for _ in range(batch)]
    contexts[0] = n + 97  # L not a multiple of 8
    q, k_cache, v_cache, out = operands(batch, n, heads, kv_heads, head_dim, contexts, gen)
    bias = causal_bias(contexts, n, max(contexts), gen)
    scale = head_dim**-0.5
    cpu_attention.padded_attention(q, k_cache, v_cache, bias, scale, out)
    expected = padded_reference(q, k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0), bias, scale)
    assert_close(out, expected, ATOL, RTOL, f"B={batch} n={n} Hq={heads} Hkv={kv_heads} D={head_dim}")


@needs_kernel
@pytest.mark.parametrize("batch, n, heads, kv_heads", [(2, 20, 8, 4), (2, 3, 128, 1), (1, 2, 96, 1)])
def test_many_rows_per_request(batch, n, heads, kv_heads):
    """More query rows per request than one work item takes (64): slots split into chunks, and a group of more
    than 64 query heads on one KV head taken whole."""
    gen = torch.Generator().manual_seed(n * heads)
    contexts = [n + 41, n + 3][:batch]
    q, k_cache, v_cache, out = operands(batch, n, heads, kv_heads, 16, contexts, gen)
    bias = causal_bias(contexts, n, max(contexts), gen)
    cpu_attention.padded_attention(q, k_cache, v_cache, bias, 0.2, out)
    expected = padded_reference(q, k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0), bias, 0.2)
    assert_close(out, expected, ATOL, RTOL, f"n={n} Hq={heads} Hkv={kv_heads}")


@needs_kernel
def test_tree_masks_skip_hidden_positions_and_empty_rows_get_zero():
    """Positions hidden from every query of a request (NaN there) are never read, however they interleave with
    visible ones; positions hidden from some queries only weigh 0 for them; a row that sees nothing gets 0."""
    gen = torch.Generator().manual_seed(7)
    batch, n, heads, kv_heads, head_dim, length = 2, 5, 8, 2, 32, 70
    q, k_cache, v_cache, out = operands(batch, n, heads, kv_heads, head_dim, [length, length], gen)
    visible = torch.rand(batch, n, length, generator=gen) < 0.4
    visible[0, 2] = False  # request 0, query 2 sees nothing
    unseen = ~visible.any(1)  # [B, L]: hidden from every query
    k_cache[:batch, :length][unseen] = math.nan
    v_cache[:batch, :length][unseen] = math.nan
    bias = torch.zeros(batch, 1, n, length).masked_fill_(~visible[:, None], -math.inf)
    cpu_attention.padded_attention(q, k_cache, v_cache, bias, 0.3, out)
    expected = padded_reference(q, k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0), bias, 0.3)
    assert_close(out, expected, ATOL, RTOL, "tree masks")
    assert torch.equal(out.view(batch, n, heads, head_dim)[0, 2], torch.zeros(heads, head_dim))


@needs_kernel
@pytest.mark.parametrize("live", [[20, 7, 0], [1, 20, 13], [0, 0, 2]])
def test_padded_query_slots_that_see_nothing_get_zero_and_the_rows_before_them_their_values(live):
    """A ragged step pads each request's queries to n slots; its padded slots see nothing and the kernel passes them
    by. Rows before a request's last seeing slot, a middle one that sees nothing included, keep their values; work
    items of several slots (n = 20 splits) agree with one pass."""
    gen = torch.Generator().manual_seed(11)
    batch, n, heads, kv_heads, head_dim, length = 3, 20, 8, 2, 32, 40
    q, k_cache, v_cache, out = operands(batch, n, heads, kv_heads, head_dim, [length] * batch, gen)
    visible = torch.rand(batch, n, length, generator=gen) < 0.5
    visible[:, :, 0] = True
    visible &= (torch.arange(n)[None, :] < torch.tensor(live)[:, None])[:, :, None]
    visible[1, 3] = False  # a middle slot that sees nothing: not padding
    bias = torch.zeros(batch, 1, n, length).masked_fill_(~visible[:, None], -math.inf)
    cpu_attention.padded_attention(q, k_cache, v_cache, bias, 0.3, out)
    assert_close(out, padded_reference(q, k_cache, v_cache, bias, 0.3), ATOL, RTOL, "padded slots")
    rows = out.view(batch, n, heads, head_dim)
    for b, count in enumerate(live):
        assert torch.equal(rows[b, count:], torch.zeros(n - count, heads, head_dim))


def _plan(prefixes, n, cache, *, tree_mask=None, finite=True):
    batch = len(prefixes)
    return plan_attention(
        torch.arange(0, batch * n + 1, n, dtype=torch.int32), torch.tensor(prefixes, dtype=torch.int32),
        num_tokens=batch * n, num_heads=8, cache_shape=tuple(cache.shape), dtype=cache.dtype, tree_mask=tree_mask,
        causal=tree_mask is None, uniform_queries=True, finite_cache=finite,
    )  # fmt: skip


@pytest.fixture
def cpu_default(monkeypatch):
    """A CPU user's default path: no Triton interpreter, so the plan takes the PyTorch body."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")


@pytest.fixture
def kernel_calls(monkeypatch):
    calls = []
    real = cpu_attention.padded_attention
    monkeypatch.setattr(cpu_attention, "padded_attention", lambda *args: calls.append(args[0].shape) or real(*args))
    return calls


@uses_kernel
@pytest.mark.parametrize("tree", [None, [-1, 0, 0, 1, 2, 2], [-1, 0, 1, 2, 3, 4]])
def test_tree_attention_takes_the_kernel_for_views(cpu_default, kernel_calls, tree):
    """The model's layout (uniform query counts, a contiguous finite cache) on float32 CPU tensors runs the kernel:
    ragged prefixes, causal, tree and chain masks, against the float64 oracle."""
    gen = torch.Generator().manual_seed(3)
    prefixes, n = [40, 17, 63], 6
    cache_shape = (4, 80, 4, 32)
    k_cache, v_cache = torch.randn(cache_shape, generator=gen), torch.randn(cache_shape, generator=gen)
    q = torch.randn(len(prefixes) * n, 8, 32, generator=gen)
    mask = None
    if tree is not None:
        parents = torch.tensor(tree * len(prefixes), dtype=torch.int32)
        offsets = torch.arange(0, len(prefixes) * n + 1, n, dtype=torch.int32)
        mask = build_tree_metadata(parents, offsets).ancestor_mask
    plan = _plan(prefixes, n, k_cache, tree_mask=mask)
    assert plan.backend == "torch" and plan.query_rows is None and plan.kv_rows is None
    out = tree_attention(q, k_cache, v_cache, plan=plan, out=torch.full_like(q, math.nan), check=False)
    assert kernel_calls == [q.shape]
    offsets = torch.arange(0, len(prefixes) * n + 1, n, dtype=torch.int32)
    expected, _ = tree_attention_reference(q, k_cache, v_cache, offsets, torch.tensor(prefixes, dtype=torch.int32),
                                           mask, None, 32**-0.5)  # fmt: skip
    assert_close(out, expected, ATOL, RTOL, f"tree={tree}")


@uses_kernel
@pytest.mark.parametrize("tree", [False, True])
def test_ragged_query_counts_take_the_kernel_too(cpu_default, kernel_calls, tree):
    """Requests with different query counts (an adaptive step's ragged depths) run the kernel on q gathered into
    the padded slots, and only the real rows come back: chains and trees against the float64 oracle, with the
    cache past every request's context poisoned with NaN."""
    gen = torch.Generator().manual_seed(11)
    prefixes, counts = [40, 17, 63, 5], [3, 1, 6, 2]
    cache_shape = (5, 80, 4, 32)
    k_cache, v_cache = torch.randn(cache_shape, generator=gen), torch.randn(cache_shape, generator=gen)
    for b, (prefix, count) in enumerate(zip(prefixes, counts)):
        k_cache[b, prefix + count :] = 1e30  # finite but absurd: a padded slot reading them must not leak out
        v_cache[b, prefix + count :] = 1e30
    offsets = torch.tensor([0, 3, 4, 10, 12], dtype=torch.int32)
    q = torch.randn(int(offsets[-1]), 8, 32, generator=gen)
    mask = None
    if tree:
        parents = torch.tensor([-1, 0, 0] + [-1] + [-1, 0, 1, 1, 0, 4] + [-1, 0], dtype=torch.int32)
        mask = build_tree_metadata(parents, offsets).ancestor_mask
    plan = plan_attention(
        offsets, torch.tensor(prefixes, dtype=torch.int32), num_tokens=int(offsets[-1]), num_heads=8,
        cache_shape=cache_shape, dtype=torch.float32, tree_mask=mask, causal=mask is None, finite_cache=True,
    )  # fmt: skip
    assert plan.backend == "torch" and plan.query_rows is not None and plan.kv_rows is None
    out = tree_attention(q, k_cache, v_cache, plan=plan, out=torch.full_like(q, math.nan), check=False)
    assert kernel_calls == [(len(prefixes) * max(counts), 8, 32)]
    expected, _ = tree_attention_reference(q, k_cache, v_cache, offsets, torch.tensor(prefixes, dtype=torch.int32),
                                           mask, None, 32**-0.5)  # fmt: skip
    assert_close(out, expected, ATOL, RTOL, f"ragged, tree={tree}")


@needs_kernel
@pytest.mark.parametrize("case", ["lse", "bfloat16", "gathered", "torch backend", "no AVX2"])
def test_where_the_kernel_does_not_apply_sdpa_runs(cpu_default, kernel_calls, monkeypatch, case):
    """The log-sum-exp, another dtype, a gathered layout (a cache not known finite), a forced PyTorch backend and a
    CPU without the kernel's AVX2 version stay on the SDPA code, and are right."""
    if case == "no AVX2":
        monkeypatch.setattr(cpu_attention, "vector_cpu", lambda: False)
    gen = torch.Generator().manual_seed(5)
    prefixes, n = [30, 12], 2
    dtype = torch.bfloat16 if case == "bfloat16" else torch.float32
    k_cache = torch.randn(3, 40, 4, 32, generator=gen).to(dtype)
    v_cache = torch.randn(3, 40, 4, 32, generator=gen).to(dtype)
    q = torch.randn(len(prefixes) * n, 8, 32, generator=gen).to(dtype)
    plan = _plan(prefixes, n, k_cache, finite=case != "gathered")
    lse = torch.empty(q.shape[:2]) if case == "lse" else None
    with use_backend("torch" if case == "torch backend" else "auto"):
        out = tree_attention(q, k_cache, v_cache, plan=plan, out=torch.full_like(q, math.nan), lse=lse, check=False)
        out = out if lse is None else out[0]
    assert kernel_calls == []
    offsets = torch.arange(0, len(prefixes) * n + 1, n, dtype=torch.int32)
    prefix_lens = torch.tensor(prefixes, dtype=torch.int32)
    expected, expected_lse = tree_attention_reference(q, k_cache, v_cache, offsets, prefix_lens, None, None, 32**-0.5)
    tol = 2e-2 if dtype == torch.bfloat16 else ATOL
    assert_close(out, expected, tol, tol, case)
    if lse is not None:
        assert_close(lse, expected_lse, ATOL, RTOL, "lse")


@needs_kernel
def test_several_threads_give_the_same_result():
    """Work items (requests, slot and head chunks) split over threads: each row is the same sum whichever thread
    computes it, at a size large enough to go parallel."""
    gen = torch.Generator().manual_seed(11)
    q, k_cache, v_cache, out = operands(2, 3, 32, 8, 128, [300, 200], gen)
    bias = causal_bias([300, 200], 3, 300)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        cpu_attention.padded_attention(q, k_cache, v_cache, bias, 0.1, out)
        one = out.clone()
        torch.set_num_threads(3)
        cpu_attention.padded_attention(q, k_cache, v_cache, bias, 0.1, out)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, out)


GENERIC_CHECK = """
import math, torch
from test_cpu_attention import causal_bias, operands, padded_reference
from specdec.kernels import cpu_attention
g = torch.Generator().manual_seed(0)
for n, heads, kv_heads, head_dim in ((1, 8, 4, 32), (6, 8, 2, 64), (3, 4, 4, 20)):
    contexts = [n + 50, n + 23]
    q, k, v, out = operands(2, n, heads, kv_heads, head_dim, contexts, g)
    bias = causal_bias(contexts, n, max(contexts), g)
    cpu_attention.padded_attention(q, k, v, bias, 0.2, out)
    ref = padded_reference(q, k.nan_to_num(0.0), v.nan_to_num(0.0), bias, 0.2)
    assert torch.allclose(out.double(), ref, rtol=2e-5, atol=2e-5), (n, head_dim, (out.double() - ref).abs().max())
    print(out.numpy().tobytes().hex())
"""


@needs_kernel
def test_generic_version_equals_reference():
    """The version for CPUs without AVX2 + FMA, forced by its environment switch in a fresh process (chosen once per
    process). Where this CPU has AVX2 + FMA the two must round differently somewhere: the switch took effect."""
    runs = generic_version_runs(GENERIC_CHECK, "SPECDEC_ATTENTION_GENERIC")
    assert len(runs["1"]) == 3


def _good():
    q, k = torch.randn(6, 8, 32), torch.randn(4, 20, 4, 32)
    return q, k, k.clone(), torch.zeros(3, 1, 2, 16), torch.empty(6, 8, 32)


@needs_kernel
@pytest.mark.parametrize(
    "index, bad, match",
    [
        (0, torch.randn(6, 8, 32).double(), "q must be a float32"),
        (0, torch.randn(6, 256), "q must be a \\[B \\* n, Hq, D\\]"),
        (0, torch.randn(6, 32, 8).transpose(1, 2), "q must be a .* unit stride"),
        (0, torch.randn(5, 8, 32), "q must have B \\* n = 6 rows"),
        (1, torch.randn(2, 20, 4, 32), "k_cache must be \\[rows >= B=3"),
        (1, torch.randn(4, 15, 4, 32), "max_len >= L=16"),
        (1, torch.randn(4, 20, 3, 32), "Hkv dividing Hq=8"),
        (1, torch.randn(4, 20, 4, 16), "D=32"),
        (2, torch.randn(4, 20, 4, 32).half(), "v_cache must be a float32"),
        (2, torch.randn(4, 21, 4, 32), "v_cache must have k_cache's shape"),
        (3, torch.zeros(3, 2, 2, 16), "attn_bias must be \\[B, 1, n, L\\]"),
        (3, torch.zeros(3, 2, 16), "attn_bias must be a \\[B, 1, n, L\\]"),
        (4, torch.empty(6, 8, 31), "out must have q's shape"),
        (4, torch.empty(6, 8, 32, dtype=torch.float64), "out must be a float32 CPU tensor"),
    ],
)
def test_bad_arguments_are_named(index, bad, match):
    args = list(_good())
    args[index] = bad
    with pytest.raises(ValueError, match=match):
        torch.ops.specdec.padded_attention(*args[:4], 0.1, args[4])


@needs_kernel
def test_opcheck():
    q, k_cache, v_cache, bias, out = _good()
    for b in (bias, causal_bias([16, 9, 12], 2, 16)):
        torch.library.opcheck(torch.ops.specdec.padded_attention.default, (q, k_cache, v_cache, b, 0.2, out))


@uses_kernel
def test_embedded_pair_decodes_the_same_with_and_without_the_kernel(cpu_default, kernel_calls, monkeypatch):
    """On a CPU's default path, batched decoding (6 requests, 1 query each) and a K=4 chain's verification (5
    queries) run the kernel: their greedy tokens are those of SDPA."""
    from specdec.decoding import DraftModelStrategy, SpeculativeDecoder
    from specdec.testing import heldout_token_ids, load_pair

    target, draft, tokenizer = load_pair("cpu")
    prompts = heldout_token_ids(tokenizer)[:6]
    runs = {}
    real_applies = cpu_attention.applies
    for kernel in (True, False):
        monkeypatch.setattr(cpu_attention, "applies", real_applies if kernel else lambda q: False)
        runs[kernel] = [
            SpeculativeDecoder(target, strategy, adaptive=False).generate(ps, max_new_tokens=24,
                                                                         eos_token_id=None).tokens
            for strategy, ps in ((DraftModelStrategy(draft, (1,) * 4), prompts[:1]), (None, prompts))
        ]  # fmt: skip
    assert {shape[0] for shape in kernel_calls} >= {5, 6}  # chain verification (1 x 5) and batched decode (6 x 1)
    assert runs[True] == runs[False]


@needs_kernel
def test_the_attention_benchmark_runs(tmp_path):
    """``bench/bench_cpu_attention.py --dry-run``: one timed call per cell (both paths checked equal), the table
    written with a warm and a cold row per shape."""
    done = run_bench("bench_cpu_attention.py", "--dry-run", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr
    assert [cells[4] for cells in table_rows(tmp_path / "cpu_attention.md", "2")] == ["warm", "cold"]
