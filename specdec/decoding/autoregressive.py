"""Batched autoregressive generation: the baseline every speculative strategy must reproduce.

One ragged prefill forward for all prompts (logits of each prompt's last row only),
then one decode forward per step with one row per running request. Tokens are drawn
by ``specdec.kernels.sample`` -- the verification op with no drafts -- with
per-request temperature (0 = greedy), top-k, top-p and seed; the random-number
offset of a request is the number of tokens it has generated (the engine's
convention), so its stream depends on neither the batch nor the row order.

A request finishes on one of its EOS ids, at its own ``max_new_tokens``, or when its
logits are invalid (NaN / all -inf); from the next step on it sends no query rows
(an empty segment in ``q_offsets``), so the others run exactly as before.

Host synchronisation: one per step, in ``stream`` where the sampled tokens
and invalid flags are read back (``host = ...cpu()``, marked below): the host needs
them to stream tokens and to decide who finishes. Everything sent back to the device
(offsets, next tokens, running requests) goes through pinned buffers without waiting,
the cache is told each step's sizes up front (``reserve``) so its writes need no sync,
and the forward itself never syncs. (Before the first step the sampling parameters
are uploaded once.)
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from specdec.decoding.requests import DEFAULT_EOS, make_requests, offsets_on, to_device
from specdec.kernels import sample
from specdec.model.attention_metadata import AttentionMetadata, causal_positions


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


@torch.inference_mode()
def stream(
    model,
    prompts: Sequence[Sequence[int] | torch.Tensor],
    *,
    max_new_tokens: int | Sequence[int] = 64,
    temperature: float | Sequence[float] = 0.0,
    top_k: int | Sequence[int] = 0,
    top_p: float | Sequence[float] = 1.0,
    seed: int | Sequence[int] | None = None,
    eos_token_id: int | Sequence[int] | None | str = DEFAULT_EOS,
    cache_layout: str = "contiguous",
    block_size: int = 16,
) -> Iterator[StepOutput]:
    """Yield one ``StepOutput`` per decoding step for a batch of prompts of any lengths.

    Arguments are checked by ``requests.make_requests``, as for the speculative engine.

    Parameters
    ----------
    model : a ``LlamaModel`` (anything with its ``forward``/``new_cache``/``config``).
    prompts : B non-empty token-id sequences (lists or 1-D integer tensors).
    max_new_tokens : per request (or one int for all), >= 0 (0: the request emits nothing).
    temperature : per request, >= 0; 0 is greedy (argmax, no randomness).
    top_k : per request, 0 = no top-k filter.
    top_p : per request, in (0, 1]; 1 = no nucleus filter.
    seed : per request (or one int for all, combined with the request index); default:
        drawn from torch's global generator, so ``torch.manual_seed`` makes runs repeatable.
    eos_token_id : id or ids that end a request; default the model config's; None: never.
    cache_layout, block_size : the KV cache's layout ("contiguous" or "paged") and page size.
    """
    req = make_requests(
        prompts,
        vocab_size=model.config.vocab_size,
        config_eos=model.config.eos_token_ids,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        eos_token_id=eos_token_id,
    )
    batch, limits, eos, device = req.batch_size, req.max_new_tokens, req.eos, model.device
    cache = model.new_cache(
        batch, max(len(p) + m for p, m in zip(req.prompts, limits)), layout=cache_layout, block_size=block_size
    )
    params = req.device_params(device)
    generated = [0] * batch
    running = [b for b in range(batch) if limits[b] > 0]  # max_new_tokens = 0: nothing to do
    tokens = [t for b in running for t in req.prompts[b]]
    counts = [len(p) if limits[b] > 0 else 0 for b, p in enumerate(req.prompts)]  # query rows this step
    while running:
        q_offsets = offsets_on(counts, device)
        rows = q_offsets[1:].long() - 1  # each request's last row (only running requests have rows)
        active = to_device(running, torch.int64, device)
        cache.reserve(counts)  # host-known sizes: the layer writes need no sync
        metadata = AttentionMetadata(q_offsets)
        ids = to_device(tokens, torch.int64, device)
        positions = causal_positions(q_offsets, cache.seq_lens, len(tokens))
        logits, _ = model(ids, positions, metadata, cache, logits_rows=rows.index_select(0, active))
        cache.advance(torch.diff(q_offsets))
        offsets_d = to_device([generated[b] for b in running], torch.int64, device)
        new, invalid = sample(
            logits, *(params[k].index_select(0, active) for k in ("temperature", "top_k", "top_p", "seed")), offsets_d
        )
        host = torch.stack((new.to(torch.int64), invalid.to(torch.int64))).cpu()  # the step's one host sync
        emitted_requests, emitted, finished = [], [], {}
        for b, token, bad in zip(running, *host.tolist()):
            if bad:
                finished[b] = "invalid"
                continue
            emitted_requests.append(b)
            emitted.append(token)
            generated[b] += 1
            if token in eos:
                finished[b] = "eos"
            elif generated[b] >= limits[b]:
                finished[b] = "length"
        yield StepOutput(tuple(emitted_requests), tuple(emitted), finished)
        running = [b for b in running if b not in finished]
        tokens = [t for b, t in zip(emitted_requests, emitted) if b not in finished]
        running_set = set(running)
        counts = [1 if b in running_set else 0 for b in range(batch)]
