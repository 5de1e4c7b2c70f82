"""Multi-row CPU linear layers: the extension's skinny-GEMM kernel and oneDNN with packed weights
(``specdec.model.cpu_linear``)."""

import pytest
import torch
import torch.nn.functional as F
from helpers import (
    cpu_flags,
    generic_version_runs,
    random_eagle3_head,
    random_eagle_head,
    run_bench,
    run_python,
    table_rows,
    tiny_config,
)

from specdec import use_backend
from specdec.decoding import DraftModelStrategy, SpeculativeDecoder
from specdec.decoding.eagle import EagleStrategy
from specdec.model import LlamaModel, cpu_linear
from specdec.model.cpu_linear import PACK_MIN_ELEMENTS, linear_for, packed_linear, skinny_available, skinny_linear

needs_onednn = pytest.mark.skipif(not cpu_linear.AVAILABLE, reason="this torch build has no oneDNN linear")
needs_skinny = pytest.mark.skipif(not skinny_available(), reason="the extension (skinny_linear ops) is not built")
BIG = (PACK_MIN_ELEMENTS // 256, 256)  # the smallest weight that is packed: [N, K]


@needs_onednn
@pytest.mark.parametrize("rows", [2, 7, 33, 0])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_equals_f_linear(rows, with_bias):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(*BIG, generator=gen)
    bias = torch.randn(BIG[0], generator=gen) if with_bias else None
    x = torch.randn(rows, BIG[1], generator=gen)
    with torch.inference_mode():
        got = packed_linear(x, weight, bias)
    torch.testing.assert_close(got, F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)
    assert hasattr(weight, "_specdec_onednn")  # packed, and kept on the weight


@needs_onednn
def test_pack_follows_weight_changed_in_place_or_swapped():
    weight = torch.randn(*BIG)
    x = torch.randn(4, BIG[1])
    with torch.no_grad():
        packed_linear(x, weight)
        weight.mul_(-2.0)  # in place: the version moves
        torch.testing.assert_close(packed_linear(x, weight), F.linear(x, weight), rtol=1e-5, atol=1e-4)
        weight.data = torch.randn(*BIG)  # new storage under the same tensor
        torch.testing.assert_close(packed_linear(x, weight), F.linear(x, weight), rtol=1e-5, atol=1e-4)


@needs_onednn
def test_small_and_inference_weights_are_not_packed():
    small = torch.randn(BIG[0] // 2, BIG[1])
    x = torch.randn(3, BIG[1])
    with torch.inference_mode():
        torch.testing.assert_close(packed_linear(x, small), F.linear(x, small))
        frozen = torch.randn(*BIG)  # an inference tensor: no version counter to guard a pack with
        torch.testing.assert_close(packed_linear(x, frozen), F.linear(x, frozen))
    assert not hasattr(small, "_specdec_onednn") and not hasattr(frozen, "_specdec_onednn")


def test_linear_for_picks_by_rows_dtype_and_autograd(monkeypatch):
    x = torch.randn(3 * cpu_linear.SKINNY_MAX_ROWS, 8)
    multi_row = packed_linear if cpu_linear.AVAILABLE else F.linear
    skinny = cpu_linear.skinny_linear
    with torch.inference_mode():
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # the interpreted Triton path stands in for a GPU: F.linear
        assert linear_for(x[:2]) is F.linear and linear_for(x) is F.linear
        with use_backend("torch"):  # unless the PyTorch path is forced
            assert linear_for(x[:2]) is multi_row
        monkeypatch.setenv("TRITON_INTERPRET", "0")  # a CPU user's default
        assert linear_for(x[:1]) is (skinny if skinny_available() else F.linear)
        assert linear_for(x[: cpu_linear.SKINNY_MAX_ROWS]) is (skinny if skinny_available() else multi_row)
        assert linear_for(x[: cpu_linear.SKINNY_MAX_ROWS + 1]) is multi_row
        with use_backend("torch"):  # the PyTorch path: no extension op
            assert linear_for(x[:2]) is multi_row and linear_for(x[:1]) is F.linear
        assert linear_for(x.half()) is F.linear
    assert linear_for(x) is F.linear  # autograd on: the packed ops have no backward


@needs_skinny
def test_a_decoder_packs_its_models_weights_when_built(monkeypatch):
    """``SpeculativeDecoder`` makes the skinny packs of the target's, the draft's and an EAGLE head's linear weights
    when it is built, so their one-off cost does not land in the first decode step; with the Triton interpreter
    standing in for a GPU (``F.linear`` throughout) or the PyTorch backend forced, nothing is packed."""
    def fresh():
        return LlamaModel(tiny_config(vocab_size=64)).requires_grad_(False)

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    target = fresh()
    SpeculativeDecoder(target, None)
    with use_backend("torch"):
        SpeculativeDecoder(target, None)
    assert not any(hasattr(w, "_specdec_skinny") for w in target.linear_weights())
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # a CPU user's default
    target, draft = fresh(), fresh()
    SpeculativeDecoder(target, DraftModelStrategy(draft, (1, 1)))
    weights = target.linear_weights() + draft.linear_weights()
    assert len(weights) == 2 * (4 * target.config.num_layers + 1)
    assert all(hasattr(w, "_specdec_skinny") for w in weights)
    eagle = random_eagle_head(target, seed=0).set_draft_vocabulary(range(0, 64, 2))
    for head in (eagle, random_eagle3_head(target, seed=0, draft_vocab=20)):
        SpeculativeDecoder(target, EagleStrategy(head, tree_budget=4, depth=2, top_k=2))
        weights = head.linear_weights()  # an EAGLE head's: fc, its layer, its LM head (the draft vocabulary's rows)
        assert len(weights) == 6 and weights[-1].shape[0] in (20, 32)
        assert all(hasattr(w, "_specdec_skinny") for w in weights)


def _assert_linear(got, x, weight, bias=None):
    """``got`` is float32 ``F.linear(x, weight, bias)`` up to float32 rounding (against float64)."""
    ref = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5 * x.shape[-1] ** 0.5)


@needs_skinny
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 5, 8, 9, 16, 17, 40])
@pytest.mark.parametrize("out_features, in_features", [(512, 256), (13, 7), (8, 1), (4096, 64)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_skinny_linear_equals_float64_reference(rows, out_features, in_features, with_bias):
    """Every row count (one pass of up to 8 rows, several passes, none), output widths that are not a multiple
    of the 8-wide blocks, k sums split in 1-8 partial sums (in_features 1 and 7 leave remainders)."""
    gen = torch.Generator().manual_seed(rows * 1000 + out_features + in_features)
    weight = torch.randn(out_features, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen) if with_bias else None
    x = torch.randn(rows, in_features, generator=gen)
    with torch.no_grad():
        got = skinny_linear(x, weight, bias)
    assert got.shape == (rows, out_features) and got.dtype == torch.float32
    _assert_linear(got, x, weight, bias)
    assert hasattr(weight, "_specdec_skinny")  # packed, and kept on the weight


@needs_skinny
def test_skinny_linear_takes_strided_rows_and_leading_dims():
    weight, wide = torch.randn(24, 32), torch.randn(5, 48)
    x = wide[:, 8:40]  # rows 48 apart, unit stride along the features
    with torch.no_grad():
        _assert_linear(skinny_linear(x, weight), x, weight)
        batched = torch.randn(2, 3, 32)
        _assert_linear(skinny_linear(batched, weight), batched, weight)
        columns = torch.randn(32, 4).t()  # unit stride along the rows: copied to rows first
        _assert_linear(skinny_linear(columns, weight), columns, weight)


@needs_skinny
def test_skinny_linear_splits_the_outputs_over_threads():
    """With several intra-op threads each takes its own blocks of output features: the same result."""
    gen = torch.Generator().manual_seed(3)
    weight, x = torch.randn(1000, 64, generator=gen), torch.randn(11, 64, generator=gen)
    threads = torch.get_num_threads()
    try:
        with torch.no_grad():
            torch.set_num_threads(1)
            one = skinny_linear(x, weight)
            torch.set_num_threads(3)
            several = skinny_linear(x, weight)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, several)  # each output is the same sum, whichever thread computes it
    _assert_linear(several, x, weight)


@needs_skinny
def test_skinny_pack_layout_and_refresh():
    weight = torch.arange(10 * 3, dtype=torch.float32).view(10, 3)
    packed = torch.ops.specdec.skinny_linear_pack(weight)
    assert packed.shape == (2, 3, 8)
    assert torch.equal(packed[0], weight[:8].t()) and torch.equal(packed[1, :, :2], weight[8:].t())
    assert not packed[1, :, 2:].any()  # zero padding past the last feature
    x = torch.randn(3, 3)
    with torch.no_grad():
        skinny_linear(x, weight)
        weight.mul_(-2.0)  # in place: the version moves, the pack is made again
        _assert_linear(skinny_linear(x, weight), x, weight)
        weight.data = torch.randn(10, 3)  # new storage under the same tensor
        _assert_linear(skinny_linear(x, weight), x, weight)


@needs_skinny
def test_bfloat16_pack_layout_and_the_float32_packs_bits():
    """A weight of bfloat16 values packs to bfloat16, features k and k + 1 side by side per lane
    ([blocks, ceil(K / 2), 16]); the kernel widens it exactly, so every row count, both summation orders and odd
    feature counts give the float32 pack's bits."""
    weight = torch.arange(10 * 3, dtype=torch.float32).view(10, 3)
    packed = torch.ops.specdec.skinny_linear_pack(weight, True)
    assert packed.dtype == torch.bfloat16 and packed.shape == (2, 2, 16)
    assert torch.equal(packed[0, 0].float(), weight[:8, :2].reshape(-1))  # lane j: features 0 and 1
    assert torch.equal(packed[0, 1, 0::2].float(), weight[:8, 2]) and not packed[0, 1, 1::2].any()  # K padded
    gen = torch.Generator().manual_seed(5)
    for n, k in ((37, 29), (512, 256), (40, 300), (9, 1)):
        weight = torch.randn(n, k, generator=gen).bfloat16().float()
        bias = torch.randn(n, generator=gen)
        wide, narrow = torch.ops.specdec.skinny_linear_pack(weight), torch.ops.specdec.skinny_linear_pack(weight, True)
        for rows in (1, 2, 3, 4, 5, 8, 11, 17):
            x = torch.randn(rows, k, generator=gen)
            for row_invariant in (False, True):
                got = torch.ops.specdec.skinny_linear(x, narrow, n, bias, row_invariant)
                assert torch.equal(got, torch.ops.specdec.skinny_linear(x, wide, n, bias, row_invariant))
        _assert_linear(got, x, weight, bias)


@needs_skinny
def test_skinny_pack_is_bfloat16_for_weights_of_bfloat16_values():
    """The model's packs: bfloat16 for a weight of bfloat16 values (a bfloat16 checkpoint's), large or small, float32
    for other values (the pack op refuses them by name)."""
    gen = torch.Generator().manual_seed(6)
    large = torch.randn(*BIG, generator=gen)
    small = torch.randn(64, 64, generator=gen)
    assert cpu_linear.skinny_pack(large.bfloat16().float()).dtype == torch.bfloat16
    assert cpu_linear.skinny_pack(small.bfloat16().float()).dtype == torch.bfloat16
    assert cpu_linear.skinny_pack(large).dtype == torch.float32
    assert cpu_linear.skinny_pack(small).dtype == torch.float32
    with pytest.raises(ValueError, match="bf16=True needs a weight whose every value is a bfloat16"):
        torch.ops.specdec.skinny_linear_pack(large, True)


@needs_skinny
@pytest.mark.parametrize(
    "call, match",
    [
        (lambda p: torch.ops.specdec.skinny_linear(torch.randn(2, 4).double(), p, 10), "x must be a float32"),
        (lambda p: torch.ops.specdec.skinny_linear(torch.randn(4), p, 10), "x must be a 2-D"),
        (lambda p: torch.ops.specdec.skinny_linear(torch.randn(4, 2).t(), p, 10), "x must be a 2-D"),
        (lambda p: torch.ops.specdec.skinny_linear(torch.randn(2, 5), p, 10), "x has 5 in_features"),
        (lambda p: torch.ops.specdec.skinny_linear(torch.randn(2, 4), p, 17), "out_features=17"),
        (lambda p: torch.ops.specdec.skinny_linear(torch.randn(2, 4), p, 8), "out_features=8"),
        (lambda p: torch.ops.specdec.skinny_linear(torch.randn(2, 4), p[:, :, :4], 10), "packed must be"),
        (lambda p: torch.ops.specdec.skinny_linear(torch.randn(2, 4), p.half(), 10), "packed must be a float32 or"),
        (lambda p: torch.ops.specdec.skinny_linear(torch.randn(2, 4), p.bfloat16(), 10), "packed must be a contig"),
        (lambda p: torch.ops.specdec.skinny_linear(torch.randn(2, 4), p, 10, torch.randn(9)), "bias must be"),
        (lambda p: torch.ops.specdec.skinny_linear_pack(torch.randn(3)), "weight must be a non-empty 2-D"),
        (lambda p: torch.ops.specdec.skinny_linear_pack(torch.randn(0, 3)), "weight must be a non-empty 2-D"),
        (lambda p: torch.ops.specdec.skinny_linear_pack(torch.randn(3, 3).half()), "weight must be a float32"),
    ],
)
def test_skinny_ops_name_the_bad_argument(call, match):
    packed = torch.ops.specdec.skinny_linear_pack(torch.randn(10, 4))
    with pytest.raises(ValueError, match=match):
        call(packed)


@needs_skinny
def test_skinny_opcheck():
    weight, bias = torch.randn(20, 16), torch.randn(20)
    weight = weight.bfloat16().float()  # so that it packs either way
    packs = [torch.ops.specdec.skinny_linear_pack(weight, bf16) for bf16 in (False, True)]
    torch.library.opcheck(torch.ops.specdec.skinny_linear_pack.default, (weight,))
    torch.library.opcheck(torch.ops.specdec.skinny_linear_pack.default, (weight, True))
    for rows in (1, 6, 11):
        x = torch.randn(rows, 16)
        for packed in packs:
            torch.library.opcheck(torch.ops.specdec.skinny_linear.default, (x, packed, 20, bias))
            torch.library.opcheck(torch.ops.specdec.skinny_linear.default, (x, packed, 20, None))


GENERIC_CHECK = """
import torch, torch.nn.functional as F
from specdec.model.cpu_linear import skinny_linear
g = torch.Generator().manual_seed(0)
for rows in (1, 2, 5, 8, 11):
    w, b, x = torch.randn(37, 29, generator=g), torch.randn(37, generator=g), torch.randn(rows, 29, generator=g)
    with torch.no_grad():
        got = skinny_linear(x, w, b)
    ref = F.linear(x.double(), w.double(), b.double())
    assert torch.allclose(got.double(), ref, rtol=1e-5, atol=1e-4), (rows, (got.double() - ref).abs().max())
    print(got.numpy().tobytes().hex())
"""


@needs_skinny
def test_skinny_generic_version_equals_reference():
    """The version for CPUs without AVX2 + FMA (and every non-x86 CPU), forced by its environment switch in a fresh
    process (the choice is made once per process). Where this CPU has AVX2 + FMA, the two versions must round
    differently somewhere (fused multiply-adds against separate ones): the switch took effect."""
    runs = generic_version_runs(GENERIC_CHECK, "SPECDEC_SKINNY_GENERIC")
    assert len(runs["1"]) == 5


WIDE_CHECK = """
import torch
from specdec.model.cpu_linear import skinny_linear
print(torch.ops.specdec.skinny_linear_version())
g = torch.Generator().manual_seed(0)
for rows in (1, 2, 3, 5, 8, 11, 16):
    for n, k in ((37, 29), (40, 300), (512, 256), (24, 3)):  # odd and even block counts, K below one partial sum
        w, b, x = torch.randn(n, k, generator=g), torch.randn(n, generator=g), torch.randn(rows, k, generator=g)
        w = w.bfloat16().float()  # both packs
        for packed in (torch.ops.specdec.skinny_linear_pack(w), torch.ops.specdec.skinny_linear_pack(w, True)):
            for row_invariant in (False, True):
                got = torch.ops.specdec.skinny_linear(x, packed, n, b, row_invariant)
                ref = torch.nn.functional.linear(x.double(), w.double(), b.double())
                assert torch.allclose(got.double(), ref, rtol=1e-5, atol=1e-4), (rows, n, k, row_invariant)
                print(got.numpy().tobytes().hex())
"""


@needs_skinny
@pytest.mark.skipif(not cpu_flags() >= {"avx512f", "avx2", "fma"}, reason="this CPU runs no AVX-512 version")
def test_skinny_avx512_version_gives_the_avx2_versions_bits():
    """On an AVX-512 CPU the kernel runs two packed blocks as one 16-lane vector, each sum in the AVX2 version's
    order: the same bits, in both summation orders and from both packs (SPECDEC_SKINNY_AVX2=1 forces the AVX2
    version in a fresh process; the choice is made once per process)."""
    runs = {avx2: run_python(WIDE_CHECK, {"SPECDEC_SKINNY_AVX2": avx2}).split() for avx2 in ("1", "0")}
    if runs["0"][0] == "avx2":
        pytest.skip("the extension was built without the AVX-512 version (a compiler without __builtin_shufflevector)")
    assert runs["1"][0] == "avx2" and runs["0"][0] == "avx512"
    assert len(runs["1"]) == 1 + 7 * 4 * 2 * 2 and runs["1"][1:] == runs["0"][1:]


@needs_skinny
def test_embedded_pair_decodes_the_same_with_and_without_the_skinny_kernel(monkeypatch):
    """On a CPU's default path (the extension's ops; no Triton interpreter), batched decoding (6 rows) and chain
    verification (5 rows) run the skinny kernel: the tokens are those of the oneDNN / F.linear GEMMs, and the
    multi-row logits agree."""
    from specdec.testing import heldout_token_ids, load_pair

    monkeypatch.setenv("TRITON_INTERPRET", "0")  # what a CPU user runs (the interpreted kernels take minutes)

    target, draft, tokenizer = load_pair("cpu")
    prompts = heldout_token_ids(tokenizer)[:6]
    runs = {}
    for skinny in (True, False):
        monkeypatch.setattr(cpu_linear, "SKINNY_MAX_ROWS", cpu_linear.SKINNY_MAX_ROWS if skinny else 0)
        runs[skinny] = _chain_and_batch_tokens(target, draft, prompts[:1], prompts, 24)
    assert hasattr(target.model.layers[0].mlp.gate_up_proj.weight, "_specdec_skinny")
    assert runs[True] == runs[False]
    hidden = torch.randn(6, target.config.hidden_size, generator=torch.Generator().manual_seed(0))
    head = target.lm_head_weight
    with torch.no_grad():
        torch.testing.assert_close(skinny_linear(hidden, head), F.linear(hidden, head), rtol=1e-5, atol=1e-4)


@needs_onednn
def test_embedded_pair_decodes_the_same_with_and_without_packing(monkeypatch, torch_backend):
    """The embedded target's gate/up and LM head are packed in its multi-row forwards: greedy chains and
    batched decoding give the tokens of the unpacked GEMMs (on the PyTorch path the CPU runs: the
    interpreted attention kernel would only add minutes)."""
    from specdec.testing import heldout_token_ids, load_pair

    target, draft, tokenizer = load_pair("cpu")
    prompts = heldout_token_ids(tokenizer)[:2]
    runs = {}
    for packing in (True, False):
        monkeypatch.setattr(cpu_linear, "AVAILABLE", packing)
        runs[packing] = _chain_and_batch_tokens(target, draft, prompts, prompts, 16)
    assert hasattr(target.model.layers[0].mlp.gate_up_proj.weight, "_specdec_onednn")
    assert runs[True] == runs[False]


def _chain_and_batch_tokens(target, draft, chain_prompts, batch_prompts, new_tokens):
    """Greedy tokens of a K=4 draft chain over ``chain_prompts`` and of plain decoding of ``batch_prompts`` in one
    batch (fixed sizes: no controller)."""
    from specdec.decoding import DraftModelStrategy, SpeculativeDecoder

    return [
        SpeculativeDecoder(target, strategy, adaptive=False).generate(prompts, max_new_tokens=new_tokens,
                                                                     eos_token_id=None).tokens
        for strategy, prompts in ((DraftModelStrategy(draft, (1,) * 4), chain_prompts), (None, batch_prompts))
    ]  # fmt: skip


def test_the_gemm_benchmark_runs_and_names_what_the_model_runs(tmp_path):
    """``bench/bench_cpu_linear.py --dry-run``: one timed call per cell, the table written, every row's last
    column one of the three GEMMs (the skinny column only with the extension)."""
    done = run_bench("bench_cpu_linear.py", "--dry-run", "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr
    rows = table_rows(tmp_path / "cpu_linear.md", "qkv")
    assert len(rows) == 2 and {cells[-1] for cells in rows} <= {"F.linear", "packed", "skinny"}
    assert ("skinny us" in (tmp_path / "cpu_linear.md").read_text()) == skinny_available()


@needs_skinny
def test_the_policy_benchmark_runs_every_case(tmp_path):
    """``bench/bench_gemm_policy.py --dry-run``: one pair per case, the table written with a positive ratio for each
    case (decodes and prefills)."""
    done = run_bench("bench_gemm_policy.py", "--dry-run", "--out", str(tmp_path), cpu_path=True)
    assert done.returncode == 0, done.stderr
    text = (tmp_path / "gemm_policy.md").read_text()
    rows = [line.split("|")[1:-1] for line in text.splitlines() if line.startswith("| ") and "x |" in line]
    assert len(rows) == 10 and all(float(cells[2].strip().rstrip("x")) > 0 for cells in rows), text
    assert sum("prefill" in cells[0] for cells in rows) == 3
