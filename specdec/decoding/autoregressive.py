"""Batched autoregressive generation: the baseline every speculative strategy must reproduce.

This is the engine loop (``specdec.decoding.engine``) with the ``NoDraft`` strategy: one
ragged prefill forward for all prompts, then one forward per step with one row per running
request, each step's token drawn by the verification op over a one-node tree -- so plain
and speculative decoding share one loop, one sampler and one random-number convention
(offset = tokens the request has generated so far). Requests stop on an EOS id, at their
own ``max_new_tokens``, or when their logits are invalid (NaN / all -inf); a finished
request sends no rows from the next step on. One host synchronisation per step, in the
engine (marked ``HOST SYNC`` there).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from specdec.decoding.engine import SpeculativeDecoder, StepOutput
from specdec.decoding.strategy import NoDraft


def generate(model, prompts: Sequence[Sequence[int] | torch.Tensor], **options) -> list[list[int]]:
    """Generate for a batch of prompts; returns each request's new tokens (EOS included when hit).

    Takes the arguments of ``stream``.

    Example
    -------
    >>> from specdec.model import LlamaModel, ModelConfig
    >>> config = ModelConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=1,
    ...                      num_heads=2, num_kv_heads=1, head_dim=16)
    >>> model = LlamaModel(config).requires_grad_(False)          # random weights
    >>> out = generate(model, [[1, 15, 27], [1, 9]], max_new_tokens=[6, 3], temperature=[0.0, 0.8], seed=[0, 7])
    >>> [len(tokens) for tokens in out]
    [6, 3]
    """
    outputs: list[list[int]] = [[] for _ in prompts]
    for step in stream(model, prompts, **options):
        for request, tokens in zip(step.requests, step.tokens):
            outputs[request].extend(tokens)
    return outputs


def stream(
    model,
    prompts: Sequence[Sequence[int] | torch.Tensor],
    *,
    cache_layout: str = "contiguous",
    block_size: int = 16,
    **sampling,
) -> Iterator[StepOutput]:
    """Yield one ``StepOutput`` per forward: a one-token tuple for each running request.

    Parameters
    ----------
    model : a ``LlamaModel``.
    prompts : B non-empty token-id sequences (lists or 1-D integer tensors).
    cache_layout, block_size : the KV cache's layout ("contiguous" or "paged") and page size.
    sampling : ``max_new_tokens``, ``temperature``, ``top_k``, ``top_p``, ``seed``,
        ``eos_token_id`` -- each one value or one per prompt, as ``SpeculativeDecoder.stream``
        takes them (temperature 0 = greedy; eos_token_id None = never stop early).
    """
    decoder = SpeculativeDecoder(model, NoDraft(), cache_layout=cache_layout, block_size=block_size)
    yield from decoder.stream(prompts, **sampling)
