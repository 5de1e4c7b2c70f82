"""Config parsing and safetensors checkpoint loading: what loads, and every way a checkpoint is refused."""

import json

import pytest
import torch
from safetensors.torch import save_file

from specdec.model.config import ModelConfig, RopeScaling
from specdec.model.llama import LlamaModel
from specdec.model.loader import checkpoint_files, load_tensors

HF_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 48,
    "hidden_size": 32,
    "intermediate_size": 40,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
    "tie_word_embeddings": False,
    "eos_token_id": [2, 7],
    "hidden_act": "silu",
}


def write_checkpoint(path, hf=None, tensors=None):
    """config.json + model.safetensors with random values for every tensor the config needs."""
    hf = dict(HF_CONFIG if hf is None else hf)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf))
    if tensors is None:
        model = LlamaModel(ModelConfig.from_hf(hf))
        tensors = {name: torch.randn(shape) for name, shape in model.expected_tensors().items()}
    save_file(tensors, str(path / "model.safetensors"))
    return tensors


def test_config_from_transformers5_format():
    c = ModelConfig.from_hf(HF_CONFIG)
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (2, 4, 2, 16)
    assert c.rope_theta == 500000.0 and c.rope_scaling is None
    assert c.eos_token_ids == (2, 7) and not c.tie_word_embeddings
    assert (c.qkv_bias, c.o_bias, c.mlp_bias) == (False, False, False)


def test_config_from_transformers4_format():
    hf = {k: v for k, v in HF_CONFIG.items() if k not in ("rope_parameters", "head_dim", "num_key_value_heads")}
    hf.update(
        rope_theta=1234.0,
        rope_scaling={"type": "linear", "factor": 4.0},
        eos_token_id=5,
        attention_bias=True,
        tie_word_embeddings=True,
    )
    c = ModelConfig.from_hf(hf)
    assert c.head_dim == 32 // 4 and c.num_kv_heads == 4
    assert c.rope_theta == 1234.0 and c.rope_scaling == RopeScaling("linear", 4.0)
    assert c.eos_token_ids == (5,) and c.tie_word_embeddings and c.qkv_bias and c.o_bias
    torch.testing.assert_close(c.rope_inv_freq(), ModelConfig.from_hf(dict(hf, rope_scaling=None)).rope_inv_freq() / 4)


def test_config_llama3_rope_bands():
    hf = dict(HF_CONFIG, head_dim=64, hidden_size=256, num_attention_heads=4)
    hf["rope_parameters"] = {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    }
    scaled = ModelConfig.from_hf(hf).rope_inv_freq()
    plain = ModelConfig.from_hf(dict(hf, rope_parameters={"rope_theta": 10000.0})).rope_inv_freq()
    wavelen = 2 * torch.pi / plain
    high, low = wavelen < 256 / 4, wavelen > 256 / 1
    assert high.any() and low.any() and (~high & ~low).any()  # all three bands are exercised
    torch.testing.assert_close(scaled[high], plain[high])
    torch.testing.assert_close(scaled[low], plain[low] / 8)
    mid = scaled[~high & ~low] / plain[~high & ~low]
    assert ((mid > 1 / 8) & (mid < 1)).all()


def test_qwen2_and_mistral_biases():
    qwen = ModelConfig.from_hf(dict(HF_CONFIG, architectures=["Qwen2ForCausalLM"], model_type="qwen2"))
    assert (qwen.qkv_bias, qwen.o_bias) == (True, False)
    mistral = ModelConfig.from_hf(
        dict(HF_CONFIG, architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=64)
    )
    assert (mistral.qkv_bias, mistral.o_bias, mistral.sliding_window) == (False, False, 64)


@pytest.mark.parametrize(
    "change, match",
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "unsupported architecture"),
        ({"architectures": None, "model_type": "gemma"}, "unsupported model_type 'gemma'"),
        ({"model_type": "qwen2"}, "model_type 'qwen2' does not match"),
        ({"hidden_act": "gelu"}, "unsupported hidden_act 'gelu'"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "unsupported rope type 'yarn'"),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "unsupported rope type 'dynamic'"),
        ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0}}, "llama3.*low_freq_factor"),
        ({"rope_parameters": {"rope_type": "linear"}}, "needs 'factor'"),
        ({"quantization_config": {"quant_method": "gptq"}}, "unsupported quantization_config"),
        ({"use_sliding_window": True}, "unsupported use_sliding_window"),
        ({"partial_rotary_factor": 0.5}, "unsupported partial_rotary_factor"),
        ({"layer_types": ["full_attention", "sliding_attention"]}, "unsupported layer_types"),
        ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
        ({"head_dim": 15}, "head_dim must be a positive even int"),
        ({"vocab_size": None}, "lacks 'vocab_size'"),
    ],
)
def test_unsupported_config_is_refused(tmp_path, change, match):
    hf = dict(HF_CONFIG, **change)
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf(hf)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(ValueError, match=match):
        LlamaModel.from_pretrained(tmp_path)


@pytest.mark.parametrize(
    "change, error, match",
    [
        ({"rms_norm_eps": "abc"}, TypeError, r"^config.json rms_norm_eps must be a number, got 'abc' \(str\)$"),
        ({"rms_norm_eps": -1e-5}, ValueError, r"^config.json rms_norm_eps must be a finite number > 0.0, got -1e-05$"),
        ({"rms_norm_eps": True}, TypeError, r"^config.json rms_norm_eps must be a number, got True"),
        ({"max_position_embeddings": "512"}, TypeError, r"^config.json max_position_embeddings must be an int, got '5"),
        ({"max_position_embeddings": 512.5}, TypeError, r"^config.json max_position_embeddings must be an int, got 5"),
        ({"max_position_embeddings": 0}, ValueError, r"^config.json max_position_embeddings must be an int >= 1, got"),
        ({"hidden_size": "32"}, TypeError, r"^config.json hidden_size must be an int, got '32'"),
        ({"num_attention_heads": 0}, ValueError, r"^config.json num_attention_heads must be an int >= 1, got 0$"),
        ({"head_dim": 16.0}, TypeError, r"^config.json head_dim must be an int, got 16.0"),
        ({"rope_parameters": {"rope_theta": "1e4"}}, TypeError, r"^config.json rope_theta must be a number, got '1e4'"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 0}}, ValueError, r"json rope scaling factor must be a"),
        ({"tie_word_embeddings": "false"}, TypeError, r"^config.json tie_word_embeddings must be true or false, got"),
        ({"eos_token_id": [2, "x"]}, TypeError, r"^config.json eos_token_id\[1\] must be an int, got 'x'"),
        ({"bos_token_id": -1}, ValueError, r"^config.json bos_token_id must be an int >= 0, got -1$"),
    ],
)
def test_config_values_of_the_wrong_kind_are_refused_by_name(tmp_path, change, error, match):
    hf = dict(HF_CONFIG, **change)
    with pytest.raises(error, match=match):
        ModelConfig.from_hf(hf)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    with pytest.raises(error, match=match):
        LlamaModel.from_pretrained(tmp_path)


def test_loads_values_dtype_and_tied_embeddings(tmp_path):
    tensors = write_checkpoint(tmp_path)
    model = LlamaModel.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16 and not any(p.requires_grad for p in model.parameters())
    state = model.hf_state_dict()
    assert set(state) == set(tensors)
    for name, t in tensors.items():
        assert torch.equal(state[name], t.to(torch.bfloat16)), name
    torch.testing.assert_close(model.rope_inv_freq, model.config.rope_inv_freq())

    tied_dir = tmp_path / "tied"
    hf = dict(HF_CONFIG, tie_word_embeddings=True)
    tied = write_checkpoint(tied_dir, hf, tensors)  # a stored lm_head.weight is ignored when tied
    model = LlamaModel.from_pretrained(tied_dir)
    assert model.lm_head is None and model.lm_head_weight is model.model.embed_tokens.weight
    assert torch.equal(model.lm_head_weight, tied["model.embed_tokens.weight"])


def test_sharded_checkpoint(tmp_path):
    tensors = {name: t for name, t in write_checkpoint(tmp_path / "one").items()}
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in shards.items():
        save_file({n: tensors[n] for n in part}, str(tmp_path / file))
    weight_map = {n: file for file, part in shards.items() for n in part}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (tmp_path / "config.json").write_text(json.dumps(HF_CONFIG))
    assert {f.name for f in checkpoint_files(tmp_path).values()} == set(shards)
    state = LlamaModel.from_pretrained(tmp_path).hf_state_dict()
    for name, t in tensors.items():
        assert torch.equal(state[name], t), name

    weight_map[names[0]] = "model-00003-of-00002.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ValueError, match=f"puts tensor '{names[0]}' in 'model-00003-of-00002.safetensors'"):
        LlamaModel.from_pretrained(tmp_path)
    weight_map[names[0]] = "model-00002-of-00002.safetensors"  # the index lies about where it is
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ValueError, match=f"lacks tensor '{names[0]}', although the index"):
        LlamaModel.from_pretrained(tmp_path)


def test_missing_tensor(tmp_path):
    tensors = write_checkpoint(tmp_path)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    write_checkpoint(tmp_path, tensors=tensors)
    with pytest.raises(
        ValueError, match=r"lacks tensor 'model.layers.1.mlp.up_proj.weight' \(expected shape \(40, 32\)"
    ):
        LlamaModel.from_pretrained(tmp_path)


def test_wrong_shape(tmp_path):
    tensors = write_checkpoint(tmp_path)
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.randn(64, 32)
    write_checkpoint(tmp_path, tensors=tensors)
    with pytest.raises(
        ValueError, match=r"'model.layers.0.self_attn.k_proj.weight' .* shape \(64, 32\), expected \(32, 32\)"
    ):
        LlamaModel.from_pretrained(tmp_path)


def test_tensor_the_config_does_not_use(tmp_path):
    tensors = write_checkpoint(tmp_path)
    tensors["model.layers.0.self_attn.q_proj.bias"] = torch.randn(64)  # a bias config.json does not announce
    write_checkpoint(tmp_path, tensors=tensors)
    with pytest.raises(ValueError, match="'model.layers.0.self_attn.q_proj.bias' that this config does not use"):
        LlamaModel.from_pretrained(tmp_path)


def test_corrupt_and_truncated_files(tmp_path):
    write_checkpoint(tmp_path)
    file = tmp_path / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="not a valid safetensors file"):
        LlamaModel.from_pretrained(tmp_path)
    file.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}" + data[100:])
    with pytest.raises(ValueError, match="not a valid safetensors file"):
        LlamaModel.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{broken")
    with pytest.raises(ValueError, match="config.json is not valid JSON"):
        LlamaModel.from_pretrained(tmp_path)


def test_pickle_and_missing_files_are_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(HF_CONFIG))
    with pytest.raises(ValueError, match="neither model.safetensors nor model.safetensors.index.json"):
        LlamaModel.from_pretrained(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"pickle would run code")
    with pytest.raises(ValueError, match="never pickle"):
        LlamaModel.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="no config.json"):
        LlamaModel.from_pretrained(tmp_path / "absent")
    with pytest.raises(ValueError, match="is not a directory"):
        load_tensors(tmp_path / "absent", {}, dtype=torch.float32, device="cpu")
    with pytest.raises(TypeError, match="dtype must be float32, float16 or bfloat16"):
        LlamaModel.from_pretrained(tmp_path, dtype=torch.int8)
