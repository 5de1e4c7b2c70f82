"""Property-based tests (hypothesis) over the public ops' argument space, on both paths.

For every public op of ``specdec.kernels``: random valid arguments (shapes at tile edges and
empty ones, every float dtype the path supports, ragged batches, special rows) give what the
op's ``*_reference`` gives -- bit for bit for tokens, counts, flags, uniforms and K/V moves,
within the dtype's tolerance for floating-point results -- with outputs poisoned first; and
one wrong argument (a wrong dtype, a missing or extra dimension, a wrong size, a value out of
range, not a tensor at all) raises TypeError / ValueError whose message names that argument,
before any kernel runs. Never a crash, a hang, or an output that silently differs.

The Triton path runs in Triton's interpreter on the CPU, so shapes stay small and examples
few; runs are derandomized (the same examples everywhere) and have no deadline.
"""

import contextlib
import math
from dataclasses import dataclass, field

import pytest
import torch
from helpers import assert_close
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from triton_bounds import check_bounds

from specdec import use_backend
from specdec.kernels import (
    SamplingParams,
    add_rms_norm,
    apply_rotary,
    build_tree_metadata,
    counter_uniform,
    filtered_probs,
    kv_append,
    kv_compact,
    rms_norm,
    sample,
    sample_probs,
    silu_mul,
    tree_attention,
    verify_chain,
    verify_chain_greedy,
    verify_tree,
    verify_tree_greedy,
)
from specdec.kernels.filtered_probs import filtered_probs_reference
from specdec.kernels.kv_append import kv_append_reference
from specdec.kernels.kv_compact import kv_compact_reference
from specdec.kernels.rms_norm import add_rms_norm_reference, rms_norm_reference
from specdec.kernels.rotary import apply_rotary_reference
from specdec.kernels.sample_probs import sample_probs_reference
from specdec.kernels.sampling import sample_reference
from specdec.kernels.silu_mul import silu_mul_reference
from specdec.kernels.tree_attention_torch import tree_attention_reference
from specdec.kernels.tree_metadata import tree_metadata_reference
from specdec.kernels.uniforms import counter_uniform_reference
from specdec.kernels.verify_chain import verify_chain_reference
from specdec.kernels.verify_greedy import verify_chain_greedy_reference, verify_tree_greedy_reference
from specdec.kernels.verify_tree import verify_tree_reference

FUZZ = settings(
    derandomize=True, database=None, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)  # fmt: skip
TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}  # atol = rtol, per dtype
VOCABS = st.sampled_from([1, 2, 31, 32, 33, 64, 65]) | st.integers(1, 70)


@dataclass
class Call:
    """One call of an op: positional arguments (named by ``names``) and keyword arguments."""

    args: list
    kwargs: dict = field(default_factory=dict)
    names: list = field(default_factory=list)  # the positional arguments' names

    def get(self, name):
        return self.args[self.names.index(name)] if name in self.names else self.kwargs[name]

    def replaced(self, name, value) -> "Call":
        if name in self.names:
            args = list(self.args)
            args[self.names.index(name)] = value
            return Call(args, dict(self.kwargs), self.names)
        return Call(list(self.args), {**self.kwargs, name: value}, self.names)


def generator(draw) -> torch.Generator:
    return torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))


def float_dtype(draw) -> torch.dtype:
    return draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))


def i32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def offsets_of(counts) -> torch.Tensor:
    return i32([0, *torch.tensor(counts, dtype=torch.int64).cumsum(0).tolist()]) if counts else i32([0])


def random_params(draw, batch: int, vocab: int, *, greedy: bool = False) -> SamplingParams:
    each = lambda s: draw(st.lists(s, min_size=batch, max_size=batch))  # noqa: E731
    return SamplingParams.make(
        batch,
        temperature=[0.0] * batch if greedy else each(st.sampled_from([0.0, 0.3, 1.0, 1.7])),
        top_k=each(st.sampled_from([0, 1, 3, vocab, vocab + 5])),
        top_p=each(st.sampled_from([1.0, 0.9, 0.4])),
        seed=each(st.integers(-(2**63), 2**63 - 1)),
        offset=each(st.integers(0, 2**40)),
    )


def random_logits(draw, gen, rows: int, vocab: int, dtype=torch.float32) -> torch.Tensor:
    """Random rows, some with -inf entries, a NaN or nothing finite (those are flagged invalid, not sampled)."""
    logits = torch.randn(rows, vocab, generator=gen) * 3
    for r in range(rows):
        kind = draw(st.sampled_from(["plain"] * 6 + ["-inf", "nan", "all -inf"]))
        if kind == "-inf":
            logits[r, torch.rand(vocab, generator=gen) < 0.5] = -math.inf
        elif kind == "nan":
            logits[r, 0] = math.nan
        elif kind == "all -inf":
            logits[r] = -math.inf
    return logits.to(dtype)


def random_trees(draw, batch: int, max_nodes: int = 5) -> tuple[list[list[int]], torch.Tensor, torch.Tensor]:
    """Per tree its parent list (node 0 the root, parents before children), and the flat int32 parents and offsets."""
    trees = []
    for _ in range(batch):
        n = draw(st.integers(1, max_nodes))
        trees.append([-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)])
    return trees, i32([p for t in trees for p in t]), offsets_of([len(t) for t in trees])


# ---- the ops: a builder of valid calls, the op, its reference, and how results compare -----------------


def build_rms_norm(draw, backend):
    gen, dtype = generator(draw), float_dtype(draw)
    t, h = draw(st.integers(0, 5)), draw(st.integers(1, 70))
    x, w = torch.randn(t, h, generator=gen).to(dtype), torch.randn(h, generator=gen).to(dtype)
    eps = draw(st.sampled_from([0.0, 1e-6, 0.1]))
    return Call([x, w, eps], {"out": torch.full_like(x, math.nan)}, ["x", "weight", "eps"])


def build_add_rms_norm(draw, backend):
    call = build_rms_norm(draw, backend)
    x = call.args[0]
    residual = torch.randn(x.shape, generator=generator(draw)).to(x.dtype)
    return Call([x, residual, *call.args[1:]], call.kwargs, ["x", "residual", "weight", "eps"])


def run_add_rms_norm(fn, call):
    residual = clone(call.args[1])
    out = fn(call.args[0], residual, *call.args[2:], **call.kwargs)
    return out, residual


def build_silu_mul(draw, backend):
    gen, dtype = generator(draw), float_dtype(draw)
    gate_up = (torch.randn(draw(st.integers(0, 5)), 2 * draw(st.integers(1, 40)), generator=gen) * 3).to(dtype)
    out = torch.full((gate_up.shape[0], gate_up.shape[1] // 2), math.nan, dtype=dtype)
    return Call([gate_up], {"out": out}, ["gate_up"])


def build_rotary(draw, backend):
    gen, dtype = generator(draw), float_dtype(draw)
    t, kv_heads, group, d = (
        draw(st.integers(0, 5)),
        draw(st.integers(1, 2)),
        draw(st.integers(1, 3)),
        draw(st.sampled_from([2, 12, 16, 24, 64, 80])),
    )
    q = torch.randn(t, kv_heads * group, d, generator=gen).to(dtype)
    k = torch.randn(t, kv_heads, d, generator=gen).to(dtype)
    positions = torch.randint(0, 512, (t,), generator=gen).to(draw(st.sampled_from([torch.int32, torch.int64])))
    inv_freq = 10000.0 ** -(torch.arange(0, d, 2, dtype=torch.float32) / d)
    return Call([q, k, positions, inv_freq], {}, ["q", "k", "positions", "inv_freq"])


def clone(value):
    """A copy with the same strides (a broken argument's stride is part of what is being tested)."""
    if not isinstance(value, torch.Tensor):
        return value
    return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype).copy_(value)


def run_rotary(fn, call):
    q, k = clone(call.args[0]), clone(call.args[1])
    result = fn(q, k, *call.args[2:])
    return (q, k) if result is None else result


def build_counter_uniform(draw, backend):
    rows = draw(st.integers(0, 6))
    seeds = draw(st.lists(st.integers(-(2**63), 2**63 - 1), min_size=rows, max_size=rows))
    seed = torch.tensor(seeds, dtype=torch.int64)
    offset = torch.tensor(draw(st.lists(st.integers(0, 2**62), min_size=rows, max_size=rows)), dtype=torch.int64)
    counter = draw(st.integers(0, 2**31) | st.just(torch.arange(rows, dtype=torch.int64)))
    return Call([seed, offset, counter], {"out": torch.full((rows,), math.nan)}, ["seed", "offset", "counter"])


def build_filtered_probs(draw, backend):
    gen, rows, vocab = generator(draw), draw(st.integers(0, 4)), draw(VOCABS)
    logits = random_logits(draw, gen, rows, vocab, float_dtype(draw))
    return Call([logits, random_params(draw, rows, vocab)], {}, ["logits", "params"])


def build_sample(draw, backend):
    return build_filtered_probs(draw, backend)


def build_sample_probs(draw, backend):
    gen, rows, vocab = generator(draw), draw(st.integers(0, 4)), draw(VOCABS)
    probs = torch.softmax(torch.randn(rows, vocab, generator=gen) * 3, -1)
    probs[torch.rand(rows, vocab, generator=gen) < 0.3] = 0.0  # rows that are all zero cannot be sampled: -1
    out = torch.full((rows,), -7, dtype=torch.int32)
    counter = draw(st.integers(0, 100))
    return Call([probs, random_params(draw, rows, vocab)], {"counter": counter, "out": out}, ["probs", "params"])


def rule_kwargs(draw, gen, rows: int, vocab: int) -> dict:
    """A drawn acceptance rule, with ``rows`` draft distributions when it is the stochastic one."""
    if not draw(st.booleans()):
        return {"rule": "deterministic"}
    return {"rule": "stochastic", "draft_probs": torch.softmax(torch.randn(rows, vocab, generator=gen) * 2, -1)}


def build_verify_chain(draw, backend, *, greedy=False):
    gen, batch, vocab = generator(draw), draw(st.integers(0, 4)), draw(VOCABS)
    ks = draw(st.lists(st.integers(0, 4), min_size=batch, max_size=batch))
    total = sum(ks)
    logits = random_logits(draw, gen, total + batch, vocab, float_dtype(draw))
    tokens = torch.randint(0, vocab, (total,), generator=gen, dtype=torch.int32)
    params = random_params(draw, batch, vocab, greedy=greedy)
    kwargs = {} if greedy else rule_kwargs(draw, gen, total, vocab)
    names = ["target_logits", "draft_tokens", "draft_offsets", "params"]
    return Call([logits, tokens, offsets_of(ks), params], kwargs, names)


def build_verify_tree(draw, backend, *, greedy=False):
    gen, batch, vocab = generator(draw), draw(st.integers(0, 4)), draw(VOCABS)
    _, parents, offsets = random_trees(draw, batch)
    n = parents.numel()
    logits = random_logits(draw, gen, n, vocab, float_dtype(draw))
    tokens = torch.randint(0, vocab, (n,), generator=gen, dtype=torch.int32)
    params = random_params(draw, batch, vocab, greedy=greedy)
    kwargs = {} if greedy else rule_kwargs(draw, gen, n, vocab)
    names = ["target_logits", "node_tokens", "parents", "node_offsets", "params"]
    return Call([logits, tokens, parents, offsets, params], kwargs, names)


def chain_reference(call):
    width = max([0, *(call.args[2][1:] - call.args[2][:-1]).tolist()])
    return verify_chain_reference(*call.args, **call.kwargs, max_draft_len=width)


def tree_depth(call) -> int:
    depth, _ = tree_metadata_reference(call.get("parents"), call.get("node_offsets"), 5)
    return int(depth.max()) if depth.numel() else 0


def tree_reference(call):
    return verify_tree_reference(*call.args, **call.kwargs, max_depth=tree_depth(call))


def chain_greedy_reference(call):
    width = max([0, *(call.args[2][1:] - call.args[2][:-1]).tolist()])
    return verify_chain_greedy_reference(*call.args[:3], max_draft_len=width)


def tree_greedy_reference(call):
    return verify_tree_greedy_reference(*call.args[:4], max_depth=tree_depth(call))


def build_tree_attention(draw, backend):
    gen = generator(draw)
    dtype = draw(st.sampled_from([torch.float32, torch.float16]))  # interpreted bf16 tl.dot is wrong (Triton 3.9)
    batch, kv_heads, group = draw(st.integers(1, 3)), draw(st.integers(1, 2)), draw(st.integers(1, 3))
    d = draw(st.sampled_from([12, 16, 24, 32, 72]))
    prefixes = draw(st.lists(st.integers(0, 10), min_size=batch, max_size=batch))
    causal = draw(st.booleans())
    trees, parents, offsets = random_trees(draw, batch)
    counts = [len(t) for t in trees]
    if causal:
        counts = draw(st.lists(st.integers(0, 4), min_size=batch, max_size=batch))
        offsets = offsets_of(counts)
    q = torch.randn(sum(counts), kv_heads * group, d, generator=gen).to(dtype)
    max_len = max(p + n for p, n in zip(prefixes, counts)) + draw(st.integers(0, 3))
    paged = draw(st.booleans())
    kwargs = {"softmax_scale": d**-0.5, "out": torch.full_like(q, math.nan)}
    kwargs["num_splits"] = draw(st.sampled_from([None, 1, 2, 3]))  # the Triton path's split-context kernels
    if paged:
        size = draw(st.sampled_from([4, 8, 16]))
        per = -(-max_len // size)
        pool = batch * per + 2
        kwargs["block_table"] = torch.randperm(pool, generator=gen)[: batch * per].view(batch, per).to(torch.int32)
        shape = (pool, size, kv_heads, d)
    else:
        shape = (batch, max_len, kv_heads, d)
    k_cache, v_cache = (torch.randn(shape, generator=gen).to(dtype) for _ in range(2))
    if causal:
        kwargs["causal"] = True
    else:
        kwargs["tree_mask"] = build_tree_metadata(parents, offsets, max(counts)).ancestor_mask
    names = ["q", "k_cache", "v_cache", "q_offsets", "prefix_lens"]
    return Call([q, k_cache, v_cache, offsets, i32(prefixes)], kwargs, names)


def attention_reference(call):
    kw = call.kwargs
    out, _ = tree_attention_reference(*call.args, kw.get("tree_mask"), kw.get("block_table"), kw["softmax_scale"])
    return out.to(call.args[0].dtype)


def kv_cache(draw, gen, dtype):
    layers, batch, kv_heads, d = (
        draw(st.integers(1, 2)),
        draw(st.integers(1, 3)),
        draw(st.integers(1, 2)),
        draw(st.sampled_from([4, 12, 16])),
    )
    max_len = draw(st.integers(4, 12))
    if draw(st.booleans()):
        size = draw(st.sampled_from([2, 4]))
        per = -(-max_len // size)
        pool = batch * per + 1
        tables = torch.randperm(pool, generator=gen)[: batch * per].view(batch, per).to(torch.int32)
        data = torch.randn(layers, 2, pool, size, kv_heads, d, generator=gen).to(dtype)
        return data, tables, batch, per * size
    return torch.randn(layers, 2, batch, max_len, kv_heads, d, generator=gen).to(dtype), None, batch, max_len


def build_kv_append(draw, backend):
    gen, dtype = generator(draw), float_dtype(draw)
    data, tables, batch, capacity = kv_cache(draw, gen, dtype)
    seq_lens = [draw(st.integers(0, capacity)) for _ in range(batch)]
    counts = [draw(st.integers(0, capacity - s)) for s in seq_lens]
    k, v = (torch.randn(sum(counts), data.shape[4], data.shape[5], generator=gen).to(dtype) for _ in range(2))
    layer = draw(st.integers(0, data.shape[0] - 1))
    names = ["data", "layer", "k", "v", "seq_lens", "q_offsets", "block_tables"]
    return Call([data, layer, k, v, i32(seq_lens), offsets_of(counts), tables], {}, names)


def build_kv_compact(draw, backend):
    gen, dtype = generator(draw), float_dtype(draw)
    data, tables, batch, capacity = kv_cache(draw, gen, dtype)
    width = draw(st.integers(0, 4))
    seq_lens, rows = [], []
    for _ in range(batch):
        s = draw(st.integers(0, capacity - 1))
        room = capacity - s
        path = sorted(draw(st.sets(st.integers(1, max(room - 1, 1)), max_size=max(width - 1, 0))))
        row = [0, *[p for p in path if p < room]][:width] if draw(st.integers(0, 4)) else []
        seq_lens.append(s)
        rows.append(row + [-1] * (width - len(row)))
    path = torch.tensor(rows, dtype=torch.int32).view(batch, width)
    return Call([data, i32(seq_lens), path, tables], {}, ["data", "seq_lens", "accepted_path", "block_tables"])


def run_in_place(fn, call, mutated=("data",)):
    call = Call([clone(a) for a in call.args], dict(call.kwargs), call.names)
    fn(*call.args, **call.kwargs)
    return tuple(call.get(name) for name in mutated)


def build_tree_metadata_call(draw, backend):
    _, parents, offsets = random_trees(draw, draw(st.integers(0, 4)), max_nodes=draw(st.sampled_from([5, 70])))
    return Call([parents, offsets], {}, ["parents", "offsets"])


def metadata_reference(call):
    counts = (call.args[1][1:] - call.args[1][:-1]).tolist()
    return tree_metadata_reference(*call.args, max(counts, default=1))


@dataclass(frozen=True)
class Op:
    build: object  # (draw, backend) -> Call
    run: object  # (public op, Call) -> results
    reference: object  # Call -> results
    exact: bool  # results compared bit for bit (else within TOLERANCE of the inputs' dtype)
    op: object


def plain(fn, call):
    return fn(*call.args, **call.kwargs)


def tensors(result):
    return result if isinstance(result, tuple) else (result,)


def compact_in_place(fn, call):
    return run_in_place(fn, call, ("data", "seq_lens"))


def positional(reference):
    return lambda call: reference(*call.args)


OPS = {
    "rms_norm": Op(build_rms_norm, plain, positional(rms_norm_reference), False, rms_norm),
    "add_rms_norm": Op(
        build_add_rms_norm, run_add_rms_norm, lambda c: run_add_rms_norm(add_rms_norm_reference, c), False, add_rms_norm
    ),
    "silu_mul": Op(build_silu_mul, plain, positional(silu_mul_reference), False, silu_mul),
    "apply_rotary": Op(build_rotary, run_rotary, positional(apply_rotary_reference), False, apply_rotary),
    "counter_uniform": Op(build_counter_uniform, plain, positional(counter_uniform_reference), True, counter_uniform),
    "filtered_probs": Op(build_filtered_probs, plain, positional(filtered_probs_reference), False, filtered_probs),
    "sample": Op(build_sample, plain, positional(sample_reference), True, sample),
    "sample_probs": Op(
        build_sample_probs, plain, lambda c: sample_probs_reference(*c.args, counter=c.get("counter")), True,
        sample_probs,
    ),
    "verify_chain": Op(build_verify_chain, plain, chain_reference, True, verify_chain),
    "verify_tree": Op(build_verify_tree, plain, tree_reference, True, verify_tree),
    "verify_chain_greedy": Op(
        lambda d, b: build_verify_chain(d, b, greedy=True), plain, chain_greedy_reference, True, verify_chain_greedy
    ),
    "verify_tree_greedy": Op(
        lambda d, b: build_verify_tree(d, b, greedy=True), plain, tree_greedy_reference, True, verify_tree_greedy
    ),
    "tree_attention": Op(build_tree_attention, plain, attention_reference, False, tree_attention),
    "kv_append": Op(build_kv_append, run_in_place, lambda c: run_in_place(kv_append_reference, c), True, kv_append),
    "kv_compact": Op(build_kv_compact, compact_in_place, lambda c: compact_in_place(kv_compact_reference, c), True,
                     kv_compact),
    "build_tree_metadata": Op(build_tree_metadata_call, plain, metadata_reference, True, build_tree_metadata),
}  # fmt: skip


def same(got: torch.Tensor, expected: torch.Tensor) -> bool:
    """Bit for bit (NaN where the reference has NaN)."""
    if got.dtype.is_floating_point:
        return torch.allclose(got, expected, rtol=0, atol=0, equal_nan=True)
    return torch.equal(got, expected)


def check_matches(name: str, op: Op, call: Call, backend: str) -> None:
    # The Triton path runs under the bounds checker: no lane of any kernel, masked ones included,
    # may address memory outside the tensor its pointer came from.
    with use_backend(backend), check_bounds() if backend == "triton" else contextlib.nullcontext():
        got = op.run(op.op, call)
    expected = op.reference(call)
    for i, (g, e) in enumerate(zip(tensors(got), tensors(expected))):
        what = f"{name} output {i} on the {backend} path"
        assert g.shape == e.shape and g.dtype == e.dtype, f"{what}: {g.shape} {g.dtype} vs {e.shape} {e.dtype}"
        if op.exact or not g.dtype.is_floating_point:
            assert same(g, e), f"{what}:\n{g}\n{e}"
        else:
            tol = TOLERANCE[call.args[0].dtype if call.args[0].dtype.is_floating_point else torch.float32]
            assert_close(g.float(), e.float(), atol=tol, rtol=tol, what=what)


@pytest.mark.parametrize("name", list(OPS))
@settings(FUZZ, max_examples=20)
@given(data=st.data())
def test_valid_calls_match_the_reference_on_the_torch_path(name, data):
    check_matches(name, OPS[name], OPS[name].build(data.draw, "torch"), "torch")


@pytest.mark.interpreter  # the bounds checker watches the interpreter's loads and stores
@pytest.mark.parametrize("name", list(OPS))
@settings(FUZZ, max_examples=5)
@given(data=st.data())
def test_valid_calls_match_the_reference_on_the_triton_path(name, data):
    check_matches(name, OPS[name], OPS[name].build(data.draw, "triton"), "triton")


# ---- one wrong argument: refused by name, before anything runs -----------------------------------------


def _bad_dtype(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float64 if t.dtype.is_floating_point else torch.int32 if t.dtype == torch.bool else torch.float32)


def _resized(t: torch.Tensor) -> torch.Tensor:
    if t.shape[-1] > 1:
        return t.narrow(-1, 0, t.shape[-1] - 1)
    return torch.cat((t, t.narrow(-1, 0, 1) if t.shape[-1] else torch.zeros_like(t, size=(*t.shape[:-1], 1))), -1)


def _strided(t: torch.Tensor) -> torch.Tensor:
    return t.repeat_interleave(2, dim=-1)[..., ::2]  # the same values, last-dim stride 2


BREAK = {
    "type": lambda t: t.tolist(),
    "dtype": _bad_dtype,
    "ndim": lambda t: t.unsqueeze(0),
    "size": _resized,
    "strided": _strided,
}
PARAMS_BREAK = {
    "type": lambda p: tuple(p),
    "dtype": lambda p: p._replace(temperature=p.temperature.double()),
    "size": lambda p: p._replace(top_k=torch.cat((p.top_k, p.top_k[:1] if len(p.top_k) else i32([0])))),
    "seed dtype": lambda p: p._replace(seed=p.seed.int()),
}
# Per op: (argument, how it is broken, the name the message must hold; None: the argument's own).
ROWS = ("type", "dtype", "ndim", "strided")
SPECIAL = {  # value errors: (argument, replacement value, name)
    "rms_norm": [("eps", -1.0, "eps"), ("eps", math.nan, "eps"), ("eps", "0.1", "eps")],
    "add_rms_norm": [("eps", -0.5, "eps")],
    "counter_uniform": [("counter", 1.5, "counter")],
    "sample_probs": [("counter", 2.5, "counter")],
    "verify_chain": [("rule", "greedy", "rule"), ("max_draft_len", -1, "max_draft_len"),
                     ("draft_offsets", "decreasing", "draft_offsets")],
    "verify_tree": [("rule", None, "rule"), ("max_depth", -1, "max_depth"), ("parents", "forward", "parents"),
                    ("node_offsets", "decreasing", "node_offsets")],
    "verify_chain_greedy": [("max_draft_len", -2, "max_draft_len")],
    "verify_tree_greedy": [("parents", "forward", "parents")],
    "tree_attention": [("softmax_scale", "1", "softmax_scale"), ("q_offsets", "decreasing", "q_offsets"),
                       ("prefix_lens", "negative", "prefix_lens")],
    "kv_append": [("layer", 99, "layer"), ("layer", True, "layer"), ("seq_lens", "overflow", "capacity")],
    "kv_compact": [("accepted_path", "not root first", "accepted_path"), ("seq_lens", "negative", "seq_lens")],
    "build_tree_metadata": [("parents", "forward", "parents"), ("offsets", "decreasing", "offsets")],
}  # fmt: skip
BROKEN = {
    "rms_norm": [("x", ROWS), ("weight", ("type", "dtype", "ndim", "size")), ("out", ("dtype", "size", "strided"))],
    "add_rms_norm": [("x", ROWS), ("residual", ("type", "dtype", "ndim", "size", "strided")), ("weight", ("size",))],
    "silu_mul": [("gate_up", ROWS), ("out", ("dtype", "size", "strided"))],
    "apply_rotary": [("q", ROWS), ("k", ("type", "dtype", "ndim", "size", "strided")),
                     ("positions", ("type", "dtype", "ndim")), ("inv_freq", ("type", "dtype", "size"))],
    "counter_uniform": [("seed", ("type", "dtype")), ("offset", ("type", "dtype")), ("out", ("dtype", "size"))],
    "filtered_probs": [("logits", ("type", "dtype", "ndim"))],
    "sample": [("logits", ("type", "dtype", "ndim"))],
    "sample_probs": [("probs", ("type", "dtype", "ndim")), ("out", ("dtype", "size"))],
    "verify_chain": [("target_logits", ("type", "dtype", "ndim")), ("draft_tokens", ("type", "dtype", "ndim")),
                     ("draft_offsets", ("type", "dtype", "ndim"))],
    "verify_tree": [("target_logits", ("type", "dtype", "ndim")), ("node_tokens", ("type", "dtype", "size")),
                    ("parents", ("type", "dtype", "size")), ("node_offsets", ("type", "dtype", "ndim"))],
    "verify_chain_greedy": [("target_logits", ("type", "dtype")), ("draft_tokens", ("dtype", "ndim"))],
    "verify_tree_greedy": [("target_logits", ("type", "dtype")), ("parents", ("dtype", "size"))],
    "tree_attention": [("q", ROWS), ("k_cache", ("type", "dtype", "ndim", "strided")),
                       ("v_cache", ("dtype", "ndim", "strided")), ("q_offsets", ("type", "dtype", "ndim")),
                       ("prefix_lens", ("type", "dtype", "ndim", "size")), ("out", ("dtype", "size", "strided"))],
    "kv_append": [("data", ("type", "dtype", "ndim")), ("k", ROWS), ("v", ("dtype", "size", "strided")),
                  ("seq_lens", ("type", "dtype", "ndim", "size")), ("q_offsets", ("type", "dtype", "ndim"))],
    "kv_compact": [("data", ("type", "dtype", "ndim")), ("seq_lens", ("type", "dtype", "ndim", "size")),
                   ("accepted_path", ("type", "dtype", "ndim", "strided"))],
    "build_tree_metadata": [("parents", ("type", "dtype", "ndim")), ("offsets", ("type", "dtype", "ndim"))],
}  # fmt: skip
# A batch size that disagrees between two arguments may be reported under either name.
PARTNER = {("kv_append", "seq_lens"): "q_offsets", ("kv_compact", "seq_lens"): "accepted_path",
           ("tree_attention", "prefix_lens"): "q_offsets"}  # fmt: skip
WITH_PARAMS = ("filtered_probs", "sample", "sample_probs", "verify_chain", "verify_tree", "verify_chain_greedy",
               "verify_tree_greedy")  # fmt: skip


SKIP = object()  # a way of breaking that does not apply to this call (e.g. no second node to misplace)


def _special(call: Call, arg: str, value):
    """The replacement for a value error: a literal, or a named way to break an index tensor."""
    if not isinstance(value, str) or arg in ("eps", "softmax_scale", "rule"):
        return value
    t = call.get(arg).clone()
    if value == "decreasing":  # offsets: the last entry below its predecessor (B unchanged)
        if t.numel() < 2:
            return SKIP
        t[-2] = t[-1] + 1
        return t
    if value == "forward":  # parents: a node whose parent comes after it
        return SKIP if t.numel() < 2 else torch.cat((t[:1], i32([t.numel()]), t[2:]))
    if value == "negative":
        return t - 100
    if value == "overflow":  # seq_lens pushing the tokens past the capacity
        return t + 1000
    if value == "not root first":
        return torch.where(t >= 0, t + 1, t)
    raise AssertionError(value)


@st.composite
def broken_calls(draw, name: str, backend: str):
    """A valid call of op ``name`` with one argument broken, and the names its refusal may give (None: skip)."""
    call = OPS[name].build(draw, backend)
    choices = [(arg, kind) for arg, kinds in BROKEN[name] for kind in kinds]
    choices += [(arg, ("special", value, named)) for arg, value, named in SPECIAL.get(name, [])]
    if name in WITH_PARAMS:
        choices += [("params", ("params", kind)) for kind in PARAMS_BREAK]
    arg, kind = draw(st.sampled_from(choices))
    if isinstance(kind, tuple) and kind[0] == "params":
        named = "params.temperature" if kind[1] == "dtype" else "params.top_k" if kind[1] == "size" else "params"
        named = "params.seed" if kind[1] == "seed dtype" else named
        return call.replaced("params", PARAMS_BREAK[kind[1]](call.get("params"))), (named,), f"params {kind[1]}"
    if isinstance(kind, tuple):
        value = _special(call, arg, kind[1])
        return call.replaced(arg, value), None if value is SKIP else (kind[2],), f"{arg} = {kind[1]!r}"
    value = call.get(arg)
    if value is None or (kind == "size" and value.numel() == 0) or (kind == "strided" and value.shape[-1] < 2):
        return call, None, "nothing to break"
    named = (arg, PARTNER[name, arg]) if kind == "size" and (name, arg) in PARTNER else (arg,)
    return call.replaced(arg, BREAK[kind](value)), named, f"{arg} {kind}"


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("name", list(OPS))
@settings(FUZZ, max_examples=20)
@given(data=st.data())
def test_one_wrong_argument_is_refused_by_name(name, backend, data):
    call, named, how = data.draw(broken_calls(name, backend))
    event(how)
    if named is None:
        return  # nothing of that kind to break in this call (an empty tensor's size, a one-node tree's order)
    op = OPS[name]
    try:
        with use_backend(backend):
            op.run(op.op, call)
    except (TypeError, ValueError) as refusal:
        assert any(n in str(refusal) for n in named), f"{name}, {how}: {type(refusal).__name__}: {refusal}"
    else:
        pytest.fail(f"{name}, {how}: accepted")
