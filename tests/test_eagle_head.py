"""EAGLE head: a checkpoint in the authors' layout loads and computes the EAGLE draft math; misfits are refused."""

import json
import re
import subprocess
import sys

import pytest
import torch
from helpers import assert_close
from safetensors.torch import save_file

from specdec.kernels import build_tree_metadata
from specdec.model import AttentionMetadata, LlamaModel, ModelConfig, causal_positions, tree_positions
from specdec.model.eagle import EagleHead
from specdec.model.hf_layout import split

pytestmark = pytest.mark.usefixtures("torch_backend")

HIDDEN, VOCAB, HEADS, KV_HEADS, HEAD_DIM = 64, 96, 4, 2, 16
HEAD_CONFIG = {  # the shape of the authors' config.json, scaled down
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_act": "silu",
    "hidden_size": HIDDEN,
    "intermediate_size": 72,
    "num_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS,
    "num_hidden_layers": 1,
    "rms_norm_eps": 1e-5,
    "rope_theta": 5000.0,  # differs from the target's: the head must use its own
    "vocab_size": VOCAB,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}


def make_target(tied: bool = True) -> LlamaModel:
    config = ModelConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=80, num_layers=2, num_heads=HEADS,
        num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, tie_word_embeddings=tied,
    )  # fmt: skip
    return LlamaModel(config).requires_grad_(False).eval()


def authors_tensors(bias: bool = True, embedding: bool = True) -> dict[str, torch.Tensor]:
    """Random tensors under the names the EAGLE authors' checkpoints use (layer 0 has no input_layernorm)."""
    inter, q, kv = HEAD_CONFIG["intermediate_size"], HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    shapes = {
        "fc.weight": (HIDDEN, 2 * HIDDEN),
        "layers.0.self_attn.q_proj.weight": (q, HIDDEN),
        "layers.0.self_attn.k_proj.weight": (kv, HIDDEN),
        "layers.0.self_attn.v_proj.weight": (kv, HIDDEN),
        "layers.0.self_attn.o_proj.weight": (HIDDEN, q),
        "layers.0.mlp.gate_proj.weight": (inter, HIDDEN),
        "layers.0.mlp.up_proj.weight": (inter, HIDDEN),
        "layers.0.mlp.down_proj.weight": (HIDDEN, inter),
    }
    if bias:
        shapes["fc.bias"] = (HIDDEN,)
    if embedding:
        shapes["embed_tokens.weight"] = (VOCAB, HIDDEN)
    tensors = {name: torch.randn(shape) / shape[-1] ** 0.5 for name, shape in shapes.items()}
    tensors["layers.0.post_attention_layernorm.weight"] = 1 + 0.1 * torch.randn(HIDDEN)
    return tensors


def write_head(path, tensors, **config):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**HEAD_CONFIG, **config}))
    save_file(tensors, str(path / "model.safetensors"))
    return path


def eagle_reference(t, embed, lm_head, features, tokens, positions, visible, theta, eps=1e-5):
    """The EAGLE-1 draft math in float64 for rows that see ``visible [T, T]`` (bool) of each other."""
    t = {k: v.double() for k, v in t.items()}
    x = torch.cat((embed.double()[tokens], features.double()), -1) @ t["fc.weight"].T
    if "fc.bias" in t:
        x = x + t["fc.bias"]
    T = x.shape[0]
    q = (x @ t["layers.0.self_attn.q_proj.weight"].T).view(T, HEADS, HEAD_DIM)
    k = (x @ t["layers.0.self_attn.k_proj.weight"].T).view(T, KV_HEADS, HEAD_DIM)
    v = (x @ t["layers.0.self_attn.v_proj.weight"].T).view(T, KV_HEADS, HEAD_DIM)
    inv_freq = 1.0 / theta ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM)
    angle = positions.double()[:, None] * inv_freq[None]  # [T, D/2]: pairs (i, i + D/2)
    cos, sin = angle.cos()[:, None], angle.sin()[:, None]

    def rotate(z):
        a, b = z[..., : HEAD_DIM // 2], z[..., HEAD_DIM // 2 :]
        return torch.cat((a * cos - b * sin, b * cos + a * sin), -1)

    q, k = rotate(q), rotate(k).repeat_interleave(HEADS // KV_HEADS, dim=1)
    v = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / HEAD_DIM**0.5
    attn = torch.einsum("hqk,khd->qhd", scores.masked_fill(~visible, float("-inf")).softmax(-1), v)
    x = x + attn.reshape(T, -1) @ t["layers.0.self_attn.o_proj.weight"].T
    h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * t["layers.0.post_attention_layernorm.weight"]
    gate, up = h @ t["layers.0.mlp.gate_proj.weight"].T, h @ t["layers.0.mlp.up_proj.weight"].T
    x = x + (torch.nn.functional.silu(gate) * up) @ t["layers.0.mlp.down_proj.weight"].T
    return x, x @ lm_head.double().T  # no final norm before the (shared) LM head


@pytest.mark.parametrize(
    "bias, embedding, tied", [(True, True, True), (False, False, True), (True, False, False)], ids=str
)
def test_authors_layout_loads_and_matches_the_reference(tmp_path, bias, embedding, tied):
    target = make_target(tied)
    tensors = authors_tensors(bias, embedding)
    head = EagleHead.from_pretrained(write_head(tmp_path, tensors, bias=bias), target)
    assert head.lm_head_weight is target.lm_head_weight  # shared, not copied
    assert (head.embedding_weight is target.model.embed_tokens.weight) == (not embedding)
    assert set(split(head.state_dict(), head.config)) == set(tensors)  # every tensor of the file, nothing else
    assert not any(p.requires_grad for p in head.parameters())
    embed = tensors["embed_tokens.weight"] if embedding else target.model.embed_tokens.weight
    theta = HEAD_CONFIG["rope_theta"]

    # Step 1: prefill two ragged requests (7 and 4 rows); step 2: a tree for request 0, a chain for request 1.
    cache = head.new_cache(2, 32)
    prefix = [7, 4]
    feats = [torch.randn(n, HIDDEN) for n in prefix]
    toks = [torch.randint(0, VOCAB, (n,)) for n in prefix]
    meta = AttentionMetadata(torch.tensor([0, 7, 11], dtype=torch.int32))
    pos = causal_positions(meta.q_offsets, cache.seq_lens, 11)
    out_f, out_l = head(torch.cat(feats), torch.cat(toks), pos, meta, cache)
    cache.advance([7, 4])

    parents = torch.tensor([-1, 0, 0, 1, -1, 0, 1], dtype=torch.int32)
    offsets = torch.tensor([0, 4, 7], dtype=torch.int32)
    tree = build_tree_metadata(parents, offsets)
    tree_f, tree_t = torch.randn(7, HIDDEN), torch.randint(0, VOCAB, (7,))
    tree_pos = tree_positions(offsets, cache.seq_lens, tree.depth)
    tree_out_f, tree_out_l = head(tree_f, tree_t, tree_pos, AttentionMetadata(offsets, tree.ancestor_mask), cache)

    for b, (first, local) in enumerate(((0, [-1, 0, 0, 1]), (4, [-1, 0, 1]))):
        n, m = prefix[b], len(local)
        visible = torch.zeros(n + m, n + m, dtype=torch.bool)
        visible[:n, :n] = torch.ones(n, n, dtype=torch.bool).tril()
        visible[n:, :n] = True
        for i, p in enumerate(local):  # ancestor-or-self
            visible[n + i, n + i] = True
            if p >= 0:
                visible[n + i, n : n + m] |= visible[n + p, n : n + m]
        f = torch.cat((feats[b], tree_f[first : first + m]))
        tk = torch.cat((toks[b], tree_t[first : first + m]))
        positions = torch.cat((torch.arange(n), n + tree.depth[first : first + m].long()))
        ref_f, ref_l = eagle_reference(tensors, embed, target.lm_head_weight, f, tk, positions, visible, theta)
        rows = slice(sum(prefix[:b]), sum(prefix[: b + 1]))
        assert_close(out_f[rows], ref_f[:n], 1e-4, 1e-4, f"prefill features, request {b}")
        assert_close(out_l[rows], ref_l[:n], 1e-4, 1e-4, f"prefill logits, request {b}")
        assert_close(tree_out_f[first : first + m], ref_f[n:], 1e-4, 1e-4, f"tree features, request {b}")
        assert_close(tree_out_l[first : first + m], ref_l[n:], 1e-4, 1e-4, f"tree logits, request {b}")

    some = torch.tensor([2, 0])
    _, picked = head(tree_f[:4], tree_t[:4], tree_pos[:4], AttentionMetadata(offsets[:2]), head.new_cache(1, 8), some)
    assert picked.shape == (2, VOCAB)


def test_head_follows_the_target_dtype(tmp_path):
    target = make_target().to(torch.bfloat16)
    head = EagleHead.from_pretrained(write_head(tmp_path, authors_tensors()), target)
    assert head.dtype == torch.bfloat16 and head.new_cache(1, 4).dtype == torch.bfloat16
    meta = AttentionMetadata(torch.tensor([0, 3], dtype=torch.int32))
    feats, logits = head(torch.randn(3, HIDDEN, dtype=torch.bfloat16), torch.tensor([1, 2, 3]), torch.arange(3), meta,
                         head.new_cache(1, 4))  # fmt: skip
    assert feats.dtype == logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()


@pytest.mark.parametrize(
    "config, match",
    [
        ({"hidden_size": 48}, "does not fit the target: its hidden_size is 48, the target's is 64"),
        ({"vocab_size": 32000}, "does not fit the target: its vocab_size is 32000, the target's is 96"),
        ({"bias": "yes"}, "'bias' must be true or false"),
        ({"hidden_act": "gelu"}, "unsupported hidden_act"),
    ],
)
def test_config_that_does_not_fit_is_refused(tmp_path, config, match):
    with pytest.raises(ValueError, match=match):
        EagleHead.from_pretrained(write_head(tmp_path, authors_tensors(), **config), make_target())


@pytest.mark.parametrize(
    "edit, config, match",
    [
        (lambda t: t.pop("fc.bias"), {}, r"lacks tensor 'fc.bias'"),
        (lambda t: t.pop("fc.bias"), {"bias": True}, r"lacks tensor 'fc.bias'"),
        (lambda t: None, {"bias": False}, r"holds tensor 'fc.bias' that this config does not use"),
        (
            lambda t: t.update({"layers.0.input_layernorm.weight": torch.ones(HIDDEN)}),
            {},
            r"holds tensor 'layers.0.input_layernorm.weight' that this config does not use",
        ),
        (
            lambda t: t.update({"embed_tokens.weight": torch.randn(VOCAB + 1, HIDDEN)}),
            {},
            r"'embed_tokens.weight' .* shape \(97, 64\), expected \(96, 64\)",
        ),
        (
            lambda t: t.update({"fc.weight": torch.randn(HIDDEN, HIDDEN)}),
            {},
            r"'fc.weight' .* shape \(64, 64\), expected \(64, 128\)",
        ),
    ],
)
def test_tensors_that_do_not_fit_are_refused(tmp_path, edit, config, match):
    tensors = authors_tensors()
    edit(tensors)
    with pytest.raises(ValueError, match=match):
        EagleHead.from_pretrained(write_head(tmp_path, tensors, **config), make_target())


def test_pickle_is_refused_with_a_conversion_that_works(tmp_path):
    tensors = authors_tensors()
    path = tmp_path / "head"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(HEAD_CONFIG))
    torch.save(tensors, path / "pytorch_model.bin")
    target = make_target()
    with pytest.raises(ValueError, match="holds only pytorch_model.bin, a pickle checkpoint") as info:
        EagleHead.from_pretrained(path, target)
    command = re.search(r'python -c "(.*)"', str(info.value)).group(1)
    subprocess.run([sys.executable, "-c", command], check=True, timeout=120)
    head = EagleHead.from_pretrained(path, target)
    state = split(head.state_dict(), head.config)
    for name, t in tensors.items():
        assert torch.equal(state[name], t), name


def test_bad_arguments(tmp_path):
    target = make_target()
    with pytest.raises(TypeError, match="target must be a LlamaModel"):
        EagleHead.from_pretrained(write_head(tmp_path, authors_tensors()), "target")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no config.json"):
        EagleHead.from_pretrained(tmp_path / "empty", target)
    with pytest.raises(ValueError, match="is not a directory"):
        EagleHead.from_pretrained(tmp_path / "missing", target)
    head = EagleHead.from_pretrained(tmp_path, target)
    cache, meta = head.new_cache(1, 8), AttentionMetadata(torch.tensor([0, 2], dtype=torch.int32))
    feats, toks, pos = torch.randn(2, HIDDEN), torch.tensor([1, 2]), torch.arange(2)
    with pytest.raises(TypeError, match="features must have dtype float32"):
        head(feats.double(), toks, pos, meta, cache)
    with pytest.raises(ValueError, match="features must have shape"):
        head(torch.randn(2, HIDDEN + 1), toks, pos, meta, cache)
    with pytest.raises(ValueError, match="tokens must have shape"):
        head(feats, toks[:1], pos, meta, cache)
    with pytest.raises(TypeError, match="positions must have dtype"):
        head(feats, toks, pos.float(), meta, cache)
    with pytest.raises(TypeError, match="metadata must be an AttentionMetadata"):
        head(feats, toks, pos, None, cache)
    with pytest.raises(ValueError, match="does not fit the target: its hidden_size"):
        EagleHead(ModelConfig(VOCAB, HIDDEN * 2, 8, 1, 4, 2, 32), target)
