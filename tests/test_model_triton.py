"""A tiny model through both backends: the Triton kernels (interpreted on the CPU) against the PyTorch path.

The model is built from a ModelConfig with random weights (no transformers needed); the
PyTorch path is what test_model_parity.py checks against transformers, so agreement
here carries that parity over to the Triton kernels. Shapes are kept tiny for the
interpreter.
"""

import pytest
import torch
from helpers import random_model, rel_err, tiny_config

from specdec import use_backend
from specdec.decoding.autoregressive import generate
from specdec.kernels import build_tree_metadata
from specdec.model import AttentionMetadata, LlamaModel, causal_positions, tree_positions

REL_TOL = 1e-4
CONFIG = tiny_config(
    vocab_size=96, hidden_size=48, intermediate_size=80, num_heads=4, num_kv_heads=2, qkv_bias=True,
    tie_word_embeddings=True,
)  # fmt: skip


@pytest.fixture(scope="module")
def tiny():
    return random_model(CONFIG, seed=0).to(torch.device("cuda" if torch.cuda.is_available() else "cpu"))


def run_steps(model, layout):
    """Ragged prefill of two prompts, two decode steps (request 0 only in the second), then a tree each."""
    dev = model.device
    i32 = dict(dtype=torch.int32, device=dev)
    prompts = [torch.randint(0, 96, (n,), device=dev) for n in (5, 3)]
    cache = model.new_cache(2, 24, layout=layout, block_size=4)
    outputs = []
    q_offsets = torch.tensor([0, 5, 8], **i32)
    out, _ = model(
        torch.cat(prompts), causal_positions(q_offsets, cache.seq_lens, 8), AttentionMetadata(q_offsets), cache
    )
    outputs.append(out)
    cache.advance([5, 3])
    for counts in ([1, 1], [1, 0]):
        q_offsets = torch.tensor([0, counts[0], sum(counts)], **i32)
        tokens = torch.randint(0, 96, (sum(counts),), device=dev)
        out, _ = model(
            tokens, causal_positions(q_offsets, cache.seq_lens, sum(counts)), AttentionMetadata(q_offsets), cache
        )
        outputs.append(out)
        cache.advance(counts)
    parents = torch.tensor([-1, 0, 0, 1, -1, 0, 1], **i32)
    node_offsets = torch.tensor([0, 4, 7], **i32)
    meta = build_tree_metadata(parents, node_offsets)
    positions = tree_positions(node_offsets, cache.seq_lens, meta.depth)
    tokens = torch.randint(0, 96, (7,), device=dev)
    out, hidden = model(tokens, positions, AttentionMetadata(node_offsets, meta.ancestor_mask), cache)
    outputs += [out, hidden]
    return outputs


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_prefill_decode_tree_match_torch_path(tiny, backend, layout):
    torch.manual_seed(3)
    got = run_steps(tiny, layout)
    torch.manual_seed(3)
    with use_backend("torch"):
        expected = run_steps(tiny, layout)
    for i, (g, e) in enumerate(zip(got, expected)):
        err = rel_err(g, e)
        assert err <= REL_TOL, f"output {i} ({backend}): relative error {err:.2e}"


def test_generation_matches_torch_path(tiny, backend):
    prompts = [torch.randint(0, 96, (n,)).tolist() for n in (4, 1, 6)]
    options = dict(max_new_tokens=[6, 3, 5], temperature=[0.0, 0.8, 1.2], top_k=[0, 10, 0], top_p=[1.0, 1.0, 0.9])
    got = generate(tiny, prompts, seed=[1, 2, 3], **options)
    with use_backend("torch"):
        expected = generate(tiny, prompts, seed=[1, 2, 3], **options)
    assert got == expected
    assert [len(g) for g in got] == [6, 3, 5]


@pytest.mark.gpu
def test_bf16_forward_close_to_float32(tiny):
    """Compiled kernels in bf16 (the interpreter's bf16 dot is unreliable, so GPU only)."""
    torch.manual_seed(3)
    expected = run_steps(tiny, "paged")
    half = LlamaModel(CONFIG).to(device=tiny.device, dtype=torch.bfloat16).requires_grad_(False)
    half.load_state_dict(tiny.state_dict())
    half.rope_inv_freq = CONFIG.rope_inv_freq(tiny.device)
    torch.manual_seed(3)
    got = run_steps(half, "paged")
    for i, (g, e) in enumerate(zip(got, expected)):
        err = rel_err(g, e)
        assert err <= 3e-2, f"output {i}: bf16 relative error {err:.2e}"


@pytest.mark.gpu
def test_generation_syncs_the_host_once_per_step(tiny):
    """Count synchronising CUDA calls per decode step with torch's sync debug mode (the read-back exempt)."""
    import warnings

    from specdec.decoding.autoregressive import stream

    prompts = [torch.randint(0, 96, (n,)).tolist() for n in (4, 1, 6)]
    steps = stream(tiny, prompts, max_new_tokens=[8, 5, 8], temperature=[0.0, 0.8, 1.0], top_k=[0, 10, 0], seed=1)
    per_step = []
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            while True:
                before = len(caught)
                try:
                    next(steps)
                except StopIteration:
                    break
                per_step.append(sum("synchroniz" in str(w.message) for w in caught[before:]))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert len(per_step) == 8
    # uploads are pinned and non-blocking, and the step's one read-back lifts the mode around itself
    # (specdec._transfer.read_back): nothing else may synchronise
    assert per_step == [0] * 8, f"synchronising calls per step: {per_step}"
    torch.cuda.set_sync_debug_mode("warn")
    try:  # the mode does see a synchronising call outside the read-back
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.ones(1, device="cuda").sum().item()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert any("synchroniz" in str(w.message) for w in caught)
