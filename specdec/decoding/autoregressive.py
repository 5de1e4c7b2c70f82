"""Batched autoregressive generation: the baseline every speculative strategy must reproduce.

One ragged prefill forward for all prompts (logits of each prompt's last row only),
then one decode forward per step with one row per running request. Tokens are drawn
by ``specdec.kernels.sample`` -- the verification op with no drafts -- with
per-request temperature (0 = greedy), top-k, top-p and seed; the Philox offset of a
request is the number of tokens it has generated, so its stream does not depend on
the batch it runs in.

A request finishes on one of its EOS ids, at its own ``max_new_tokens``, or when its
logits are invalid (NaN / all -inf); from the next step on it sends no query rows
(an empty segment in ``q_offsets``), so the others run exactly as before.

Host synchronisation: exactly one per step, in ``stream`` where the sampled tokens
and invalid flags are read back (``host = ...cpu()``, marked below): the host needs
them to stream tokens and to decide who finishes. Everything sent back to the device
(offsets, next tokens, running requests) goes through pinned buffers without waiting,
the cache is told each step's sizes up front (``reserve``) so its writes need no sync,
and the forward itself never syncs.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from specdec.kernels import sample
from specdec.model.attention_metadata import AttentionMetadata, causal_positions

DEFAULT_EOS = "config"  # use the model config's EOS ids


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

    Takes the arguments of ``stream``. Example
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

    Parameters
    ----------
    model : a ``LlamaModel`` (anything with its ``forward``/``new_cache``/``config``).
    prompts : B non-empty token-id sequences (lists or 1-D integer tensors).
    max_new_tokens : per request (or one int for all), >= 1.
    temperature : per request, >= 0; 0 is greedy (argmax, no randomness).
    top_k : per request, 0 = no top-k filter.
    top_p : per request, in (0, 1]; 1 = no nucleus filter.
    seed : per request (or one int for all, combined with the request index); default:
        drawn from torch's global generator, so ``torch.manual_seed`` makes runs repeatable.
    eos_token_id : id or ids that end a request; default the model config's; None: never.
    cache_layout, block_size : the KV cache's layout ("contiguous" or "paged") and page size.
    """
    batch = len(prompts)
    if batch == 0:
        raise ValueError("prompts must hold at least one prompt")
    vocab, device = model.config.vocab_size, model.device
    prompt_ids = [_prompt(b, p, vocab) for b, p in enumerate(prompts)]
    limits = _per_request("max_new_tokens", max_new_tokens, batch, int)
    if any(m < 1 for m in limits):
        raise ValueError(f"max_new_tokens must be >= 1 for every request, got {limits}")
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
    elif isinstance(seed, int):
        seeds = [seed + b for b in range(batch)]
    else:
        seeds = _per_request("seed", seed, batch, int)
    eos = set(_eos_ids(eos_token_id, model.config))

    lengths = [len(p) for p in prompt_ids]
    cache = model.new_cache(
        batch, max(n + m for n, m in zip(lengths, limits)), layout=cache_layout, block_size=block_size
    )
    temps_d = torch.tensor(temps, dtype=torch.float32, device=device)
    top_ks_d = torch.tensor(top_ks, dtype=torch.int32, device=device)
    top_ps_d = torch.tensor(top_ps, dtype=torch.float32, device=device)
    seeds_d = torch.tensor(seeds, dtype=torch.int64, device=device)
    generated = [0] * batch
    running = list(range(batch))
    tokens = [t for p in prompt_ids for t in p]
    counts = lengths  # query rows per request this step (0 for finished requests)
    while running:
        q_offsets = _to_device(_offsets(counts), torch.int32, device)
        rows = q_offsets[1:].long() - 1  # each request's last row (only running requests have rows)
        active = _to_device(running, torch.int64, device)
        cache.reserve(counts)  # host-known sizes: the layer writes need no sync
        metadata = AttentionMetadata(q_offsets)
        ids = _to_device(tokens, torch.int64, device)
        positions = causal_positions(q_offsets, cache.seq_lens, len(tokens))
        logits, _ = model(ids, positions, metadata, cache, logits_rows=rows.index_select(0, active))
        cache.advance(torch.diff(q_offsets))
        offsets_d = _to_device([generated[b] for b in running], torch.int64, device)
        new, invalid = sample(
            logits,
            temps_d.index_select(0, active),
            top_ks_d.index_select(0, active),
            top_ps_d.index_select(0, active),
            seeds_d.index_select(0, active),
            offsets_d,
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


def _eos_ids(eos_token_id, config) -> tuple[int, ...]:
    if isinstance(eos_token_id, str):
        if eos_token_id != DEFAULT_EOS:
            raise ValueError(f"eos_token_id must be an int, ints, None or {DEFAULT_EOS!r}, got {eos_token_id!r}")
        return tuple(config.eos_token_ids)
    if eos_token_id is None:
        return ()
    ids = (eos_token_id,) if isinstance(eos_token_id, int) else tuple(eos_token_id)
    if not all(isinstance(i, int) for i in ids):
        raise ValueError(f"eos_token_id must hold ints, got {eos_token_id!r}")
    return ids


def _offsets(counts: list[int]) -> list[int]:
    out = [0]
    for c in counts:
        out.append(out[-1] + c)
    return out


def _to_device(values: list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Host ints to the device without making the host wait (pinned buffer, asynchronous copy)."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
