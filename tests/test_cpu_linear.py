"""Multi-row CPU linear layers through oneDNN with packed weights (``specdec.model.cpu_linear``)."""

import pytest
import torch
import torch.nn.functional as F

from specdec.model import cpu_linear
from specdec.model.cpu_linear import PACK_MIN_ELEMENTS, linear_for, packed_linear

needs_onednn = pytest.mark.skipif(not cpu_linear.AVAILABLE, reason="this torch build has no oneDNN linear")
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


def test_linear_for_packs_only_multi_row_float32_cpu_inference():
    x = torch.randn(3, 8)
    with torch.inference_mode():
        assert linear_for(x) is (packed_linear if cpu_linear.AVAILABLE else F.linear)
        assert linear_for(x[:1]) is F.linear  # one row: F.linear is faster
        assert linear_for(x.half()) is F.linear
    assert linear_for(x) is F.linear  # autograd on: the packed op has no backward


@needs_onednn
def test_embedded_pair_decodes_the_same_with_and_without_packing(monkeypatch, torch_backend):
    """The embedded target's gate/up and LM head are packed in its multi-row forwards: greedy chains and
    batched decoding give the tokens of the unpacked GEMMs (on the PyTorch path the CPU runs: the
    interpreted attention kernel would only add minutes)."""
    from specdec.cli.demo import ASSETS, heldout_prompts, load_pair
    from specdec.decoding import DraftModelStrategy, SpeculativeDecoder

    target, draft, tokenizer = load_pair("cpu")
    prompts = [tokenizer.encode(p["text"]).ids for p in heldout_prompts(ASSETS)[:2]]
    runs = {}
    for packing in (True, False):
        monkeypatch.setattr(cpu_linear, "AVAILABLE", packing)
        for name, strategy in (("chain", DraftModelStrategy(draft, (1,) * 4)), ("plain", None)):
            runs[name, packing] = SpeculativeDecoder(target, strategy, adaptive=False).generate(
                prompts, max_new_tokens=16, eos_token_id=None
            ).tokens
    assert hasattr(target.model.layers[0].mlp.gate_up_proj.weight, "_specdec_onednn")
    assert runs["chain", True] == runs["chain", False] and runs["plain", True] == runs["plain", False]
