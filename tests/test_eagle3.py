"""EAGLE-3 (``specdec.model.eagle3``, drafted by ``EagleStrategy``): the authors' layout loads and computes the
EAGLE-3 draft math; misfits are refused by name; the target hands over its chosen layers' residual streams; greedy
output is the target's and sampled output follows its exact distribution; drafted tokens stay inside the draft
vocabulary's image; one host sync per step."""

import json
import math
import re
import subprocess
import sys

import pytest
import torch
from helpers import assert_close, random_eagle3_head, random_eagle_head, random_model, tiny_config
from safetensors.torch import save_file
from sampling_helpers import model_joint
from sync_counter import events_per_step, run_under_sync_debug_error

from specdec import use_backend
from specdec.decoding import NoDraft, SpeculativeDecoder
from specdec.decoding.autoregressive import generate as autoregressive_generate
from specdec.decoding.eagle import EagleStrategy
from specdec.kernels import build_tree_metadata
from specdec.model import AttentionMetadata, LlamaModel, ModelConfig, causal_positions, tree_positions
from specdec.model.eagle3 import Eagle3Head, default_feature_layers, vocabulary_map
from specdec.model.hf_layout import split

HIDDEN, VOCAB, DRAFT_VOCAB, HEADS, KV_HEADS, HEAD_DIM, TARGET_LAYERS = 64, 96, 40, 4, 2, 16, 7
SUBSET = sorted(torch.randperm(VOCAB, generator=torch.Generator().manual_seed(3))[:DRAFT_VOCAB].tolist())
HEAD_CONFIG = {  # the shape of the authors' EAGLE-3 config.json, scaled down
    "architectures": ["LlamaForCausalLMEagle3"],
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
    "draft_vocab_size": DRAFT_VOCAB,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}


def make_target(num_layers: int = TARGET_LAYERS) -> LlamaModel:
    config = ModelConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=80, num_layers=num_layers, num_heads=HEADS,
        num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, rope_theta=10000.0,
    )  # fmt: skip
    return random_model(config, seed=11)


def authors_tensors(embedding: bool = True) -> dict[str, torch.Tensor]:
    """Random tensors under the names the EAGLE-3 authors' checkpoints use."""
    inter, q, kv = HEAD_CONFIG["intermediate_size"], HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    shapes = {
        "fc.weight": (HIDDEN, 3 * HIDDEN),
        "midlayer.self_attn.q_proj.weight": (q, 2 * HIDDEN),
        "midlayer.self_attn.k_proj.weight": (kv, 2 * HIDDEN),
        "midlayer.self_attn.v_proj.weight": (kv, 2 * HIDDEN),
        "midlayer.self_attn.o_proj.weight": (HIDDEN, q),
        "midlayer.mlp.gate_proj.weight": (inter, HIDDEN),
        "midlayer.mlp.up_proj.weight": (inter, HIDDEN),
        "midlayer.mlp.down_proj.weight": (HIDDEN, inter),
        "lm_head.weight": (DRAFT_VOCAB, HIDDEN),
    }
    if embedding:
        shapes["embed_tokens.weight"] = (VOCAB, HIDDEN)
    tensors = {name: torch.randn(shape) / shape[-1] ** 0.5 for name, shape in shapes.items()}
    for name in ("midlayer.input_layernorm", "midlayer.hidden_norm", "midlayer.post_attention_layernorm", "norm"):
        tensors[f"{name}.weight"] = 1 + 0.1 * torch.randn(HIDDEN)
    tensors["d2t"], tensors["t2d"] = vocabulary_map(SUBSET, VOCAB)
    return tensors


def write_head(path, tensors, **config):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**HEAD_CONFIG, **config}))
    save_file(tensors, str(path / "model.safetensors"))
    return path


# ---- float64 references -------------------------------------------------------------------------------


def rms(x, weight, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


def layer_reference(w, prefix, attn_in, residual, positions, visible, theta, eps):
    """One LLaMA block in float64 whose q/k/v read ``attn_in``, over rows that see ``visible [T, T]`` of each other;
    returns the residual stream after it."""
    t = {k[len(prefix) :]: v.double() for k, v in w.items() if k.startswith(prefix)}
    T = attn_in.shape[0]
    q = (attn_in @ t["self_attn.q_proj.weight"].T).view(T, HEADS, HEAD_DIM)
    k = (attn_in @ t["self_attn.k_proj.weight"].T).view(T, KV_HEADS, HEAD_DIM)
    v = (attn_in @ t["self_attn.v_proj.weight"].T).view(T, KV_HEADS, HEAD_DIM)
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
    x = residual + attn.reshape(T, -1) @ t["self_attn.o_proj.weight"].T
    h = rms(x, t["post_attention_layernorm.weight"], eps)
    gate, up = h @ t["mlp.gate_proj.weight"].T, h @ t["mlp.up_proj.weight"].T
    return x + (torch.nn.functional.silu(gate) * up) @ t["mlp.down_proj.weight"].T


def eagle3_reference(t, embed, g, tokens, positions, visible, norm_before_residual=False):
    """The EAGLE-3 draft math in float64 from features ``g [T, hidden]`` (fc's output or a predicted feature)."""
    eps, g = HEAD_CONFIG["rms_norm_eps"], g.double()
    normed_g = rms(g, t["midlayer.hidden_norm.weight"], eps)
    attn_in = torch.cat((rms(embed.double()[tokens], t["midlayer.input_layernorm.weight"], eps), normed_g), -1)
    r = normed_g if norm_before_residual else g
    r = layer_reference(t, "midlayer.", attn_in, r, positions, visible, HEAD_CONFIG["rope_theta"], eps)
    return r, rms(r, t["norm.weight"], eps) @ t["lm_head.weight"].double().T


def target_streams(target: LlamaModel, tokens: torch.Tensor) -> list[torch.Tensor]:
    """The residual stream entering each layer (and after the last) of one causal request, in float64."""
    w, config = target.hf_state_dict(), target.config
    x = w["model.embed_tokens.weight"].double()[tokens]
    n = tokens.shape[0]
    visible, positions = torch.ones(n, n, dtype=torch.bool).tril(), torch.arange(n)
    streams = [x]
    for layer in range(config.num_layers):
        prefix = f"model.layers.{layer}."
        attn_in = rms(x, w[prefix + "input_layernorm.weight"], config.rms_norm_eps)
        x = layer_reference(w, prefix, attn_in, x, positions, visible, config.rope_theta, config.rms_norm_eps)
        streams.append(x)
    return streams


# ---- the head: the authors' layout and the math -----------------------------------------------------------


@pytest.mark.interpreter
@pytest.mark.parametrize("embedding, norm_before_residual", [(True, False), (False, False), (True, True)], ids=str)
def test_authors_layout_loads_and_matches_the_reference(tmp_path, embedding, norm_before_residual, backend):
    target = make_target()
    tensors = authors_tensors(embedding)
    path = write_head(tmp_path, tensors, norm_before_residual=norm_before_residual)
    head = Eagle3Head.from_pretrained(path, target)
    assert head.feature_layers == default_feature_layers(TARGET_LAYERS) == (2, 3, 4)
    assert (head.embedding_weight is target.model.embed_tokens.weight) == (not embedding)
    assert set(split(head.state_dict(), head.config)) == set(tensors)  # every tensor of the file, nothing else
    assert not any(p.requires_grad for p in head.parameters())
    assert head.target_ids(torch.arange(DRAFT_VOCAB)).tolist() == SUBSET
    embed = tensors["embed_tokens.weight"] if embedding else target.model.embed_tokens.weight

    # Step 1: prefill two ragged requests (7 and 4 rows) from target features; step 2: a tree for request 0, a
    # chain for request 1, from predicted features.
    cache = head.new_cache(2, 32)
    prefix = [7, 4]
    fused = [torch.randn(n, 3 * HIDDEN) for n in prefix]
    toks = [torch.randint(0, VOCAB, (n,)) for n in prefix]
    meta = AttentionMetadata(torch.tensor([0, 7, 11], dtype=torch.int32))
    pos = causal_positions(meta.q_offsets, cache.seq_lens, 11)
    feats = head.features_from_target(torch.cat(fused))
    assert_close(feats, torch.cat(fused).double() @ tensors["fc.weight"].double().T, 1e-5, 1e-5, "fc")
    out_f, out_l = head(feats, torch.cat(toks), pos, meta, cache)
    cache.advance([7, 4])

    parents = torch.tensor([-1, 0, 0, 1, -1, 0, 1], dtype=torch.int32)
    offsets = torch.tensor([0, 4, 7], dtype=torch.int32)
    tree = build_tree_metadata(parents, offsets)
    tree_f, tree_t = torch.randn(7, HIDDEN), torch.randint(0, VOCAB, (7,))
    tree_pos = tree_positions(offsets, cache.seq_lens, tree.depth)
    tree_out_f, tree_out_l = head(tree_f, tree_t, tree_pos, AttentionMetadata(offsets, tree.ancestor_mask), cache)
    assert out_l.shape == (11, DRAFT_VOCAB) and tree_out_f.shape == (7, HIDDEN)

    start = 0
    for b, (first, local) in enumerate(((0, [-1, 0, 0, 1]), (4, [-1, 0, 1]))):
        n, m = prefix[b], len(local)
        visible = torch.zeros(n + m, n + m, dtype=torch.bool)
        visible[:n, :n] = torch.ones(n, n, dtype=torch.bool).tril()
        visible[n:, :n] = True
        for i, p in enumerate(local):  # ancestor-or-self
            visible[n + i, n + i] = True
            if p >= 0:
                visible[n + i, n : n + m] |= visible[n + p, n : n + m]
        g = torch.cat((feats[start : start + n], tree_f[first : first + m]))
        tk = torch.cat((toks[b], tree_t[first : first + m]))
        positions = torch.cat((torch.arange(n), n + tree.depth[first : first + m].long()))
        ref_f, ref_l = eagle3_reference(tensors, embed, g, tk, positions, visible, norm_before_residual)
        rows = slice(start, start + n)
        assert_close(out_f[rows], ref_f[:n], 1e-4, 1e-4, f"prefill features, request {b}")
        assert_close(out_l[rows], ref_l[:n], 1e-4, 1e-4, f"prefill logits, request {b}")
        assert_close(tree_out_f[first : first + m], ref_f[n:], 1e-4, 1e-4, f"tree features, request {b}")
        assert_close(tree_out_l[first : first + m], ref_l[n:], 1e-4, 1e-4, f"tree logits, request {b}")
        start += n


def test_feature_layers_come_from_the_config(tmp_path):
    target = make_target()
    top = {"eagle_aux_hidden_state_layer_ids": [1, 0, 6]}
    at_top = Eagle3Head.from_pretrained(write_head(tmp_path / "a", authors_tensors(), **top), target)
    nested = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [5, 5, 2]}}
    inside = Eagle3Head.from_pretrained(write_head(tmp_path / "b", authors_tensors(), **nested), target)
    assert at_top.feature_layers == (1, 0, 6) and inside.feature_layers == (5, 5, 2)


@pytest.mark.parametrize(
    "edit, config, match",
    [
        (lambda t: t.pop("midlayer.hidden_norm.weight"), {}, r"lacks tensor 'midlayer.hidden_norm.weight'"),
        (lambda t: t.pop("d2t"), {}, r"lacks tensor 'd2t'"),
        (lambda t: t.pop("t2d"), {}, r"lacks tensor 't2d'"),
        (
            lambda t: t.update({"layers.0.self_attn.q_proj.weight": torch.ones(4, 4)}),
            {},
            r"holds tensor 'layers.0.self_attn.q_proj.weight' that this config does not use",
        ),
        (lambda t: t.update({"fc.bias": torch.ones(HIDDEN)}), {}, r"holds tensor 'fc.bias' that this config does not"),
        (
            lambda t: t.update({"midlayer.self_attn.q_proj.weight": torch.randn(HEADS * HEAD_DIM, HIDDEN)}),
            {},
            r"'midlayer.self_attn.q_proj.weight' .* shape \(64, 64\), expected \(64, 128\)",
        ),
        (lambda t: None, {"draft_vocab_size": 50}, r"'lm_head.weight' .* shape \(40, 64\), expected \(50, 64\)"),
        (lambda t: t["d2t"].__setitem__(-1, 60), {}, r"d2t maps draft id 39 to target id 99, outside the vocabulary"),
        (lambda t: t["d2t"].__setitem__(1, t["d2t"][0] - 1), {}, "d2t maps two draft ids to the same target id"),
        (lambda t: t["t2d"].logical_not_(), {}, r"t2d marks 56 target ids, not the 40 that d2t maps onto"),
    ],
)
def test_tensors_that_do_not_fit_are_refused_by_name(tmp_path, edit, config, match):
    tensors = authors_tensors()
    edit(tensors)
    with pytest.raises(ValueError, match=match):
        Eagle3Head.from_pretrained(write_head(tmp_path, tensors, **config), make_target())


@pytest.mark.parametrize(
    "config, match",
    [
        ({"target_hidden_size": 48}, "does not fit the target: its target_hidden_size is 48, the target's hidden_siz"),
        ({"vocab_size": 128}, "does not fit the target: its vocab_size is 128, the target's is 96"),
        ({"num_hidden_layers": 2}, "an EAGLE-3 head has one decoder layer, its config has 2"),
        ({"architectures": ["LlamaForCausalLMEagle"]}, r"architectures \['LlamaForCausalLMEagle'\] are not an EAGLE-3"),
        ({"eagle_aux_hidden_state_layer_ids": [1, 2, 7]}, r"feature_layers must be 3 layer indices .* \[0, 7\)"),
        ({"eagle_aux_hidden_state_layer_ids": [1, 2]}, r"feature_layers must be 3 layer indices"),
        ({"eagle_config": {"use_aux_hidden_state": False}}, "use_aux_hidden_state must be true"),
        ({"draft_vocab_size": 0}, "draft_vocab_size must be a positive int"),
        ({"hidden_act": "gelu"}, "unsupported hidden_act"),
    ],
)
def test_a_head_for_another_target_is_refused_by_name(tmp_path, config, match):
    with pytest.raises(ValueError, match=match):
        Eagle3Head.from_pretrained(write_head(tmp_path, authors_tensors(), **config), make_target())


def test_the_default_layers_of_a_shallow_target_are_refused_with_the_config_key(tmp_path):
    with pytest.raises(ValueError, match=r"\(2, 1, -1\) \(the default for its depth; .*eagle_aux_hidden_state_layer"):
        Eagle3Head.from_pretrained(write_head(tmp_path, authors_tensors()), make_target(num_layers=2))


def test_pickle_is_refused_with_a_conversion_that_works(tmp_path):
    tensors = authors_tensors()
    path = tmp_path / "head"
    path.mkdir()
    (path / "config.json").write_text(json.dumps(HEAD_CONFIG))
    torch.save(tensors, path / "pytorch_model.bin")
    target = make_target()
    with pytest.raises(ValueError, match="holds only pytorch_model.bin, a pickle checkpoint") as info:
        Eagle3Head.from_pretrained(path, target)
    command = re.search(r'python -c "(.*)"', str(info.value)).group(1)
    subprocess.run([sys.executable, "-c", command], check=True, timeout=120)
    head = Eagle3Head.from_pretrained(path, target)
    state = split(head.state_dict(), head.config)
    for name, t in tensors.items():
        assert torch.equal(state[name], t), name


def test_bad_arguments_are_refused_by_name():
    target = make_target()
    head = random_eagle3_head(target, seed=1)
    with pytest.raises(ValueError, match=r"shape \(3, 64\); this EAGLE-3 head reads its layers \(0, 3, 6\)"):
        head.features_from_target(torch.randn(3, HIDDEN))
    with pytest.raises(ValueError, match="features must have shape"):
        head(torch.randn(2, 3 * HIDDEN), torch.tensor([1, 2]), torch.arange(2),
             AttentionMetadata(torch.tensor([0, 2], dtype=torch.int32)), head.new_cache(1, 8))  # fmt: skip
    config = tiny_config(vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=1)
    with pytest.raises(ValueError, match=r"draft_vocab_size must be in \[1, 96\]"):
        Eagle3Head(config, target, draft_vocab_size=97)
    with pytest.raises(ValueError, match="needs its own embed_tokens"):
        Eagle3Head(tiny_config(vocab_size=VOCAB, hidden_size=32, num_layers=1), target, draft_vocab_size=8,
                   target_hidden_size=HIDDEN)  # fmt: skip
    with pytest.raises(ValueError, match=r"top_k must be at most the vocabulary \(72\)"):
        EagleStrategy(head, top_k=73)
    with pytest.raises(ValueError, match=r"target_ids must be a non-empty set of ids in \[0, 96\)"):
        vocabulary_map([3, 96], VOCAB)


# ---- the target's multi-layer features ----------------------------------------------------------------------


@pytest.mark.interpreter
def test_the_target_returns_its_layers_residual_streams(backend):
    target = make_target()
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, VOCAB, (n,), generator=gen) for n in (5, 3)]
    tokens = torch.cat(prompts)
    meta = AttentionMetadata(torch.tensor([0, 5, 8], dtype=torch.int32))

    def forward():
        cache = target.new_cache(2, 16)
        cache.reserve([5, 3])
        return target(tokens, causal_positions(meta.q_offsets, cache.seq_lens, 8), meta, cache)

    logits, final = forward()
    layers = (0, 3, 6, 3)  # the embedding, a middle layer twice, the last layer's input
    target.output_layer_features(layers)
    tapped_logits, tapped = forward()
    assert tapped.shape == (8, len(layers) * HIDDEN)
    assert torch.equal(tapped_logits, logits), "the logits stay the model's"
    for b, rows in enumerate((slice(0, 5), slice(5, 8))):
        streams = target_streams(target, prompts[b])
        for slot, layer in enumerate(layers):
            got = tapped[rows, slot * HIDDEN : (slot + 1) * HIDDEN]
            # float32 rounding grows with the stream (tens here, through random weights): atol scales with it
            scale = float(streams[layer].abs().max())
            assert_close(got, streams[layer], 1e-5 * scale, 1e-4, f"request {b}, layer {layer}")
        eps = target.config.rms_norm_eps
        assert_close(final[rows], rms(streams[-1], target.model.norm.weight, eps), 1e-4, 1e-4, "final norm")
    target.output_layer_features(None)
    assert torch.equal(forward()[1], final), "None gives the final-norm hidden states back"
    for bad in ([], [7], [-1], [True]):
        with pytest.raises(ValueError, match=r"layers must be layer indices in \[0, 7\)"):
            target.output_layer_features(bad)


@pytest.mark.gpu
def test_cuda_graph_replays_return_the_layers_streams():
    target = make_target().to("cuda")
    tokens = torch.randint(0, VOCAB, (5,), device="cuda")
    meta = AttentionMetadata(torch.tensor([0, 5], dtype=torch.int32, device="cuda"))

    def forward():
        cache = target.new_cache(1, 16)
        cache.reserve([5])
        return target(tokens, causal_positions(meta.q_offsets, cache.seq_lens, 5), meta, cache)[1]

    with use_backend("auto"):
        target.output_layer_features((0, 3, 6))
        eager = forward()
        target.use_cuda_graphs()
        replayed = forward()
        assert target.cuda_graphs.replays == 1
        assert_close(replayed, eager, 1e-4, 1e-4, "replayed layer streams")
        target.output_layer_features(None)  # drops the graphs that return the streams
        assert forward().shape == (5, HIDDEN)


def test_decoders_sharing_a_target_each_get_the_features_their_strategy_reads():
    """The engine sets the target's features before each of its steps: an EAGLE-3 decoder, an EAGLE-2 decoder and
    a plain one on one target, interleaved, each decode the target's greedy tokens."""
    target = random_model(tiny_config(vocab_size=48, num_layers=4), seed=0)
    eagle3 = SpeculativeDecoder(target, EagleStrategy(random_eagle3_head(target, 1), tree_budget=6, depth=2, top_k=2))
    eagle2 = SpeculativeDecoder(target, EagleStrategy(random_eagle_head(target, 2), tree_budget=6, depth=2, top_k=2))
    plain = SpeculativeDecoder(target, NoDraft())
    expected = plain.generate([[1, 2, 3]], max_new_tokens=8, eos_token_id=None).tokens
    for decoder, layers in ((eagle3, (0, 2, 3)), (eagle2, None), (eagle3, (0, 2, 3)), (plain, None)):
        assert decoder.generate([[1, 2, 3]], max_new_tokens=8, eos_token_id=None).tokens == expected
        assert target.feature_layers == layers


# ---- drafting: exactly the target's output ------------------------------------------------------------------

KINDS = {
    "eagle2": lambda head: EagleStrategy(head, tree_budget=12, depth=4, top_k=3),
    "eagle1": lambda head: EagleStrategy(head, static_tree="default", tree_budget=12, depth=4, top_k=3),
}


@pytest.fixture(scope="module")
def tiny():
    target = random_model(tiny_config(vocab_size=48, num_layers=4), seed=0)
    return target, random_eagle3_head(target, seed=1, draft_vocab=20)


@pytest.mark.usefixtures("torch_backend")
@pytest.mark.parametrize("layout", ["contiguous", "paged"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_greedy_equals_target_greedy_and_drafts_stay_in_the_draft_vocabulary(tiny, kind, layout):
    target, head = tiny
    strategy = KINDS[kind](head)
    propose, drafted = strategy.propose, []

    def recorded(step):
        proposal = propose(step)
        tokens, start = proposal.tokens.tolist(), 0
        for count in proposal.counts:
            drafted.extend(tokens[start + 1 : start + count])  # node 0 is the root, the last emitted token
            start += count
        return proposal

    strategy.propose = recorded
    prompts = [[3, 9, 4, 3, 9, 4, 3], [7], [5, 5, 2, 8], [1, 2]]
    options = dict(max_new_tokens=[20, 9, 14, 1], eos_token_id=None)
    expected = autoregressive_generate(target, prompts, **options)
    decoder = SpeculativeDecoder(target, strategy, adaptive=False, cache_layout=layout, block_size=4)
    assert decoder.generate(prompts, **options).tokens == expected
    image = set(head.target_ids(torch.arange(head.draft_vocab_size)).tolist())
    assert len(drafted) > 50 and set(drafted) <= image, sorted(set(drafted) - image)
    assert any(t not in image for toks in expected for t in toks), "the target should emit tokens the head cannot draft"


@pytest.mark.usefixtures("torch_backend")
@pytest.mark.parametrize("kind", list(KINDS))
def test_a_checkpoint_in_the_authors_layout_loads_and_drafts(tmp_path, kind):
    target = make_target()
    head = Eagle3Head.from_pretrained(write_head(tmp_path, authors_tensors()), target)
    prompts = [[5, 17, 3, 88, 41, 9], [60, 2]]
    expected = autoregressive_generate(target, prompts, max_new_tokens=16, eos_token_id=None)
    result = SpeculativeDecoder(target, KINDS[kind](head)).generate(prompts, max_new_tokens=16, eos_token_id=None)
    assert result.tokens == expected
    assert target.feature_layers == (2, 3, 4) and sum(s.drafted for s in result.stats) > 0


@pytest.mark.parametrize("kind", ["eagle2", "eagle1"])
def test_first_tokens_follow_the_exact_model_joint(kind):
    # The first token comes from the prefill; the next two from one drafted tree of depth 2. The head drafts over
    # 3 of the 4 tokens: token 2 is never drafted, yet it is emitted as often as the target says.
    vocab, steps, draws, temperature, top_p = 4, 3, 20000, 1.0, 0.9
    target = random_model(tiny_config(vocab_size=vocab, num_layers=2), seed=5, scale=1.5)
    head = random_eagle3_head(target, seed=6, draft_vocab=3)
    head.set_vocabulary_map(*vocabulary_map([0, 1, 3], vocab))
    strategy = {
        "eagle2": EagleStrategy(head, tree_budget=5, depth=2, top_k=2),
        "eagle1": EagleStrategy(head, static_tree=[[0], [1], [0, 0], [1, 0]], depth=2, top_k=2),
    }[kind]
    prompt = [1, 2, 3]
    with use_backend("torch"):
        result = SpeculativeDecoder(target, strategy).generate(
            [prompt] * draws, max_new_tokens=steps, temperature=temperature, top_p=top_p, seed=1000, eos_token_id=None
        )
        exact = model_joint(target, prompt, steps, temperature, 0, top_p)
        hotter = model_joint(target, prompt, steps, temperature * 1.3, 0, top_p)
    index = torch.tensor([sum(t * vocab ** (steps - 1 - i) for i, t in enumerate(toks)) for toks in result.tokens])
    empirical = torch.bincount(index, minlength=vocab**steps).double() / draws
    support = int((exact > 0).sum())
    expected_tvd = 0.5 * math.sqrt(2 * (support - 1) / (math.pi * draws))
    tvd = 0.5 * (empirical - exact).abs().sum().item()
    assert tvd < 2.5 * expected_tvd, f"TVD {tvd:.4f} vs expected noise {expected_tvd:.4f}"
    assert (empirical[exact == 0] == 0).all(), "a filtered-out sequence was emitted"
    assert 0.5 * (empirical - hotter).abs().sum().item() > 2.5 * expected_tvd, "the test cannot tell T=1 from T=1.3"
    assert sum(s.accepted for s in result.stats) > 0 and sum(s.drafted for s in result.stats) > draws
    assert any(2 in toks[1:] for toks in result.tokens), "token 2, outside the draft vocabulary, is still emitted"


# ---- host synchronisation ------------------------------------------------------------------------------

SMALL = {  # small trees: the sampled case runs the Triton kernels in the interpreter
    "eagle2": lambda head: EagleStrategy(head, tree_budget=6, depth=3, top_k=2),
    "eagle1": lambda head: EagleStrategy(head, static_tree=[[0], [1], [0, 0], [0, 0, 0]], depth=3, top_k=2),
}
READ_BACK = [("Tensor.tolist", "_transfer.py")]


def syncs_per_step(decoder, prompts, **sampling) -> list[list[tuple[str, str]]]:
    per_step = events_per_step(decoder, prompts, **sampling)
    return [[(what, where.split(":")[0]) for what, where in events] for events in per_step]


@pytest.mark.parametrize("kind", list(SMALL))
def test_greedy_generation_syncs_once_per_step(tiny, kind):
    target, head = tiny
    decoder = SpeculativeDecoder(target, SMALL[kind](head), cache_layout="paged", block_size=4)
    with use_backend("torch"):
        per_step = syncs_per_step(decoder, [[3, 9, 4, 3, 9, 4, 3], [7, 1], [5, 5, 2, 8]], max_new_tokens=[12, 5, 9],
                                  eos_token_id=None, seed=0)  # fmt: skip
    assert len(per_step) >= 4
    for i, events in enumerate(per_step):
        assert events == READ_BACK, f"step {i}: {events}"


@pytest.mark.interpreter
@pytest.mark.parametrize("kind", list(SMALL))
def test_sampled_generation_syncs_once_per_step_on_the_triton_path(tiny, kind):
    target, head = tiny
    decoder = SpeculativeDecoder(target, SMALL[kind](head))
    sampling = dict(max_new_tokens=[6, 4], temperature=[1.0, 0.0], top_k=[5, 0], top_p=[0.9, 1.0], seed=3)
    with use_backend("triton"):
        per_step = syncs_per_step(decoder, [[3, 9, 4, 3, 9], [7, 1, 7]], eos_token_id=None, **sampling)
    assert len(per_step) >= 2
    for i, events in enumerate(per_step):
        assert events == READ_BACK, f"step {i}: {events}"


@pytest.mark.gpu
@pytest.mark.parametrize("kind", list(SMALL))
def test_generation_runs_under_sync_debug_mode_error(kind):
    """On a GPU: any synchronising CUDA call but the read-back raises."""
    target = random_model(tiny_config(vocab_size=48, num_layers=4), seed=0).to("cuda")
    head = random_eagle3_head(target, seed=1, draft_vocab=20).to("cuda")
    with use_backend("auto"):
        run_under_sync_debug_error(SpeculativeDecoder(target, SMALL[kind](head)))
