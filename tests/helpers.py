"""Helpers shared by the tests (import as ``from helpers import ...``): assertions, small models, checkpoints."""

import math
import os
import subprocess
import sys

import torch

from specdec.model import (
    AttentionMetadata,
    EagleHead,
    LlamaModel,
    MedusaHeads,
    ModelConfig,
    ParallelEagleHead,
    causal_positions,
)
from specdec.model.eagle3 import Eagle3Head, vocabulary_map

# ---- assertions -------------------------------------------------------------------------------------


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float, what: str = "") -> None:
    """torch.testing.assert_close that also names the worst element."""
    actual, expected = actual.double().cpu(), expected.double().cpu()
    err = (actual - expected).abs() - rtol * expected.abs()
    if not torch.isfinite(actual).all():
        bad = (~torch.isfinite(actual)).nonzero()[0].tolist()
        raise AssertionError(f"{what}: non-finite output at {bad}")
    if err.numel() and err.max() > atol:
        idx = torch.unravel_index(err.argmax(), err.shape)
        idx = tuple(int(i) for i in idx)
        raise AssertionError(
            f"{what}: mismatch at {idx}: got {actual[idx].item():.6g}, expected {expected[idx].item():.6g} "
            f"(atol={atol}, rtol={rtol}, max excess {err.max().item():.3g})"
        )


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest absolute difference relative to the largest expected magnitude (float64)."""
    return ((actual.double() - expected.double()).abs().max() / expected.double().abs().max()).item()


def i32(*values, device="cpu") -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)


# ---- benchmarks -------------------------------------------------------------------------------------

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_bench(script: str, *args: str, cpu_path: bool = False, timeout: int = 600) -> subprocess.CompletedProcess:
    """``python bench/<script> <args>`` in a fresh process from the repository root, the package importable; with
    ``cpu_path``, the CPU's own path (``TRITON_INTERPRET=0``), not Triton's interpreter standing in for a GPU."""
    env = {**os.environ, "PYTHONPATH": ROOT, **({"TRITON_INTERPRET": "0"} if cpu_path else {})}
    return subprocess.run([sys.executable, os.path.join("bench", script), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip


def table_rows(path, first_cell: str) -> list[list[str]]:
    """The cells, stripped, of the markdown table rows in the file ``path`` whose first cell is ``first_cell``."""
    with open(path) as table:
        rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in table.read().splitlines()]
    return [cells for cells in rows if cells and cells[0] == first_cell]


def run_python(script: str, env: dict[str, str]) -> str:
    """What ``script`` prints in a fresh Python process run from the repository root (the tests importable), with
    ``env`` added to the environment (switches a C++ kernel reads once per process)."""
    env = {**os.environ, **env, "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "tests")])}
    command = [sys.executable, "-c", script]
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


def generic_version_runs(script: str, switch: str) -> dict[str, list[str]]:
    """The words ``script`` prints in a fresh Python process with the environment switch ``switch`` at "1" (a C++
    kernel's generic version forced) and at "0". Where this CPU has AVX2 + FMA (Linux), the two runs must round
    differently somewhere (fused multiply-adds against separate ones): the switch took effect."""
    runs = {generic: run_python(script, {switch: generic}).split() for generic in ("1", "0")}
    if cpu_flags() >= {"avx2", "fma"} and sys.platform.startswith("linux"):
        assert runs["1"] != runs["0"], f"{switch}=1 ran the same arithmetic as the AVX2 version"
    return runs


def cpu_flags() -> set[str]:
    """This CPU's feature flags (Linux's /proc/cpuinfo; none elsewhere)."""
    try:
        return set(next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split())
    except (OSError, StopIteration):
        return set()


# ---- small random models ----------------------------------------------------------------------------


def tiny_config(**overrides) -> ModelConfig:
    """A 2-layer GQA config (vocab 64, hidden 32, 2 query heads over 1 KV head of 16); ``overrides`` replace fields."""
    fields = dict(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16
    )
    return ModelConfig(**{**fields, **overrides})


def random_model(config: ModelConfig, seed: int, scale: float = 1.0) -> LlamaModel:
    """A model with weights large enough that its next-token distributions are far from uniform (eval, no grad).

    Matrices ~ N(0, (2 * scale)^2 / fan_in); norm weights ~ 1 + N(0, 0.1^2); biases ~ N(0, 0.1^2).
    """
    gen = torch.Generator().manual_seed(seed)
    model = LlamaModel(config).requires_grad_(False)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        if p.dim() > 1:
            p.copy_(noise * 2 * scale / math.sqrt(p.shape[1]))
        else:
            p.copy_(noise * 0.1 + (1.0 if name.endswith("norm.weight") else 0.0))
    return model.eval()


def noisy_copy(model: LlamaModel, seed: int, noise: float) -> LlamaModel:
    """A draft that resembles its target: same weights plus noise."""
    gen = torch.Generator().manual_seed(seed)
    draft = LlamaModel(model.config).requires_grad_(False)
    draft.load_state_dict(model.state_dict())
    for p in draft.parameters():
        p.add_(noise * p.abs().mean() * torch.randn(p.shape, generator=gen))
    return draft.eval()


def random_heads(target: LlamaModel, seed: int, num_heads: int = 3) -> MedusaHeads:
    """Medusa heads with every weight drawn at random (blocks too): guesses neither the target's nor zero."""
    config = target.config
    gen = torch.Generator().manual_seed(seed)
    heads = MedusaHeads(config.hidden_size, config.vocab_size, num_heads).requires_grad_(False)
    for p in heads.parameters():
        p.copy_(torch.randn(p.shape, generator=gen) * 2 / math.sqrt(p.shape[-1]))
    return heads.to(device=target.device, dtype=target.dtype).eval()


def random_eagle_head(target: LlamaModel, seed: int, block_size: int | None = None) -> EagleHead:
    """A one-layer EAGLE head for ``target`` with every weight drawn at random (far from the target); with a
    ``block_size``, a ``ParallelEagleHead`` drafting that many positions a forward."""
    config = tiny_config(vocab_size=target.config.vocab_size, hidden_size=target.config.hidden_size, num_layers=1)
    gen = torch.Generator().manual_seed(seed)
    if block_size is None:
        head = EagleHead(config, target)
    else:
        head = ParallelEagleHead(config, target, block_size=block_size)
    head.requires_grad_(False)
    for name, p in head.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        p.copy_(noise * 2 / math.sqrt(p.shape[1]) if p.dim() > 1 else noise * 0.1 + name.endswith("norm.weight"))
    return head.eval()


def random_eagle3_head(target: LlamaModel, seed: int, draft_vocab: int | None = None, layers=None) -> Eagle3Head:
    """A one-layer EAGLE-3 head for ``target`` with every weight drawn at random, drafting over ``draft_vocab`` (default
    three quarters of the vocabulary) target ids picked at random, reading ``layers`` (default: the target's first,
    middle and last layers)."""
    config = target.config
    vocab, depth = config.vocab_size, config.num_layers
    draft_vocab = draft_vocab or max(vocab * 3 // 4, 1)
    layers = layers or (0, depth // 2, depth - 1)
    head_config = tiny_config(vocab_size=vocab, hidden_size=config.hidden_size, num_layers=1)
    gen = torch.Generator().manual_seed(seed)
    head = Eagle3Head(head_config, target, draft_vocab_size=draft_vocab, feature_layers=layers).requires_grad_(False)
    for name, p in head.named_parameters():
        noise = torch.randn(p.shape, generator=gen)
        p.copy_(noise * 2 / math.sqrt(p.shape[1]) if p.dim() > 1 else noise * 0.1 + name.endswith("norm.weight"))
    head.set_vocabulary_map(*vocabulary_map(torch.randperm(vocab, generator=gen)[:draft_vocab], vocab))
    return head.eval()


def random_prompts(lengths, vocab: int, seed: int | None = None) -> list[list[int]]:
    """One random prompt per length; ``seed`` None draws from torch's generator (seeded per test)."""
    gen = None if seed is None else torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


def forward_prompts(model: LlamaModel, prompts: list[list[int]], max_len: int | None = None):
    """One ragged causal forward over ``prompts`` in a fresh cache, committed.

    Returns (logits of each prompt's last token ``[B, V]``, hidden ``[T, H]``, the cache).
    """
    counts = [len(p) for p in prompts]
    cache = model.new_cache(len(prompts), max_len or max(counts))
    q_offsets = torch.tensor([0, *counts], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    tokens = torch.tensor([t for p in prompts for t in p], device=model.device)
    q_offsets = q_offsets.to(model.device)
    cache.reserve(counts)
    positions = causal_positions(q_offsets, cache.seq_lens, tokens.numel())
    logits, hidden = model(tokens, positions, AttentionMetadata(q_offsets), cache, logits_rows=q_offsets[1:].long() - 1)
    cache.advance(counts)
    return logits, hidden, cache


# ---- checkpoints saved by transformers --------------------------------------------------------------

HF_COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=112,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    rms_norm_eps=1e-5,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,  # short, so all three frequency bands act within the test lengths
}
HF_VARIANTS = {
    "gqa": ("LlamaConfig", dict(num_key_value_heads=2, head_dim=32, rope_parameters={"rope_theta": 5000.0})),
    "tied": ("LlamaConfig", dict(tie_word_embeddings=True)),
    "llama3": ("LlamaConfig", dict(num_key_value_heads=1, rope_parameters=LLAMA3_ROPE)),
    "bias": ("LlamaConfig", dict(num_key_value_heads=2, attention_bias=True, mlp_bias=True)),
    "qwen2": ("Qwen2Config", dict(num_key_value_heads=2)),
}


def build_hf_checkpoint(path, variant: str, seed: int = 0):
    """Save a random transformers model of ``variant`` to ``path``; returns the HF model (eval, float32).

    Every parameter is re-drawn at a scale that spreads the logits (transformers initialises
    biases to zero, which would let a forgotten bias pass). The GQA checkpoint is sharded, so
    the index path is exercised against files transformers wrote.
    """
    import transformers

    config_cls, extra = HF_VARIANTS[variant]
    config = getattr(transformers, config_cls)(**dict(HF_COMMON, **extra))
    torch.manual_seed(seed)
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0, 0.1)
    hf.save_pretrained(path, max_shard_size="100KB" if variant == "gqa" else "1GB")
    return hf
