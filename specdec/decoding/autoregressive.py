"""Batched autoregressive generation: the baseline every speculative strategy must reproduce.

This is the engine loop (``specdec.decoding.engine``) with nothing proposed: one ragged
prefill forward for all prompts, then one forward per step with one row per running
request, each step's token drawn by the verification op over a one-node tree -- so
plain and speculative decoding share one loop, one sampler and one random-number
convention (offset = tokens the request has generated so far). Requests stop on an
EOS id, at their own ``max_new_tokens``, or when their logits are invalid (NaN / all
-inf); a finished request sends no rows from the next step on. One host
synchronisation per step, in the engine (marked ``HOST SYNC`` there).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from specdec.decoding.engine import SpeculativeDecoder


@dataclass(frozen=True)
class StepOutput:
    """Tokens emitted in one step: request ``requests[i]`` produced ``tokens[i]``.

    ``finished`` maps each request that ended this step to why: 'eos' (its token was an
    EOS id, included in ``tokens``), 'length' (reached its ``max_new_tokens``) or
    'invalid' (its logits had no valid token; nothing emitted for it this step).
    """

    requests: tuple[int, ...]
    tokens: tuple[int, ...]
    finished: dict[int, str] = field(default_factory=dict)


def generate(model, prompts: Sequence[Sequence[int] | torch.Tensor], **options) -> list[list[int]]:
    """Generate for a batch of prompts; returns each request's new tokens (EOS included when hit).

    Takes the arguments of ``stream``.

    Example
    -------
    >>> out = generate(model, [[1, 15, 27], [1, 9]], max_new_tokens=[16, 8], temperature=[0.0, 0.8], seed=[0, 7])
    """
    outputs: list[list[int]] = [[] for _ in prompts]
    for step in stream(model, prompts, **options):
        for request, token in zip(step.requests, step.tokens):
            outputs[request].append(token)
    return outputs


def stream(
    model,
    prompts: Sequence[Sequence[int] | torch.Tensor],
    *,
    cache_layout: str = "contiguous",
    block_size: int = 16,
    **sampling,
) -> Iterator[StepOutput]:
    """Yield one ``StepOutput`` (one token per running request) per forward.

    Parameters
    ----------
    model : a ``LlamaModel``.
    prompts : B non-empty token-id sequences (lists or 1-D integer tensors).
    cache_layout, block_size : the KV cache's layout ("contiguous" or "paged") and page size.
    sampling : ``max_new_tokens``, ``temperature``, ``top_k``, ``top_p``, ``seed``,
        ``eos_token_id`` -- each one value or one per prompt, as ``SpeculativeDecoder.stream``
        takes them (temperature 0 = greedy; eos_token_id None = never stop early).
    """
    decoder = SpeculativeDecoder(model, None, cache_layout=cache_layout, block_size=block_size)
    for step in decoder.stream(prompts, **sampling):
        yield StepOutput(step.requests, tuple(t for (t,) in step.tokens), step.finished)
