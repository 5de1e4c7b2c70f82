"""The per-layer model ops (RMSNorm, add + RMSNorm, RoPE, SwiGLU) against their references, both backends.

Three oracles: each op's PyTorch reference (the Triton kernels within dtype tolerances);
the composites the model runs today (``specdec.model.llama``: the PyTorch bodies equal
them bit for bit, which the model's greedy parity with transformers relies on); and
neighbouring memory, which no op may touch (NaN-poisoned padding, the V part of a fused
QKV buffer).
"""

import importlib
import os

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_close
from triton_bounds import check_bounds

from specdec import use_backend
from specdec.kernels import add_rms_norm, apply_rotary, rms_norm, silu_mul
from specdec.kernels.rms_norm import MAX_HIDDEN, add_rms_norm_op, rms_norm_op, rms_norm_reference
from specdec.kernels.rotary import apply_rotary_op, apply_rotary_reference, rotary_table, rotary_tables, rotate
from specdec.kernels.silu_mul import silu_mul_op, silu_mul_reference

# the package re-exports functions under their modules' names, so fetch the modules themselves
rms_norm_module, rotary_module, silu_mul_module = (
    importlib.import_module(f"specdec.kernels.{name}") for name in ("rms_norm", "rotary", "silu_mul")
)

TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (4e-3, 4e-3), torch.bfloat16: (3e-2, 2e-2)}
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float16, id="fp16")]
EPS = 1e-5


def rows(t: int, h: int, dtype, device, pad: int = 0) -> torch.Tensor:
    """Random ``[t, h]`` rows of very different magnitudes, as a view into a NaN-padded buffer when pad > 0."""
    scale = torch.exp(2 * torch.randn(t, 1))
    buffer = torch.full((t, h + pad), float("nan"))
    buffer[:, :h] = torch.randn(t, h) * scale
    return buffer.to(dtype).to(device)[:, :h]


def inv_freq(d: int, base: float = 10000.0) -> torch.Tensor:
    return 1.0 / base ** (torch.arange(0, d, 2, dtype=torch.float32) / d)


# HuggingFace's LLaMA composites, written out: the oracle the PyTorch bodies must match bit for bit.
def hf_rms_norm(x, weight, eps):
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def hf_rope(x, positions, freq):
    angles = positions.float()[:, None] * freq[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    cos, sin = angles.cos().to(x.dtype)[:, None], angles.sin().to(x.dtype)[:, None]
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


# ---------------------------------------------------------------- RMSNorm and add + RMSNorm

NORM_SHAPES = [(0, 48), (1, 48), (7, 200), (3, 1000), (2, 4096), (1, 4104)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,h", NORM_SHAPES)
@pytest.mark.parametrize("strided", [False, True], ids=["dense", "strided"])
def test_rms_norm(backend, device, dtype, t, h, strided):
    x = rows(t, h, dtype, device, pad=5 if strided else 0)
    weight = torch.randn(h).to(dtype).to(device)
    out = rows(t, h, dtype, device, pad=3 if strided else 0).fill_(float("nan"))
    assert rms_norm(x, weight, EPS, out=out) is out
    assert_close(out, rms_norm_reference(x, weight, EPS), *TOL[dtype], f"rms_norm {backend}")
    if strided:  # the padding beyond each row stays untouched
        assert out.as_strided((t, 3), (out.stride(0), 1), out.storage_offset() + h).isnan().all()
    assert_close(rms_norm(x, weight, EPS), out, 0, 0, "allocated out")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,h", NORM_SHAPES)
def test_add_rms_norm(backend, device, dtype, t, h):
    x, residual = rows(t, h, dtype, device, pad=2), rows(t, h, dtype, device)
    weight = torch.randn(h).to(dtype).to(device)
    expected_residual = residual + x
    expected = rms_norm_reference(expected_residual, weight, EPS)
    out = torch.full((t, h), float("nan"), dtype=dtype, device=device)
    add_rms_norm(x, residual, weight, EPS, out=out)
    assert torch.equal(residual, expected_residual), "the residual must be rounded exactly as residual + x"
    assert_close(out, expected, *TOL[dtype], f"add_rms_norm {backend}")


def test_rms_norm_in_place(backend, device):
    x = rows(4, 200, torch.float32, device)
    weight = torch.randn(200, device=device)
    expected = rms_norm_reference(x, weight, EPS)
    rms_norm(x, weight, EPS, out=x)
    assert_close(x, expected, *TOL[torch.float32], "out=x")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_norm_bodies_equal_the_hf_composite_bitwise(dtype):
    # HuggingFace's LlamaRMSNorm is the oracle: not one bit may change.
    weight = torch.randn(200).to(dtype)
    x, residual = rows(9, 200, dtype, "cpu", pad=4), rows(9, 200, dtype, "cpu")
    out = torch.empty(9, 200, dtype=dtype)
    rms_norm_op.body("torch")(x, weight, EPS, out)
    assert torch.equal(out, hf_rms_norm(x, weight, EPS))
    expected_residual = residual + x
    add_rms_norm_op.body("torch")(x, residual, weight, EPS, out)
    assert torch.equal(residual, expected_residual) and torch.equal(out, hf_rms_norm(expected_residual, weight, EPS))


def test_norm_ops_pass_opcheck(backend, device):
    x, residual = rows(5, 48, torch.float32, device), rows(5, 48, torch.float32, device)
    weight = torch.randn(48, device=device)
    out = torch.full_like(x, float("nan"))
    torch.library.opcheck(torch.ops.specdec.rms_norm.default, (x, weight, EPS, out))
    torch.library.opcheck(torch.ops.specdec.add_rms_norm.default, (x, residual, weight, EPS, out))


def _norm_args(**over):
    args = dict(x=torch.randn(3, 8), weight=torch.randn(8), eps=EPS, out=None)
    args.update(over)
    return args


@pytest.mark.parametrize(
    "over,exc,match",
    [
        (dict(x=torch.ones(3, 8, dtype=torch.int32)), TypeError, "x must have dtype"),
        (dict(x=torch.randn(3, 8, 1)), ValueError, "x must have 2 dimensions"),
        (dict(x=torch.randn(8, 3).t()), ValueError, "x must have a contiguous last dim"),
        (dict(x=torch.randn(1, MAX_HIDDEN + 1), weight=torch.randn(MAX_HIDDEN + 1)), ValueError, "hidden size"),
        (dict(weight=torch.randn(8, dtype=torch.float16)), TypeError, "weight must have dtype float32"),
        (dict(weight=torch.randn(9)), ValueError, "weight must have shape"),
        (dict(weight=torch.randn(16)[::2]), ValueError, "weight must be contiguous"),
        (dict(weight=torch.randn(8, device="meta")), ValueError, "weight is on meta"),
        (dict(eps=-1e-6), ValueError, "eps must be"),
        (dict(eps="1e-6"), ValueError, "eps must be"),
        (dict(out=torch.empty(3, 9)), ValueError, "out must have shape"),
        (dict(out=torch.empty(3, 8, dtype=torch.float64)), TypeError, "out must have dtype"),
        (dict(out=torch.empty(8, 3).t()), ValueError, "out must have a contiguous last dim"),
    ],
)
def test_norm_bad_input(over, exc, match):
    args = _norm_args(**over)
    with pytest.raises(exc, match=match):
        rms_norm(args["x"], args["weight"], args["eps"], out=args["out"])
    with pytest.raises(exc, match=match):
        add_rms_norm(args["x"], torch.randn(args["x"].shape), args["weight"], args["eps"], out=args["out"])


@pytest.mark.parametrize(
    "residual,exc,match",
    [
        (torch.randn(3, 9), ValueError, "residual must have shape"),
        (torch.randn(3, 8, dtype=torch.float16), TypeError, "residual must have dtype"),
        (torch.randn(8, 3).t(), ValueError, "residual must have a contiguous last dim"),
    ],
)
def test_add_rms_norm_bad_residual(residual, exc, match):
    with pytest.raises(exc, match=match):
        add_rms_norm(torch.randn(3, 8), residual, torch.randn(8), EPS)


# ---------------------------------------------------------------- rotary embedding

ROPE_SHAPES = [  # (T, Hq, Hkv, D)
    (0, 4, 2, 32),
    (1, 4, 4, 12),
    (5, 8, 1, 80),
    (7, 6, 3, 96),
    (3, 32, 8, 128),
    (2, 3, 1, 32),
]


def fused_qkv(t, hq, hkv, d, dtype, device):
    """q, k and v as strided views of one [T, Hq + 2 Hkv, D] projection output."""
    qkv = torch.randn(t, hq + 2 * hkv, d).to(dtype).to(device)
    return qkv, qkv[:, :hq], qkv[:, hq : hq + hkv], qkv[:, hq + hkv :]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,hq,hkv,d", ROPE_SHAPES)
def test_apply_rotary_fused_qkv(backend, device, dtype, t, hq, hkv, d):
    qkv, q, k, v = fused_qkv(t, hq, hkv, d, dtype, device)
    index_dtype = torch.int64 if d % 3 else torch.int32
    positions = torch.randint(0, 8192, (t,), dtype=index_dtype, device=device)
    freq = inv_freq(d).to(device)
    expected_q, expected_k = apply_rotary_reference(q, k, positions, freq)
    v_before = v.clone()
    apply_rotary(q, k, positions, freq)
    assert_close(q, expected_q, *TOL[dtype], f"q {backend}")
    assert_close(k, expected_k, *TOL[dtype], f"k {backend}")
    assert torch.equal(v, v_before), "v (next to k in the fused buffer) must not change"


def test_apply_rotary_separate_strides(backend, device):
    # k laid out head-major ([Hkv, T, D] transposed): token and head strides unlike q's
    t, hq, hkv, d = 6, 4, 2, 48
    q = rows(t, hq * d, torch.float32, device, pad=7).view(t, hq, d)
    k = torch.randn(hkv, t, d, device=device).transpose(0, 1)
    positions = torch.randint(0, 100000, (t,), device=device)
    freq = inv_freq(d, base=500000.0).to(device)
    expected_q, expected_k = apply_rotary_reference(q, k, positions, freq)
    apply_rotary(q, k, positions, freq)
    assert_close(q, expected_q, *TOL[torch.float32], "q")
    assert_close(k, expected_k, *TOL[torch.float32], "k")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("t,hq,hkv,d", ROPE_SHAPES)
def test_rotary_body_equals_the_hf_composite_bitwise(dtype, t, hq, hkv, d):
    qkv, q, k, _ = fused_qkv(t, hq, hkv, d, dtype, "cpu")
    positions = torch.randint(0, 8192, (t,))
    freq = inv_freq(d)
    expected_q, expected_k = hf_rope(q, positions, freq), hf_rope(k, positions, freq)
    # the model's hot path: q and k as one [T, Hq + Hkv, D] view, cos / sin gathered from a table
    table = rotary_table(8192, freq, dtype)[positions]
    qk = rotate(qkv[:, : hq + hkv], table[:, 0], table[:, 1])
    assert torch.equal(qk[:, :hq], expected_q) and torch.equal(qk[:, hq:], expected_k)
    assert all(torch.equal(a, b) for a, b in zip(rotary_tables(positions, freq, dtype), table.unbind(1)))
    apply_rotary_op.body("torch")(q, k, positions, freq)
    assert torch.equal(q, expected_q) and torch.equal(k, expected_k)


@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused-qkv"])
def test_rotary_op_passes_opcheck(backend, device, fused):
    _, q, k, _ = fused_qkv(3, 4, 2, 32, torch.float32, device)
    if not fused:
        q, k = q.clone(), k.clone()
    positions = torch.tensor([0, 7, 4000], device=device)
    torch.library.opcheck(torch.ops.specdec.apply_rotary.default, (q, k, positions, inv_freq(32).to(device)))


def _rope_args(**over):
    args = dict(q=torch.randn(3, 4, 8), k=torch.randn(3, 2, 8), positions=torch.arange(3), inv_freq=inv_freq(8))
    args.update(over)
    return args


@pytest.mark.parametrize(
    "over,exc,match",
    [
        (dict(q=torch.ones(3, 4, 8, dtype=torch.int32)), TypeError, "q must have dtype"),
        (dict(q=torch.randn(3, 32)), ValueError, "q must have 3 dimensions"),
        (dict(q=torch.randn(3, 8, 4).transpose(1, 2)), ValueError, "q must have a contiguous last dim"),
        (dict(q=torch.randn(3, 4, 7), k=torch.randn(3, 2, 7)), ValueError, "q must have an even head dim"),
        (dict(k=torch.randn(3, 2, 8, dtype=torch.float16)), TypeError, "k must have dtype float32"),
        (dict(k=torch.randn(4, 2, 8)), ValueError, "k must have shape"),
        (dict(k=torch.randn(3, 2, 6)), ValueError, "k must have shape"),
        (dict(k=torch.randn(3, 8, 2).transpose(1, 2)), ValueError, "k must have a contiguous last dim"),
        (dict(k=torch.randn(3, 2, 8, device="meta")), ValueError, "k is on meta"),
        (dict(positions=torch.arange(3.0)), TypeError, "positions must have dtype"),
        (dict(positions=torch.arange(4)), ValueError, "positions must have shape"),
        (dict(positions=torch.arange(6)[::2]), ValueError, "positions must be contiguous"),
        (dict(inv_freq=inv_freq(8).half()), TypeError, "inv_freq must have dtype float32"),
        (dict(inv_freq=inv_freq(16)), ValueError, "inv_freq must have shape"),
    ],
)
def test_rotary_bad_input(over, exc, match):
    with pytest.raises(exc, match=match):
        apply_rotary(**_rope_args(**over))


# ---------------------------------------------------------------- SwiGLU

SILU_SHAPES = [(0, 48), (1, 200), (7, 344), (3, 1000), (2, 1400), (1, 2056)]  # (T, I)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,i", SILU_SHAPES)
def test_silu_mul(backend, device, dtype, t, i):
    gate_up = (4 * torch.randn(t, 2 * i + 6)).to(dtype).to(device)[:, : 2 * i]  # strided rows, |gate| up to ~16
    buffer = torch.full((t, i + 3), float("nan"), dtype=dtype, device=device)
    out = buffer[:, :i]
    assert silu_mul(gate_up, out=out) is out
    assert_close(out, silu_mul_reference(gate_up), *TOL[dtype], f"silu_mul {backend}")
    assert buffer[:, i:].isnan().all(), "silu_mul wrote past the rows of out"
    assert_close(silu_mul(gate_up), out, 0, 0, "allocated out")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("t,i", SILU_SHAPES)
def test_silu_mul_body_equals_composite_bitwise(dtype, t, i):
    gate_up = (4 * torch.randn(t, 2 * i)).to(dtype)
    out = torch.empty(t, i, dtype=dtype)
    silu_mul_op.body("torch")(gate_up, out)
    gate, up = gate_up[:, :i], gate_up[:, i:]
    assert torch.equal(out, F.silu(gate) * up)
    if t <= 1 or i % 64 == 0:
        # today's MLP applies silu to its own contiguous gate_proj output; CPU silu takes another
        # (scalar) path for the tail of each row that is not a whole vector, so the two agree bit for
        # bit when there is one row, or when rows are whole vectors
        assert torch.equal(out, F.silu(gate.contiguous()) * up)


def test_silu_mul_op_passes_opcheck(backend, device):
    gate_up = torch.randn(4, 2 * 48, device=device)
    out = torch.full((4, 48), float("nan"), device=device)
    torch.library.opcheck(torch.ops.specdec.silu_mul.default, (gate_up, out))


@pytest.mark.parametrize(
    "gate_up,out,exc,match",
    [
        (torch.ones(2, 8, dtype=torch.int32), None, TypeError, "gate_up must have dtype"),
        (torch.randn(2, 2, 8), None, ValueError, "gate_up must have 2 dimensions"),
        (torch.randn(2, 7), None, ValueError, "gate_up must have an even last dim"),
        (torch.randn(8, 2).t(), None, ValueError, "gate_up must have a contiguous last dim"),
        (torch.randn(2, 8), torch.empty(2, 8), ValueError, "out must have shape"),
        (torch.randn(2, 8), torch.empty(2, 4, dtype=torch.float16), TypeError, "out must have dtype"),
        (torch.randn(2, 8), torch.empty(4, 2).t(), ValueError, "out must have a contiguous last dim"),
        (torch.randn(2, 8), torch.empty(2, 4, device="meta"), ValueError, "out is on meta"),
    ],
)
def test_silu_mul_bad_input(gate_up, out, exc, match):
    with pytest.raises(exc, match=match):
        silu_mul(gate_up, out=out)


# ---------------------------------------------------------------- a block's worth, compiled and captured


def block(x, residual, norm_weight, qkv, positions, freq, gate_up, hq, hkv):
    """The four ops as a decoder layer calls them (q/k views of a fused QKV buffer)."""
    normed = add_rms_norm(x, residual, norm_weight, EPS)
    apply_rotary(qkv[:, :hq], qkv[:, hq : hq + hkv], positions, freq)
    return rms_norm(normed, norm_weight, EPS), silu_mul(gate_up)


def block_inputs(device):
    t, h, hq, hkv, d, i = 5, 48, 4, 2, 16, 40
    return (
        torch.randn(t, h, device=device),
        torch.randn(t, h, device=device),
        torch.randn(h, device=device),
        torch.randn(t, (hq + 2 * hkv), d, device=device),
        torch.arange(3, 3 + t, device=device),
        inv_freq(d).to(device),
        torch.randn(t, 2 * i, device=device),
        hq,
        hkv,
    )


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="checks the interpreter's accesses")
def test_no_lane_of_the_model_op_kernels_leaves_its_buffers():
    """Rows that fill no power-of-two tile: masked lanes address the last element, never past it."""
    x, r, w = torch.randn(3, 5), torch.randn(3, 5), torch.randn(5)
    q, k = torch.randn(2, 3, 6), torch.randn(2, 1, 6)  # 3 heads in a 4-head tile, 3 pairs in a 4-pair tile
    positions, inv_freq = torch.tensor([3, 9]), 10000.0 ** -(torch.arange(0, 6, 2) / 6)
    gate_up = torch.randn(2, 6)
    with use_backend("triton"), check_bounds():
        assert_close(rms_norm(x, w, EPS), rms_norm_reference(x, w, EPS), 2e-5, 2e-5)
        add_rms_norm(x, r, w, EPS)
        assert_close(silu_mul(gate_up), silu_mul_reference(gate_up), 2e-5, 2e-5)
        expected = apply_rotary_reference(q, k, positions, inv_freq)
        apply_rotary(q, k, positions, inv_freq)
    assert_close(q, expected[0], 2e-5, 2e-5)
    assert_close(k, expected[1], 2e-5, 2e-5)


def test_block_compiles_fullgraph(backend, device):
    eager_inputs = block_inputs(device)
    compiled_inputs = [a.clone() if isinstance(a, torch.Tensor) else a for a in eager_inputs]
    expected = block(*eager_inputs)
    got = torch.compile(block, fullgraph=True, dynamic=False)(*compiled_inputs)
    for a, b in zip(expected + eager_inputs[:4], got + tuple(compiled_inputs[:4])):
        assert torch.equal(a, b)  # outputs and the in-place updates (residual, q/k in the QKV buffer)


@pytest.mark.gpu
def test_block_cuda_graph_replay_equals_eager(backend):
    inputs = block_inputs("cuda")
    eager, static = ([a.clone() if isinstance(a, torch.Tensor) else a for a in inputs] for _ in range(2))
    expected = block(*eager)  # (also compiles the kernels before the capture)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # records the launches without running them
        outputs = block(*static)
    graph.replay()
    for a, b in zip(expected + tuple(eager[:4]), outputs + tuple(static[:4])):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_bf16(backend):
    # bf16 arithmetic is wrong in Triton 3.9's interpreter: bf16 runs on a GPU only
    dtype, device = torch.bfloat16, "cuda"
    x, residual = rows(33, 4096, dtype, device), rows(33, 4096, dtype, device)
    weight = torch.randn(4096).to(dtype).to(device)
    assert_close(rms_norm(x, weight, EPS), rms_norm_reference(x, weight, EPS), *TOL[dtype], "rms_norm bf16")
    expected_residual = residual + x
    expected = rms_norm_reference(expected_residual, weight, EPS)
    assert_close(add_rms_norm(x, residual, weight, EPS), expected, *TOL[dtype], "add_rms_norm bf16")
    assert torch.equal(residual, expected_residual)
    _, q, k, _ = fused_qkv(33, 32, 8, 128, dtype, device)
    positions = torch.randint(0, 32768, (33,), device=device)
    freq = inv_freq(128, 500000.0).to(device)
    expected_q, expected_k = apply_rotary_reference(q, k, positions, freq)
    apply_rotary(q, k, positions, freq)
    assert_close(q, expected_q, *TOL[dtype], "q bf16")
    assert_close(k, expected_k, *TOL[dtype], "k bf16")
    gate_up = (4 * torch.randn(33, 2 * 14336)).to(dtype).to(device)
    assert_close(silu_mul(gate_up), silu_mul_reference(gate_up), *TOL[dtype], "silu_mul bf16")
