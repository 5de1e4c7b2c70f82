"""A batch of generation requests: prompts and per-request sampling parameters, validated once."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec._transfer import to_device
from specdec.kernels.sampling_params import SamplingParams

DEFAULT_EOS = "config"  # use the model config's EOS ids


@dataclass(frozen=True)
class Requests:
    """Validated host-side description of B requests (every list has B entries)."""

    prompts: list[list[int]]
    max_new_tokens: list[int]
    temperature: list[float]
    top_k: list[int]
    top_p: list[float]
    seed: list[int]
    eos: frozenset[int]

    @property
    def batch_size(self) -> int:
        return len(self.prompts)

    def sampling_params(self, device: torch.device) -> SamplingParams:
        """The requests' sampling parameters as the kernels take them: ``[B]`` tensors on ``device``, offset 0."""
        zeros = [0] * self.batch_size
        return SamplingParams(
            to_device(self.temperature, torch.float32, device),
            to_device(self.top_k, torch.int32, device),
            to_device(self.top_p, torch.float32, device),
            to_device(self.seed, torch.int64, device),
            to_device(zeros, torch.int64, device),
        )


def make_requests(
    prompts: Sequence[Sequence[int] | torch.Tensor],
    *,
    vocab_size: int,
    config_eos: Sequence[int] = (),
    max_new_tokens: int | Sequence[int] = 64,
    temperature: float | Sequence[float] = 0.0,
    top_k: int | Sequence[int] = 0,
    top_p: float | Sequence[float] = 1.0,
    seed: int | Sequence[int] | None = None,
    eos_token_id: int | Sequence[int] | None | str = DEFAULT_EOS,
) -> Requests:
    """Check and normalise generation arguments; each may be one value or one per prompt.

    max_new_tokens >= 0 (0: the request returns nothing); temperature >= 0 (0 = greedy);
    top_k >= 0 (0 = off); top_p in (0, 1] (1 = off); seed: an int (request b gets seed + b),
    per-request ints, or None (drawn from torch's global generator); eos_token_id: id(s) that
    end a request, None for none, or "config" for the model's own.
    """
    batch = len(prompts)
    if batch == 0:
        raise ValueError("prompts must hold at least one prompt")
    ids = [_prompt(b, p, vocab_size) for b, p in enumerate(prompts)]
    limits = _per_request("max_new_tokens", max_new_tokens, batch, int)
    if any(m < 0 for m in limits):
        raise ValueError(f"max_new_tokens must be >= 0 for every request, got {limits}")
    temps = _per_request("temperature", temperature, batch, float)
    if any(not t >= 0 or t == float("inf") for t in temps):
        raise ValueError(f"temperature must be finite and >= 0, got {temps}")
    top_ks = _per_request("top_k", top_k, batch, int)
    if any(k < 0 for k in top_ks):
        raise ValueError(f"top_k must be >= 0 (0 = off), got {top_ks}")
    top_ps = _per_request("top_p", top_p, batch, float)
    if any(not 0 < p <= 1 for p in top_ps):
        raise ValueError(f"top_p must lie in (0, 1], got {top_ps}")
    if seed is None:
        seeds = torch.randint(0, 2**62, (batch,)).tolist()
    elif isinstance(seed, int) and not isinstance(seed, bool):
        seeds = [seed + b for b in range(batch)]
    else:
        seeds = _per_request("seed", seed, batch, int)
    return Requests(ids, limits, temps, top_ks, top_ps, seeds, frozenset(_eos_ids(eos_token_id, config_eos)))


def _prompt(b: int, prompt, vocab: int) -> list[int]:
    if isinstance(prompt, torch.Tensor):
        if prompt.dim() != 1 or prompt.dtype.is_floating_point or prompt.dtype == torch.bool:
            raise ValueError(f"prompts[{b}] must be a 1-D integer tensor, got {prompt.dtype} {tuple(prompt.shape)}")
        prompt = prompt.tolist()
    ids = list(prompt)
    if not ids:
        raise ValueError(f"prompts[{b}] is empty; every prompt needs at least one token")
    for i, t in enumerate(ids):
        if not isinstance(t, int) or not 0 <= t < vocab:
            raise ValueError(f"prompts[{b}][{i}] = {t!r} is not a token id in [0, {vocab})")
    return ids


def _per_request(name: str, value, batch: int, kind: type) -> list:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return [kind(value)] * batch
    values = list(value)
    if len(values) != batch:
        raise ValueError(f"{name} must be one value or {batch} (one per prompt), got {len(values)}")
    if kind is int and not all(isinstance(v, int) for v in values):
        raise ValueError(f"{name} must hold ints, got {values!r}")
    return [kind(v) for v in values]


def _eos_ids(eos_token_id, config_eos: Sequence[int]) -> tuple[int, ...]:
    if isinstance(eos_token_id, str):
        if eos_token_id != DEFAULT_EOS:
            raise ValueError(f"eos_token_id must be an int, ints, None or {DEFAULT_EOS!r}, got {eos_token_id!r}")
        return tuple(config_eos)
    if eos_token_id is None:
        return ()
    ids = (eos_token_id,) if isinstance(eos_token_id, int) else tuple(eos_token_id)
    if not all(isinstance(i, int) for i in ids):
        raise ValueError(f"eos_token_id must hold ints, got {eos_token_id!r}")
    return ids


def encode_prompts(prompts, tokenizer) -> list:
    """Token ids as given, or strings encoded with a ``tokenizers.Tokenizer``."""
    if isinstance(prompts, (str, bytes)):
        raise TypeError("prompts must be a list of prompts, not a single string")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if tokenizer is None:
                raise ValueError(f"prompts[{i}] is text: pass tokenizer= to encode it")
            p = tokenizer.encode(p).ids
        out.append(p)
    return out
