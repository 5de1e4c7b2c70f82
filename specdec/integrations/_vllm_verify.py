"""vLLM batches verified by specdec: the conversions from vLLM's conventions and the plugin's counters.

``verify_v1_batch`` (V1 model runner, with ``chain_layout``, ``request_seeds`` and ``first_positions``) and
``verify_v2_batch`` (Model Runner V2) hold every conversion between vLLM's conventions and specdec's; both call
specdec once, through ``_verify_exact``, which counts what it verified. ``note_fallback`` counts the batches handed
to vLLM's own sampler, ``stats()`` reads the counters. ``specdec.integrations.vllm`` (the plugin's entry point) and
``specdec.integrations._vllm_samplers`` (the vLLM subclasses) both import this module; it imports no vLLM.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping
from typing import NamedTuple

import torch

from specdec.kernels import verify_chain, verify_chain_greedy
from specdec.kernels.sampling_params import SamplingParams

# vLLM configures the "vllm" logger only; a child of it prints with vLLM's own messages.
logger = logging.getLogger("vllm.specdec")

_SEED_HIGH = 2**62  # unseeded requests' seeds, drawn in [0, 2**62): any int64 works, this keeps them non-negative
_DRAW_OFFSET = 4  # how far one draw moves an offset-keeping (Philox) generator: what vLLM's rewind subtracts

_stats: Counter = Counter()
_logged_reasons: set[str] = set()
# Per-step (num_accepted, invalid) tensors, summed only when read or every _PENDING_MAX steps:
# no device work per step for the counters, and no host sync.
_pending: list[tuple[torch.Tensor, torch.Tensor]] = []
_PENDING_MAX = 256
_totals: dict[torch.device, torch.Tensor] = {}  # device -> int64 [accepted, invalid]


# ----------------------------------------------------------------------------- the one call into specdec


def _verify_exact(
    logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_offsets: torch.Tensor,
    params: SamplingParams | None,
    draft_probs: torch.Tensor | None,
    max_draft_len: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """specdec's exact verification, then every invalid request given exactly one token.

    ``params`` None means every request is greedy, a fact the caller knows on the host: the argmax-only
    ``verify_chain_greedy`` runs (equal to ``verify_chain`` at temperature 0, with no softmax, filters or random
    numbers). Otherwise ``verify_chain`` with the rule the drafts follow: ``draft_probs`` given -> "stochastic" (the
    drafts were drawn from them), None -> "deterministic" (n-gram, argmax drafters). vLLM built the offsets and the
    caller laid the rows out in ``verify_chain``'s order, so the ops run without re-checking them (``check=False``).

    An invalid request (NaN/+inf or all -inf logits) comes back with no token. vLLM's scheduler, however, counts every
    request's accepted drafts from the number of tokens it gets back (``len - 1``), so a request with none would
    keep its draft positions as computed. It gets one token instead, with every draft rejected: the argmax of its
    first target row with NaN read as -inf (0 when nothing is finite), as a stock argmax would pick.

    Returns (output_tokens int32 ``[B, max_draft_len + 1]`` -1 padded, num_accepted int32 ``[B]``).
    """
    if params is None:
        result = verify_chain_greedy(
            logits, draft_tokens, draft_offsets, None, max_draft_len=max_draft_len, check=False
        )
    else:
        rule = "deterministic" if draft_probs is None else "stochastic"
        result = verify_chain(logits, draft_tokens, draft_offsets, params, rule=rule, draft_probs=draft_probs,
                              max_draft_len=max_draft_len, check=False)  # fmt: skip
    tokens, invalid = result.output_tokens, result.invalid
    # On the CPU reading the flag costs nothing and skips the rescue in the usual case; on a GPU the
    # rescue always runs (a few tiny launches) so that the step never waits for the device.
    if logits.device.type != "cpu" or bool(invalid.any()):
        batch = tokens.shape[0]
        first_rows = draft_offsets[:-1].long() + torch.arange(batch, device=logits.device)
        rescue = torch.nan_to_num(logits.index_select(0, first_rows).float(), nan=float("-inf")).argmax(-1)
        tokens[:, 0] = torch.where(invalid, rescue.to(tokens.dtype), tokens[:, 0])
    _count(result.num_accepted, invalid, draft_tokens.numel())
    return tokens, result.num_accepted


# ----------------------------------------------------------------------------- vLLM conventions -> specdec


class ChainLayout(NamedTuple):
    """Where ``verify_chain``'s rows come from in a V1 step's logits, and where vLLM's rows land in them.

    ``verify_chain`` wants each request's K_b draft rows, then its bonus row: chain row
    ``draft_offsets[b] + b + j`` scores request b's draft j, row ``draft_offsets[b + 1] + b`` its bonus.
    """

    source_rows: torch.Tensor  # int32 [T + B]: the logits row each chain row is read from
    target_rows: torch.Tensor  # int64 [T]: the chain row of each draft (vLLM's target_logits_indices, relaid)
    bonus_rows: torch.Tensor  # int64 [B]: the chain row of each request's bonus (bonus_logits_indices, relaid)


def chain_layout(
    target_logits_indices: torch.Tensor, bonus_logits_indices: torch.Tensor, cu_num_draft_tokens: torch.Tensor
) -> ChainLayout:
    """Read vLLM's index tensors into ``verify_chain``'s row order (device ops only: no host sync).

    vLLM's ``RejectionSampler.forward`` takes the logits rows of draft t at
    ``target_logits_indices[t]`` (drafts in request order, ``cu_num_draft_tokens`` inclusive sums)
    and request b's bonus row at ``bonus_logits_indices[b]``, wherever they are in the logits:
    the engine's own order (each request's draft rows, then its bonus row), any other order,
    rows repeated, or rows between them that belong to no request.
    """
    total, batch = target_logits_indices.numel(), bonus_logits_indices.numel()
    if cu_num_draft_tokens.numel() != batch:
        raise ValueError(f"bonus_logits_indices must hold one row per request ({cu_num_draft_tokens.numel()}), "
                         f"got {batch}")  # fmt: skip
    device = bonus_logits_indices.device
    cu = cu_num_draft_tokens.long()
    bonus_rows = cu + torch.arange(batch, device=device)
    drafts = torch.arange(total, device=device)
    target_rows = drafts + torch.searchsorted(cu, drafts, right=True)  # + the request of each draft
    source_rows = torch.empty(total + batch, dtype=torch.int32, device=device)
    source_rows.index_copy_(0, target_rows, target_logits_indices.to(torch.int32))
    source_rows.index_copy_(0, bonus_rows, bonus_logits_indices.to(torch.int32))
    return ChainLayout(source_rows, target_rows, bonus_rows)


def chain_logits(logits: torch.Tensor, layout: ChainLayout) -> torch.Tensor:
    """The logits rows in ``verify_chain``'s order: one gather.

    On the CPU, where reading the indices makes nothing wait, the engine's own order (already
    ``verify_chain``'s, the usual case) is recognised and passed without a copy.
    """
    rows = layout.source_rows
    if (logits.device.type == "cpu" and rows.numel() == logits.shape[0]
            and torch.equal(rows, torch.arange(rows.numel(), dtype=rows.dtype))):  # fmt: skip
        return logits
    return logits.index_select(0, rows)


def request_seeds(batch: int, generators: Mapping[int, torch.Generator], device: torch.device) -> torch.Tensor:
    """One int64 seed per request: a seeded request's own seed, a fresh random one for the others.

    vLLM gives a request with ``SamplingParams.seed`` its own generator, seeded with that seed;
    ``initial_seed()`` reads it back on the host. With ``offset`` = the position of the token,
    such a request's uniforms depend on (seed, position) only: not on the step, the number of
    drafts, the batch or the generator's state. Requests without a seed draw a seed from the
    global RNG every step (stock vLLM samples them with the global RNG too).

    The plugin draws nothing from the generators. vLLM rewinds a seeded generator by one draw
    (``set_offset(get_offset() - 4)``) after a step whose token it discards (a partial prefill);
    generators that keep an offset (not the CPU's) are advanced by that much on the host each
    step, so the rewind never goes below zero.
    """
    seed = torch.randint(_SEED_HIGH, (batch,), dtype=torch.int64, device=device)
    rows, values = [], []
    for row, generator in generators.items():
        if row < batch:
            rows.append(row)
            values.append(_as_int64(generator.initial_seed()))
            if generator.device.type != "cpu":
                generator.set_offset(generator.get_offset() + _DRAW_OFFSET)
    if rows:
        pinned = device.type == "cuda"
        own = torch.tensor([rows, values], dtype=torch.int64, pin_memory=pinned).to(device, non_blocking=pinned)
        seed.index_copy_(0, own[0], own[1])
    return seed


def _as_int64(seed: int) -> int:
    """A generator's seed (unsigned 64-bit) as the int64 with the same bits."""
    return seed - 2**64 if seed >= 2**63 else seed


def first_positions(
    layout: ChainLayout, logits_indices: torch.Tensor, token_positions: torch.Tensor, cu_num_draft_tokens: torch.Tensor
) -> torch.Tensor:
    """int64 ``[B]``: the position of the first token each request's rows decide this step.

    Logits row r was computed at the step's input token ``logits_indices[r]``, at position
    ``token_positions[logits_indices[r]]`` (the model runner's ``positions``), and decides the token
    after it. Request b's first chain row is ``cu_num_draft_tokens[b - 1] + b``.
    """
    batch = cu_num_draft_tokens.numel()
    cu = cu_num_draft_tokens.long()
    first = torch.nn.functional.pad(cu[:-1], (1, 0)) + torch.arange(batch, device=cu.device)
    inputs = logits_indices.index_select(0, layout.source_rows.index_select(0, first))
    return token_positions.index_select(0, inputs).long() + 1


class V1Verified(NamedTuple):
    """A verified V1 step: what ``RejectionSampler.forward`` returns, and the rows it was read from."""

    output_token_ids: torch.Tensor  # int32 [B, max_spec_len + 1], -1 padded
    num_accepted: torch.Tensor  # int32 [B]
    logits: torch.Tensor  # [T + B, V]: the logits rows in verify_chain's order
    layout: ChainLayout


def verify_v1_batch(
    logits: torch.Tensor,
    draft_token_ids: torch.Tensor,
    cu_num_draft_tokens: torch.Tensor,
    max_spec_len: int,
    draft_probs: torch.Tensor | None,
    *,
    target_logits_indices: torch.Tensor,
    bonus_logits_indices: torch.Tensor,
    logits_indices: torch.Tensor,
    token_positions: torch.Tensor | None,
    temperature: torch.Tensor | None,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    generators: Mapping[int, torch.Generator],
    all_greedy: bool,
) -> V1Verified:
    """Verify one V1 model-runner step with specdec: all of V1's conventions, converted here.

    Parameters (vLLM V1 names; ``B`` requests, ``T`` drafts, ``V`` vocabulary)
    ----------
    logits : float ``[R, V]``, the target's raw logits. Its rows are read only through
        ``target_logits_indices`` ``[T]`` (draft t's row) and ``bonus_logits_indices`` ``[B]`` (request
        b's bonus row): any layout vLLM's ``RejectionSampler.forward`` allows, one gather into
        ``verify_chain``'s order (``chain_layout``, ``chain_logits``).
    draft_token_ids : int ``[T]`` (-1 = a padded draft, always rejected; specdec rejects any id
        outside ``[0, V)``). cu_num_draft_tokens : int ``[B]``, inclusive cumulative counts:
        ``draft_offsets`` is it with a leading 0. max_spec_len : host int, the output width
        minus one (``verify_chain``'s ``max_draft_len``; no host synchronisation).
    draft_probs : float ``[T, V]`` or None. None (n-gram, greedy drafting) -> rule
        "deterministic"; given (``draft_sample_method="probabilistic"``: rows are the
        temperature-scaled distributions the drafts were drawn from) -> "stochastic".
    logits_indices : int ``[R]``, the step's input token each logits row was computed at;
        token_positions : int64, the model runner's ``positions`` (each input token's position).
        ``offset`` = the position of the first token the request's rows decide
        (``first_positions``); read only for sampled batches (None is refused there).
    temperature : fp32 ``[B]`` or None (None = all greedy). vLLM stores 0.0 for greedy
        requests (``temperature < 1e-5`` is greedy in vLLM), specdec's greedy is ``<= 0``.
    top_k : int ``[B]`` or None. vLLM's "off" is ``V`` (or <= 0), specdec's is 0.
    top_p : fp32 ``[B]`` or None (off); 1.0 is off in both.
    generators : vLLM's ``{row: torch.Generator}`` of seeded requests -> ``seed``
        (``request_seeds``: the request's own seed; a fresh random one where it has none).
    all_greedy : host bool, vLLM's ``SamplingMetadata.all_greedy`` (every request greedy): then
        ``verify_chain_greedy`` runs, reading only the logits' argmax; ``draft_probs``,
        positions, temperature, top-k, top-p and the generators are not read.

    Returns
    -------
    ``V1Verified``: output_token_ids int32 ``[B, max_spec_len + 1]``, -1 padded (exactly what
    vLLM's ``RejectionSampler`` returns, so ``parse_output`` and the scheduler read it unchanged);
    num_accepted int32 ``[B]``; the logits in ``verify_chain``'s order and the ``ChainLayout``, from
    which the caller computes log-probabilities with vLLM's own code.
    """
    batch = cu_num_draft_tokens.numel()
    total = draft_token_ids.numel()
    if target_logits_indices.numel() != total:
        raise ValueError(f"target_logits_indices must hold one row per draft ({total}), "
                         f"got {target_logits_indices.numel()}")  # fmt: skip
    layout = chain_layout(target_logits_indices, bonus_logits_indices, cu_num_draft_tokens)
    rows = chain_logits(logits, layout)
    draft_offsets = torch.nn.functional.pad(cu_num_draft_tokens.to(torch.int32), (1, 0))
    draft_tokens = draft_token_ids.to(torch.int32)
    if all_greedy:
        tokens, accepted = _verify_exact(rows, draft_tokens, draft_offsets, None, None, max_spec_len)
        return V1Verified(tokens, accepted, rows, layout)
    if token_positions is None:
        raise ValueError("token_positions (the model runner's positions) is needed to key a sampled batch's "
                         "random numbers on the positions of its tokens")  # fmt: skip
    device, vocab = rows.device, rows.shape[1]
    if top_k is None:
        top_k = torch.zeros(batch, dtype=torch.int32, device=device)
    else:
        top_k = torch.where((top_k <= 0) | (top_k >= vocab), 0, top_k).to(torch.int32)
    params = SamplingParams(
        temperature=torch.zeros(batch, device=device) if temperature is None else temperature.float(),
        top_k=top_k,
        top_p=torch.ones(batch, device=device) if top_p is None else top_p.float(),
        seed=request_seeds(batch, generators, device),
        offset=first_positions(layout, logits_indices, token_positions, cu_num_draft_tokens),
    )
    tokens, accepted = _verify_exact(rows, draft_tokens, draft_offsets, params, draft_probs, max_spec_len)
    return V1Verified(tokens, accepted, rows, layout)


def verify_v2_batch(
    processed_logits: torch.Tensor,
    draft_sampled: torch.Tensor,
    cu_num_logits: torch.Tensor,
    pos: torch.Tensor,
    idx_mapping: torch.Tensor,
    *,
    temperature: torch.Tensor,
    seeds: torch.Tensor,
    draft_logits: torch.Tensor | None,
    num_speculative_steps: int,
    all_greedy: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify one Model Runner V2 chunk with specdec: all of V2's conventions, converted here.

    Parameters (vLLM MRV2 names; ``B`` requests, ``N = T + B`` logits rows)
    ----------
    processed_logits : float ``[N, V]`` from vLLM's ``apply_sampling_params``: penalties, bad
        words, logit bias, min_tokens, temperature, min_p, top-k and top-p already applied,
        so specdec samples them as they are: temperature 1 (0 for greedy requests, whose
        argmax the processing keeps), top-k and top-p off. Rows per request: its K_b + 1
        rows, drafts then bonus, as ``verify_chain`` wants.
    draft_sampled : int ``[N]``, the input token of each logits row (-1 = a draft to reject).
        Row 0 of a request is its last accepted token and row j its draft j, so the drafts
        are every row but each request's first: ``draft_tokens[t] = draft_sampled[t + b(t) + 1]``.
    cu_num_logits : int ``[B + 1]``; ``draft_offsets = cu_num_logits - arange(B + 1)``.
    pos : int ``[N]``, the position of each row's input token. seed = ``seeds[idx_mapping]``
        (vLLM's per-request seed: the request's own, or one vLLM drew for it), offset = the
        position of the first token the request's rows decide (its first row's ``pos`` + 1): the
        uniforms of a token depend on (seed, its position) only.
    idx_mapping : int ``[B]``, batch row -> request-state row. temperature : fp32, per state row.
    draft_logits : ``[max_reqs, num_speculative_steps, V]`` or None, stored before
        temperature: q = softmax(draft_logits / temperature) -> "stochastic"; None ->
        "deterministic".
    all_greedy : host bool, every request of the chunk has temperature 0 (the caller reads vLLM's
        host copy of the temperatures): ``verify_chain_greedy`` on the processed logits, nothing
        else read.

    Returns (sampled int64 ``[B, num_speculative_steps + 1]`` -1 padded, num_sampled int32 ``[B]``),
    what vLLM's ``rejection_sample`` returns.
    """
    batch = idx_mapping.numel()
    device = processed_logits.device
    total = processed_logits.shape[0] - batch
    every = torch.arange(batch + 1, device=device)
    draft_offsets = (cu_num_logits.long() - every).to(torch.int32)
    num_drafts = draft_offsets[1:] - draft_offsets[:-1]
    request_of_draft = torch.repeat_interleave(every[:-1], num_drafts, output_size=total)
    draft_rows = torch.arange(total, device=device) + request_of_draft + 1
    draft_tokens = draft_sampled.index_select(0, draft_rows).to(torch.int32)
    if all_greedy:
        tokens, num_accepted = _verify_exact(processed_logits, draft_tokens, draft_offsets, None, None,
                                             num_speculative_steps)  # fmt: skip
        return tokens.to(torch.int64), num_accepted + 1
    idx = idx_mapping.long()
    req_temperature = temperature.index_select(0, idx).float()
    params = SamplingParams(
        temperature=(req_temperature > 0).to(torch.float32),
        top_k=torch.zeros(batch, dtype=torch.int32, device=device),
        top_p=torch.ones(batch, device=device),
        seed=seeds.index_select(0, idx).to(torch.int64),
        offset=pos.index_select(0, cu_num_logits[:-1].long()).to(torch.int64) + 1,
    )
    draft_probs = None
    if draft_logits is not None:
        step = torch.arange(total, device=device) - draft_offsets.long().index_select(0, request_of_draft)
        scale = torch.where(req_temperature > 0, req_temperature, 1.0).index_select(0, request_of_draft)
        raw = draft_logits[idx.index_select(0, request_of_draft), step].float()
        draft_probs = torch.softmax(raw / scale[:, None], dim=-1)
    tokens, num_accepted = _verify_exact(processed_logits, draft_tokens, draft_offsets, params, draft_probs,
                                         num_speculative_steps)  # fmt: skip
    return tokens.to(torch.int64), num_accepted + 1


# ----------------------------------------------------------------------------- counters


def _count(num_accepted: torch.Tensor, invalid: torch.Tensor, drafted: int) -> None:
    _stats["verify_calls"] += 1
    _stats["verified_requests"] += invalid.numel()
    _stats["draft_tokens"] += drafted
    _pending.append((num_accepted, invalid))
    if len(_pending) >= _PENDING_MAX:
        _fold_pending()


def _fold_pending() -> None:
    """Add the pending per-step counts into one int64 ``[accepted, invalid]`` total per device (no host sync)."""
    for device in {accepted.device for accepted, _ in _pending}:
        steps = [pair for pair in _pending if pair[0].device == device]
        pair = torch.stack([torch.cat(column).sum(dtype=torch.int64) for column in zip(*steps)])
        # out of place: vLLM steps run under inference mode, stats() may not (no in-place update of their tensors)
        _totals[device] = _totals[device] + pair if device in _totals else pair
    _pending.clear()


def note_fallback(reason: str) -> None:
    """Count one batch handed to vLLM's own sampler; log each reason the first time."""
    _stats["fallback_calls"] += 1
    _stats[f"fallback: {reason}"] += 1
    if reason not in _logged_reasons:
        _logged_reasons.add(reason)
        logger.warning("specdec: %s -> this batch (and later ones like it) verified by vLLM's own sampler", reason)


def stats() -> dict[str, int]:
    """Counters since the last ``reset_stats()``: verify_calls, verified_requests, draft_tokens,
    accepted_tokens, invalid_requests, fallback_calls and ``fallback: <reason>`` (reads back the
    device counters)."""
    _fold_pending()
    out = dict(_stats)
    totals = [total.tolist() for total in _totals.values()]
    out.update(accepted_tokens=sum(t[0] for t in totals), invalid_requests=sum(t[1] for t in totals))
    return out


def reset_stats() -> None:
    _stats.clear()
    _logged_reasons.clear()
    _pending.clear()
    _totals.clear()
