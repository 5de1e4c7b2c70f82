"""A batch of generation requests: prompts and per-request sampling parameters, validated once."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from specdec._transfer import to_device
from specdec.kernels.sampling_params import SamplingParams
from specdec.validation import (
    INT32_MAX,
    INT64_MAX,
    INT64_MIN,
    as_float,
    as_int,
    as_sequence,
    as_temperature,
    per_request,
)

DEFAULT_EOS = "config"  # use the model config's EOS ids
NOT_A_LIST = "prompts must be a list of prompts (token-id sequences, or strings with tokenizer=), not one value"
# Why a request ended (``RequestStats.finish_reason``, ``StepOutput.finished``).
FINISH_REASONS = {
    "eos": "it emitted one of its EOS tokens (the last token returned)",
    "length": "it generated max_new_tokens tokens",
    "invalid": "the target's logits held no valid token (NaN or all -inf; check the weights and inputs)",
    "cache": "the paged KV cache's pool (num_blocks) could not hold it even with every other request paused",
    "abort": "the caller aborted it (``Engine.abort``); the tokens streamed before stay valid",
}


@dataclass(frozen=True)
class Request:
    """One validated request (``Requests.one``): what an engine slot runs."""

    prompt: list[int]
    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    eos: frozenset[int]


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

    def one(self, b: int) -> Request:
        """Request ``b`` on its own."""
        return Request(self.prompts[b], self.max_new_tokens[b], self.temperature[b], self.top_k[b], self.top_p[b],
                       self.seed[b], self.eos)  # fmt: skip

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
    max_positions: int | None = None,
) -> Requests:
    """Check and normalise generation arguments; each may be one value or one per prompt.

    Integers must be integers (NumPy integers are fine; floats and bools are refused, never
    truncated). Ranges, each error naming the argument:

    - prompts: non-empty sequences (or 1-D integer tensors / arrays) of token ids in [0, vocab_size);
    - max_new_tokens: int in [0, 2**31 - 1] (0: the request returns nothing);
    - temperature: 0 (greedy) or a finite float >= ``specdec.validation.MIN_TEMPERATURE`` (1e-30);
      smaller positive temperatures are refused, not treated as greedy: 1/T, or logits/T, would
      overflow float32 in the sampling ops and the request would end 'invalid';
    - top_k: int in [0, vocab_size] (0 = off; vocab_size keeps every token);
    - top_p: in (0, 1] (1 = off);
    - seed: an int (request b gets seed + b, which must fit in int64), per-request int64 values,
      or None (drawn from torch's global generator);
    - eos_token_id: token id(s) in [0, vocab_size) that end a request, None for none, or
      "config" for the model's own.

    ``max_positions`` (the model's ``max_position_embeddings``; None: no limit) refuses a request
    whose prompt plus ``max_new_tokens`` is longer.
    """
    prompts = as_sequence(prompts)
    if prompts is None:
        raise TypeError(NOT_A_LIST)
    batch = len(prompts)
    if batch == 0:
        raise ValueError("prompts must hold at least one prompt")
    ids = [_prompt(b, p, vocab_size) for b, p in enumerate(prompts)]
    limits = per_request("max_new_tokens", max_new_tokens, batch, partial(as_int, low=0, high=INT32_MAX))
    temps = per_request("temperature", temperature, batch, as_temperature)
    top_ks = per_request("top_k", top_k, batch, partial(as_int, low=0, high=vocab_size, note=" (0 = off)"))
    top_ps = per_request("top_p", top_p, batch, partial(as_float, low=0.0, high=1.0, low_open=True))
    if seed is None:
        seeds = torch.randint(0, 2**62, (batch,)).tolist()
    elif as_sequence(seed) is not None:
        seeds = per_request("seed", seed, batch, partial(as_int, low=INT64_MIN, high=INT64_MAX))
    else:
        note = " (request b uses seed + b, a 64-bit int)" if batch > 1 else " (a 64-bit int)"
        first = as_int("seed", seed, low=INT64_MIN, high=INT64_MAX - (batch - 1), note=note)
        seeds = [first + b for b in range(batch)]
    eos = _eos_ids(eos_token_id, config_eos, vocab_size)
    if max_positions is not None:
        _check_positions(ids, limits, max_positions)
    return Requests(ids, limits, temps, top_ks, top_ps, seeds, frozenset(eos))


def _prompt(b: int, prompt, vocab: int) -> list[int]:
    name = f"prompts[{b}]"
    if isinstance(prompt, (torch.Tensor, np.ndarray)):
        if prompt.ndim != 1:
            raise ValueError(f"{name} must be 1-D, got shape {tuple(prompt.shape)}")
        prompt = prompt.tolist()
    elif isinstance(prompt, str):
        raise ValueError(f"{name} is text: pass tokenizer= to encode it")
    elif isinstance(prompt, bytes) or not isinstance(prompt, Sequence):
        raise TypeError(f"{name} must be a sequence of token ids, got {type(prompt).__name__}")
    if len(prompt) == 0:
        raise ValueError(f"{name} is empty; every prompt needs at least one token")
    return [as_int(f"{name}[{i}]", t, low=0, high=vocab - 1, note=" (a token id)") for i, t in enumerate(prompt)]


def _check_positions(prompts: list[list[int]], limits: list[int], max_positions: int) -> None:
    for b, (prompt, new) in enumerate(zip(prompts, limits)):
        if len(prompt) + new > max_positions:
            raise ValueError(
                f"prompts[{b}] ({len(prompt)} tokens) + max_new_tokens ({new}) = {len(prompt) + new} tokens, beyond "
                f"the model's max_position_embeddings ({max_positions}); shorten the prompt, lower max_new_tokens, "
                "or pass allow_beyond_max_positions=True to run past the positions the model was trained for"
            )


def _eos_ids(eos_token_id, config_eos: Sequence[int], vocab: int) -> tuple[int, ...]:
    if isinstance(eos_token_id, str):
        if eos_token_id != DEFAULT_EOS:
            raise ValueError(f"eos_token_id must be an int, ints, None or {DEFAULT_EOS!r}, got {eos_token_id!r}")
        return tuple(config_eos)
    if eos_token_id is None:
        return ()
    many = as_sequence(eos_token_id)
    check = partial(as_int, low=0, high=vocab - 1, note=" (a token id)")
    if many is None:
        return (check("eos_token_id", eos_token_id),)
    return tuple(check(f"eos_token_id[{i}]", v) for i, v in enumerate(many))


def encode_prompts(prompts, tokenizer) -> list:
    """Token ids as given, or strings encoded with a ``tokenizers.Tokenizer``."""
    items = as_sequence(prompts)
    if items is None:
        raise TypeError(NOT_A_LIST)
    out = []
    for i, p in enumerate(items):
        if isinstance(p, str):
            if tokenizer is None:
                raise ValueError(f"prompts[{i}] is text: pass tokenizer= to encode it")
            p = tokenizer.encode(p).ids
        out.append(p)
    return out
