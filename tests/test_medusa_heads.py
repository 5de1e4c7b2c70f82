"""Medusa heads: the authors' layout loads and computes the Medusa head math; misfits are refused."""

import json
import re
import subprocess
import sys

import pytest
import torch
from helpers import assert_close
from safetensors.torch import save_file

from specdec.model import LlamaModel, ModelConfig
from specdec.model.medusa import MedusaHeads

HIDDEN, VOCAB = 48, 80


@pytest.fixture(scope="module")
def target():
    config = ModelConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_layers=1, num_heads=4,
                         num_kv_heads=2, head_dim=12, tie_word_embeddings=True)  # fmt: skip
    return LlamaModel(config).requires_grad_(False).eval()


def authors_tensors(num_heads=4, num_layers=1, hidden=HIDDEN, vocab=VOCAB) -> dict[str, torch.Tensor]:
    """Random tensors under the Medusa authors' names: ``i.{l}.linear.weight/bias`` blocks, ``i.{L}.weight``."""
    tensors = {}
    for i in range(num_heads):
        for l in range(num_layers):
            tensors[f"{i}.{l}.linear.weight"] = torch.randn(hidden, hidden) / hidden**0.5
            tensors[f"{i}.{l}.linear.bias"] = torch.randn(hidden)
        tensors[f"{i}.{num_layers}.weight"] = torch.randn(vocab, hidden) / hidden**0.5
    return tensors


def write_heads(path, tensors, num_heads=4, num_layers=1, **extra):
    path.mkdir(parents=True, exist_ok=True)
    config = {"medusa_num_heads": num_heads, "medusa_num_layers": num_layers, "base_model_name_or_path": "x", **extra}
    (path / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(path / "medusa_lm_head.safetensors"))
    return path


def medusa_reference(tensors, hidden, num_heads, num_layers):
    """Head by head, in float64: y = h; y += SiLU(W y + b) per block; logits = P y."""
    out = []
    for i in range(num_heads):
        y = hidden.double()
        for l in range(num_layers):
            w, b = tensors[f"{i}.{l}.linear.weight"].double(), tensors[f"{i}.{l}.linear.bias"].double()
            y = y + torch.nn.functional.silu(y @ w.T + b)
        out.append(y @ tensors[f"{i}.{num_layers}.weight"].double().T)
    return torch.stack(out)


@pytest.mark.parametrize("num_heads, num_layers", [(4, 1), (3, 2), (2, 0)])
def test_authors_layout_loads_and_matches_the_reference(tmp_path, target, num_heads, num_layers):
    tensors = authors_tensors(num_heads, num_layers)
    heads = MedusaHeads.from_pretrained(write_heads(tmp_path, tensors, num_heads, num_layers), target)
    assert (heads.num_heads, heads.num_layers, heads.dtype) == (num_heads, num_layers, torch.float32)
    assert not any(p.requires_grad for p in heads.parameters())
    hidden = torch.randn(13, HIDDEN)
    logits = heads(hidden)
    assert logits.shape == (num_heads, 13, VOCAB)
    assert_close(logits, medusa_reference(tensors, hidden, num_heads, num_layers), 1e-4, 1e-4, "medusa logits")

    heads.save_pretrained(tmp_path / "again")  # and back: the saved layout is the authors'
    saved = json.loads((tmp_path / "again" / "config.json").read_text())
    assert (saved["medusa_num_heads"], saved["medusa_num_layers"]) == (num_heads, num_layers)
    again = MedusaHeads.from_pretrained(tmp_path / "again", target)
    assert torch.equal(again(hidden), logits)


def test_fresh_heads_start_as_the_lm_head(target):
    heads = MedusaHeads(HIDDEN, VOCAB, num_heads=3)
    heads.init_from_lm_head(target.lm_head_weight)
    hidden = torch.randn(5, HIDDEN)
    # Zero blocks are SiLU(0) = 0 added to the input: every head starts as the target's LM head.
    expected = (hidden @ target.lm_head_weight.T).expand(3, -1, -1)
    assert_close(heads(hidden), expected, 1e-5, 1e-5, "initial heads")


def test_bfloat16_target(tmp_path, target):
    heads = MedusaHeads.from_pretrained(write_heads(tmp_path, authors_tensors()), target.to(torch.bfloat16))
    target.float()
    assert heads.dtype == torch.bfloat16
    assert heads(torch.randn(2, HIDDEN, dtype=torch.bfloat16)).dtype == torch.bfloat16


@pytest.mark.parametrize(
    "tensors, config, match",
    [
        (authors_tensors(vocab=VOCAB + 8), {}, "does not fit the target: its vocab_size is 88, the target's is 80"),
        (authors_tensors(hidden=32), {}, "does not fit the target: its hidden_size is 32, the target's is 48"),
        (authors_tensors(), {"hidden_size": 64}, r"config.json says hidden_size 64 but '0.1.weight' has shape"),
        (authors_tensors(), {"medusa_num_heads": 3}, "holds tensor '3.0.linear.bias' that this config does not"),
        (authors_tensors(), {"medusa_num_heads": 5}, r"lacks tensor '4.0.linear.weight' \(expected shape \(48, 48\)"),
        (authors_tensors(), {"medusa_num_layers": 2}, "lacks tensor '0.2.weight', head 0's projection"),
        (authors_tensors(), {"medusa_num_heads": 0}, "'medusa_num_heads' must be an int >= 1, got 0"),
        (authors_tensors(), {"medusa_num_heads": None}, "'medusa_num_heads' must be an int >= 1, got None"),
        (authors_tensors(), {"medusa_num_layers": 1.0}, "'medusa_num_layers' must be an int >= 0, got 1.0"),
    ],
)
def test_heads_that_do_not_fit_are_refused(tmp_path, target, tensors, config, match):
    path = write_heads(tmp_path, tensors)
    written = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**written, **config}))
    with pytest.raises(ValueError, match=match):
        MedusaHeads.from_pretrained(path, target)


def test_wrong_block_shape_is_refused_by_name(tmp_path, target):
    tensors = authors_tensors()
    tensors["2.0.linear.bias"] = torch.randn(HIDDEN + 1)
    with pytest.raises(ValueError, match=r"'2.0.linear.bias' .* shape \(49,\), expected \(48,\)"):
        MedusaHeads.from_pretrained(write_heads(tmp_path, tensors), target)


def test_pickle_is_refused_with_a_conversion_that_works(tmp_path, target):
    tensors = authors_tensors()
    path = tmp_path / "heads"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"medusa_num_heads": 4, "medusa_num_layers": 1}))
    torch.save(tensors, path / "medusa_lm_head.pt")
    with pytest.raises(ValueError, match="holds only medusa_lm_head.pt, a pickle checkpoint") as info:
        MedusaHeads.from_pretrained(path, target)
    command = re.search(r'python -c "(.*)"', str(info.value)).group(1)
    subprocess.run([sys.executable, "-c", command], check=True, timeout=120)
    hidden = torch.randn(3, HIDDEN)
    assert_close(MedusaHeads.from_pretrained(path, target)(hidden), medusa_reference(tensors, hidden, 4, 1), 1e-4,
                 1e-4, "converted heads")  # fmt: skip


def test_bad_arguments(tmp_path, target):
    with pytest.raises(ValueError, match="num_heads must be an int >= 1"):
        MedusaHeads(HIDDEN, VOCAB, num_heads=0)
    with pytest.raises(ValueError, match="num_layers must be an int >= 0"):
        MedusaHeads(HIDDEN, VOCAB, num_layers=-1)
    with pytest.raises(TypeError, match="target must be a LlamaModel"):
        MedusaHeads.from_pretrained(tmp_path, None)
    with pytest.raises(ValueError, match="no config.json"):
        MedusaHeads.from_pretrained(tmp_path, target)
    (tmp_path / "config.json").write_text(json.dumps({"medusa_num_heads": 4, "medusa_num_layers": 1}))
    with pytest.raises(ValueError, match="has neither medusa_lm_head.safetensors nor"):
        MedusaHeads.from_pretrained(tmp_path, target)
    heads = MedusaHeads(HIDDEN, VOCAB)
    with pytest.raises(TypeError, match="hidden must have dtype float32"):
        heads(torch.randn(2, HIDDEN, dtype=torch.float64))
    with pytest.raises(ValueError, match="hidden must have 48 columns"):
        heads(torch.randn(2, HIDDEN + 1))
    with pytest.raises(ValueError, match="hidden must have 2 dimensions"):
        heads(torch.randn(HIDDEN))
    with pytest.raises(ValueError, match="lm_head_weight must have shape"):
        heads.init_from_lm_head(torch.randn(VOCAB, HIDDEN + 1))
