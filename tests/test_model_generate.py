"""Batched autoregressive generation: greedy parity with transformers, stopping, streaming, sampling, bad input."""

import math

import pytest
import torch
from helpers import forward_prompts, random_prompts

from specdec import use_backend
from specdec.decoding.autoregressive import generate, stream
from specdec.model.config import ModelConfig
from specdec.model.llama import LlamaModel

transformers = pytest.importorskip("transformers")

PROMPT_LENS = (5, 17, 1, 9)
VOCAB = 256  # the hf_checkpoints vocabulary


pytestmark = pytest.mark.usefixtures("torch_backend")


@pytest.fixture(scope="module")
def model(hf_checkpoints):
    return LlamaModel.from_pretrained(hf_checkpoints("gqa")[0])


@pytest.mark.parametrize("variant, layout", [("gqa", "contiguous"), ("llama3", "paged"), ("tied", "contiguous")])
def test_greedy_64_tokens_match_hf_generate(hf_checkpoints, variant, layout):
    path, hf = hf_checkpoints(variant)
    model = LlamaModel.from_pretrained(path)
    prompts = random_prompts(PROMPT_LENS, VOCAB)
    out = generate(model, prompts, max_new_tokens=64, cache_layout=layout, block_size=8)
    for b, prompt in enumerate(prompts):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False)[0, len(prompt) :]
        assert out[b] == ref.tolist(), f"request {b} (prompt length {len(prompt)}) differs from transformers"


def truncate(tokens, eos, limit):
    out = []
    for t in tokens[:limit]:
        out.append(t)
        if t in eos:
            break
    return out


def test_eos_and_per_request_limits_leave_others_undisturbed(model):
    prompts = random_prompts(PROMPT_LENS, VOCAB)
    full = generate(model, prompts, max_new_tokens=24, eos_token_id=None)
    eos = {full[0][6], full[2][3]}  # two ids the run is known to produce
    limits = [24, 5, 24, 2]
    steps = list(stream(model, prompts + prompts[:1], max_new_tokens=limits + [0], eos_token_id=sorted(eos)))
    got = [[] for _ in range(5)]
    reasons = {}
    for step in steps:
        assert len(set(step.requests)) == len(step.requests)
        assert not set(step.requests) & set(reasons), "a finished request emitted again"
        for b, tokens in zip(step.requests, step.tokens):
            assert len(tokens) == 1, "plain decoding emits one token per request and step"
            got[b].extend(tokens)
        reasons.update(step.finished)
    for b in range(len(prompts)):
        expected = truncate(full[b], eos, limits[b])
        assert got[b] == expected, f"request {b}"
        assert reasons[b] == ("eos" if expected[-1] in eos else "length"), f"request {b}"
    assert got[4] == [] and reasons[4] == "length"  # max_new_tokens = 0: ends at once, emitting nothing
    assert len(steps) == max(len(g) for g in got)
    assert got[0][-1] in eos and len(got[0]) <= 7
    # the model config's EOS ids are the default
    model_eos = LlamaModel(ModelConfig(**{**model.config.__dict__, "eos_token_ids": (full[1][2],)}))
    model_eos.load_state_dict(model.state_dict())
    assert generate(model_eos, prompts[1:2], max_new_tokens=24)[0] == truncate(full[1], {full[1][2]}, 24)


def test_sampling_is_seeded_per_request_and_batch_invariant(model):
    prompts = random_prompts((4, 11, 7), VOCAB)
    options = dict(max_new_tokens=12, temperature=[0.9, 0.0, 1.3], top_k=[20, 0, 0], top_p=[1.0, 1.0, 0.8])
    seeds = [101, 202, 303]
    batched = generate(model, prompts, seed=seeds, **options)
    assert generate(model, prompts, seed=seeds, **options) == batched  # repeatable
    for b in range(3):
        alone = generate(
            model,
            [prompts[b]],
            seed=[seeds[b]],
            **{k: [v[b]] if isinstance(v, list) else v for k, v in options.items()},
        )
        assert alone[0] == batched[b], f"request {b} alone differs from the batch"
    reordered = generate(
        model, prompts[::-1], seed=seeds[::-1], **{k: v[::-1] if isinstance(v, list) else v for k, v in options.items()}
    )
    assert reordered[::-1] == batched
    assert batched[1] == generate(model, [prompts[1]], max_new_tokens=12)[0]  # the greedy row is greedy
    other = generate(model, prompts, seed=[7, 8, 9], **options)
    assert other[0] != batched[0] or other[2] != batched[2]  # the seed matters
    top1 = generate(model, prompts, max_new_tokens=12, temperature=1.5, top_k=1, seed=5)
    assert top1 == generate(model, prompts, max_new_tokens=12)  # top-k = 1 is greedy


def test_first_sampled_token_follows_the_filtered_softmax(model):
    """Many requests share one prompt with different seeds: the first tokens follow softmax(top-8(l) / T)."""
    n, temperature, k = 1500, 0.7, 8
    prompt = random_prompts((3,), VOCAB)[0]
    firsts = generate(model, [prompt] * n, max_new_tokens=1, temperature=temperature, top_k=k, seed=12345)
    with torch.no_grad():
        logits, _, _ = forward_prompts(model, [prompt])
    scaled = logits[0].double() / temperature
    keep = scaled >= scaled.topk(k).values[-1]
    exact = torch.where(keep, scaled, -math.inf).softmax(-1)
    counts = torch.bincount(torch.tensor([f[0] for f in firsts]), minlength=256).double()
    assert counts[~keep].sum() == 0, "a token outside the top-k support was sampled"
    tvd = 0.5 * (counts / n - exact).abs().sum().item()
    expected = 0.5 * math.sqrt(2 * (k - 1) / (math.pi * n))
    assert tvd < 3 * expected, f"TVD {tvd:.4f} vs expected {expected:.4f}"


def test_invalid_logits_end_requests(model):
    broken = LlamaModel(model.config)
    broken.load_state_dict(model.state_dict())
    with torch.no_grad():
        broken.lm_head.weight[3] = float("nan")  # every row of logits holds a NaN
    steps = list(stream(broken, random_prompts((2, 5), VOCAB), max_new_tokens=4))
    assert len(steps) == 1 and steps[0].requests == () and steps[0].finished == {0: "invalid", 1: "invalid"}


@pytest.mark.parametrize(
    "prompts, options, error, match",
    [
        ([], {}, ValueError, "at least one prompt"),
        ([[1], []], {}, ValueError, r"prompts\[1\] is empty"),
        ([[1, 256]], {}, ValueError, r"prompts\[0\]\[1\] must be an int in \[0, 255\] \(a token id\), got 256"),
        ([torch.ones(2, 2, dtype=torch.long)], {}, ValueError, r"prompts\[0\] must be 1-D, got shape \(2, 2\)"),
        ([torch.ones(2, dtype=torch.float32)], {}, TypeError, r"prompts\[0\]\[0\] must be an int, got 1.0"),
        ([[1], [2]], {"max_new_tokens": [3]}, ValueError, "max_new_tokens must be one value or 2"),
        ([[1]], {"max_new_tokens": -1}, ValueError, r"max_new_tokens must be an int in \[0, 2147483647\], got -1"),
        ([[1]], {"temperature": -0.5}, ValueError, r"temperature must be 0 \(greedy\) or a finite float >= 1e-30"),
        ([[1]], {"temperature": math.nan}, ValueError, "temperature must be 0 .* got nan"),
        ([[1]], {"top_k": -1}, ValueError, r"top_k must be an int in \[0, 256\] \(0 = off\), got -1"),
        ([[1]], {"top_p": 0.0}, ValueError, r"top_p must be a finite number in \(0.0, 1.0\]"),
        ([[1]], {"seed": [1.5]}, TypeError, r"seed\[0\] must be an int, got 1.5"),
        ([[1]], {"eos_token_id": "eos"}, ValueError, "eos_token_id must be"),
        ([[1]], {"cache_layout": "ring"}, ValueError, "layout must be one of"),
    ],
)
def test_bad_input(model, prompts, options, error, match):
    with pytest.raises(error, match=match):
        generate(model, prompts, **options)


def test_sliding_window_limit_is_enforced():
    config = ModelConfig(
        vocab_size=32, hidden_size=32, intermediate_size=48, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16,
        sliding_window=8, architecture="MistralForCausalLM",
    )  # fmt: skip
    model = LlamaModel(config).requires_grad_(False)
    # The last token is sampled, never attended to: 3 + 6 - 1 positions fit a window of 8.
    assert len(generate(model, [[1, 2, 3]], max_new_tokens=6)[0]) == 6
    with pytest.raises(ValueError, match="exceeds the model's sliding_window 8"):
        generate(model, [[1, 2, 3]], max_new_tokens=7)


@pytest.mark.gpu
def test_cuda_triton_greedy_matches_hf_and_bf16_loads(hf_checkpoints):
    """The compiled kernels in float32 on the GPU against transformers on the CPU; bf16 loads and generates."""
    path, hf = hf_checkpoints("llama3")
    prompts = random_prompts(PROMPT_LENS, VOCAB)
    with use_backend("triton"):
        model = LlamaModel.from_pretrained(path, device="cuda")
        out = generate(model, prompts, max_new_tokens=64, cache_layout="paged")
        half = LlamaModel.from_pretrained(path, dtype=torch.bfloat16, device="cuda")
        assert [len(o) for o in generate(half, prompts, max_new_tokens=8)] == [8] * len(prompts)
    for b, prompt in enumerate(prompts):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False)[0, len(prompt) :]
        assert out[b] == ref.tolist(), f"request {b} differs from transformers"
