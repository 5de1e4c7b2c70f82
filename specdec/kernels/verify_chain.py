"""verify_chain: verify ragged draft chains (draft-model, n-gram or top-1-head speculation).

A chain of K draft tokens is the token tree whose parents are ``i - 1``, so the Triton path is
``verification.verify_triton`` in chain mode: the kernels derive the tree view (node j > 0 of
request b is draft ``draft_offsets[b] + j - 1``) from the draft offsets themselves, with no
extra tensors and no host synchronisation. The rules are derived in ``tree_walk``. The
PyTorch reference below is written from the chain math itself (Leviathan et al. 2022; Chen
et al. 2023), independently of the tree engine, so the two paths check each other token for
token. Row i of a request decides the token at position ``offset + i``. Stochastic rule: accept
x_i when ``u * q_i(x_i) < p_i(x_i)``; at the first rejection draw from norm(max(0, p_i - q_i))
and stop; after K acceptances draw the bonus token from p_{K+1}. Deterministic rule: draw the
target's token at each position exactly as ``sample`` would, accept x_i when it is that token,
and emit the draw where they first differ.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from specdec.kernels._checks import check_offsets, check_tensor, unchecked_needs
from specdec.kernels._op import register_op
from specdec.kernels.sample_probs import race_reference, sanitize_probs
from specdec.kernels.sampling_params import SamplingParams, check_params, check_rule
from specdec.kernels.target_stats import target_probs_reference
from specdec.kernels.top_k_top_p import filter_thresholds_torch, scaled_logits
from specdec.kernels.tree_walk import RESIDUAL_EPS
from specdec.kernels.uniforms import ROLE_TARGET, ROLE_TEST, counter_uniform_reference, race_clocks
from specdec.kernels.verification import (
    check_draft_probs,
    check_logits,
    check_request_offsets,
    check_width,
    result_buffers,
    verify_triton,
)


class ChainVerifyResult(NamedTuple):
    """output_tokens int32 ``[B, max_draft_len+1]``, num_accepted int32 ``[B]``, invalid bool ``[B]``."""

    output_tokens: torch.Tensor
    num_accepted: torch.Tensor
    invalid: torch.Tensor


# ----------------------------------------------------------------------------- registered op


def _verify_chain_triton(logits, tokens, offsets, draft_probs, temperature, top_k, top_p, seed, offset, rule,
                         output_tokens, num_accepted, invalid) -> None:  # fmt: skip
    # (a chain's accepted path is 0..num_accepted: the walk writes it to scratch)
    verify_triton(logits, tokens, tokens, offsets, draft_probs, (temperature, top_k, top_p, seed, offset),
                  (output_tokens, num_accepted, None, invalid), rule=rule, chain=True)  # fmt: skip


def _verify_chain_torch(logits, tokens, offsets, draft_probs, temperature, top_k, top_p, seed, offset, rule,
                        *out) -> None:  # fmt: skip
    ref = verify_chain_reference(
        logits, tokens, offsets, SamplingParams(temperature, top_k, top_p, seed, offset),
        rule=rule, draft_probs=draft_probs, max_draft_len=out[0].shape[1] - 1,
    )  # fmt: skip
    for dst, src in zip(out, ref):
        dst.copy_(src)


@register_op(
    "verify_chain",
    mutates_args=("output_tokens", "num_accepted", "invalid"),
    triton=_verify_chain_triton,
    torch=_verify_chain_torch,
)
def _verify_chain_op(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_offsets: torch.Tensor,
    draft_probs: torch.Tensor | None,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seed: torch.Tensor,
    offset: torch.Tensor,
    rule: str,
    output_tokens: torch.Tensor,
    num_accepted: torch.Tensor,
    invalid: torch.Tensor,
) -> None:
    """Schema: ``verify_chain``'s arguments with the parameters spread out, writing the result in place."""


# ----------------------------------------------------------------------------- public function


def check_chain(target_logits, draft_tokens, draft_offsets, params, max_draft_len) -> tuple[torch.device, int, int]:
    """The checks ``verify_chain`` and ``verify_chain_greedy`` share; returns (device, B, max_draft_len)."""
    device = check_logits(target_logits)
    batch = check_request_offsets("draft_offsets", draft_offsets, device)
    check_params(params, batch, device)
    if not (type(draft_tokens) is torch.Tensor and draft_tokens.dtype is torch.int32 and draft_tokens.dim() == 1
            and draft_tokens.device == device):  # fmt: skip
        check_tensor("draft_tokens", draft_tokens, dtype=torch.int32, ndim=1, device=device)
    total = draft_tokens.numel()
    if target_logits.shape[0] != total + batch:
        raise ValueError(
            f"target_logits must have T + B = {total} + {batch} rows (K_b + 1 per request), "
            f"got {target_logits.shape[0]}"
        )
    if max_draft_len is None or device.type == "cpu":
        bounds = check_offsets("draft_offsets", draft_offsets, total=total)
        if max_draft_len is None:
            max_draft_len = max((bounds[i + 1] - bounds[i] for i in range(batch)), default=0)
    return device, batch, check_width("max_draft_len", max_draft_len)


def verify_chain(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_offsets: torch.Tensor,
    params: SamplingParams,
    *,
    rule: str,
    draft_probs: torch.Tensor | None = None,
    max_draft_len: int | None = None,
    out: ChainVerifyResult | None = None,
    check: bool = True,
) -> ChainVerifyResult:
    """Verify ragged draft chains: the accepted prefix, then a residual draw or the bonus token.

    Parameters
    ----------
    target_logits : fp32/fp16/bf16 ``[T + B, V]``; request b owns rows
        ``draft_offsets[b] + b .. draft_offsets[b+1] + b`` (K_b + 1 rows): row i scores draft token
        i, the last one gives the bonus token.
    draft_tokens : int32 ``[T]``; the drafts of all requests, flattened.
    draft_offsets : int32 ``[B+1]``; request b drafted ``draft_tokens[draft_offsets[b]:draft_offsets[b+1]]``
        (K_b = 0 allowed, for any or every request: that request draws one token).
    params : ``SamplingParams`` of ``[B]`` tensors (temperature <= 0 = greedy, no softmax; top-k /
        top-p filter the target). ``offset`` is the position of the request's first token here:
        the token at output index i is decided by random numbers keyed on ``(seed, offset + i, role)``
        (``uniforms``), so the same seed gives the same tokens alone or in any batch and row order,
        and with the deterministic rule the tokens ``sample`` draws at those positions.
    rule : "stochastic" (drafts sampled from ``draft_probs``: the optimal rejection rule) or
        "deterministic" (any other drafts: n-gram, top-1 heads, or drafts drawn with the target's
        own race clocks (coupled); no ``draft_probs``: each draft is accepted when it equals the
        target's draw there).
    draft_probs : float ``[T, V]``, stochastic rule only: row t is exactly the distribution draft
        token t was drawn from (after the draft's own filtering, e.g. ``filtered_probs``).
    max_draft_len : host int, the output width minus one; passing it avoids one host
        synchronisation. Longer drafts are truncated to it (still exact). On CUDA with it given,
        ``draft_offsets`` values are trusted; CPU inputs are always checked.
    out : optional ``ChainVerifyResult`` to write into (shapes and dtypes as returned).
    check : False skips every argument check, ``out``'s included (``specdec.kernels``): ``max_draft_len`` is
        then required, and the index tensors and ``params`` must be contiguous.

    Returns
    -------
    ChainVerifyResult(output_tokens int32 ``[B, max_draft_len+1]``: accepted drafts, then one drawn
    token, -1 padded; num_accepted int32 ``[B]`` (emitted = accepted + 1); invalid bool ``[B]``).

    Edge cases (specified): a request with a NaN/+inf or all -inf target row is ``invalid`` (tokens
    -1, num_accepted 0); a draft token outside ``[0, V)`` is rejected and never used as an index;
    p(x) = 0 (also when top-k/top-p removed x) and q(x) = 0, NaN, inf or > 1 are never accepted;
    non-finite or negative q count as 0 in the residual; a residual with mass below
    ``RESIDUAL_EPS`` (p == q up to rounding) is replaced by p; no id >= V is ever returned; draft
    rows are read only where a draft was tested or rejected (a batch without drafts may pass
    ``draft_probs`` of shape ``[0, V]``).

    Example
    -------
    >>> logits = torch.randn(4, 50)                        # B = 1, K = 3
    >>> r = verify_chain(logits, torch.tensor([3, 1, 4], dtype=torch.int32), torch.tensor([0, 3], dtype=torch.int32),
    ...                  SamplingParams.make(1, temperature=0.0), rule="deterministic")
    >>> r.output_tokens.shape, int(r.num_accepted[0]) <= 3
    (torch.Size([1, 4]), True)
    """
    if check:
        device, batch, max_draft_len = check_chain(target_logits, draft_tokens, draft_offsets, params, max_draft_len)
        check_rule(rule, draft_probs)
        if draft_probs is not None:
            check_draft_probs(draft_probs, draft_tokens.numel(), target_logits.shape[1], device)
        out = result_buffers(out, ChainVerifyResult, batch, max_draft_len + 1, device)
        draft_tokens, draft_offsets = draft_tokens.contiguous(), draft_offsets.contiguous()
        t, k, p, s, o = params
        params = (t.contiguous(), k.contiguous(), p.contiguous(), s.contiguous(), o.contiguous())
    elif max_draft_len is None:
        raise unchecked_needs("max_draft_len")
    elif out is None:
        out = result_buffers(
            None, ChainVerifyResult, draft_offsets.numel() - 1, max_draft_len + 1, target_logits.device
        )
    _verify_chain_op.run(target_logits, draft_tokens, draft_offsets, draft_probs, *params, rule, *out)
    return out


# ----------------------------------------------------------------------------- PyTorch reference


def verify_chain_reference(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_offsets: torch.Tensor,
    params: SamplingParams,
    *,
    rule: str,
    draft_probs: torch.Tensor | None = None,
    max_draft_len: int,
) -> ChainVerifyResult:
    """Readable PyTorch implementation of ``verify_chain`` (same contract), vectorised over requests."""
    bounds = check_offsets("draft_offsets", draft_offsets, total=draft_tokens.numel())
    device = target_logits.device
    vocab = target_logits.shape[1]
    temperature, top_k, top_p, seed, offset = params
    batch, total = len(bounds) - 1, draft_tokens.numel()
    every = torch.arange(batch, device=device)
    draft_start = torch.tensor(bounds[:-1], dtype=torch.long, device=device)
    drafted = torch.tensor(bounds[1:], dtype=torch.long, device=device) - draft_start
    k = drafted.clamp_max(max_draft_len)
    row_start = draft_start + every  # request b's first target row
    row_req = torch.repeat_interleave(every, drafted + 1)
    temp_rows = temperature[row_req]
    s = scaled_logits(target_logits, temp_rows)
    p, argmax, bad = target_probs_reference(s, filter_thresholds_torch(s, temp_rows, top_k[row_req], top_p[row_req]))
    invalid = torch.zeros(batch, dtype=torch.long, device=device).scatter_reduce(0, row_req, bad.long(), "amax") > 0
    greedy = temperature <= 0
    stochastic = rule == "stochastic"
    # Row i of a request decides the token at position offset + i; its target draw there (plain sampling's).
    row_pos = offset[row_req] + torch.arange(target_logits.shape[0], device=device) - row_start[row_req]
    clocks = race_clocks(seed[row_req], row_pos, ROLE_TARGET, vocab)  # the race at each row's position
    drawn = race_reference(p, clocks)
    tokens = torch.full((batch, max_draft_len + 1), -1, dtype=torch.long, device=device)
    accepted = torch.zeros(batch, dtype=torch.long, device=device)
    rejected = torch.zeros(batch, dtype=torch.bool, device=device)
    stop = k.clone()  # target row (0-based within the request) of the final draw
    rejected_draft = torch.zeros(batch, dtype=torch.long, device=device)  # which draft was rejected
    for i in range(min(max_draft_len, max(k.tolist(), default=0))):  # (no iteration without drafts)
        live = ~invalid & ~rejected & (i < k)
        draft = (draft_start + i).clamp_max(total - 1)  # rows past a request's drafts are never used
        tok = draft_tokens[draft].long()
        row = row_start + k.clamp_max(i)
        valid = (tok >= 0) & (tok < vocab)
        if stochastic:
            safe = torch.where(valid, tok, 0)
            px = torch.where(valid, p[row, safe], 0.0)
            qx = draft_probs[draft, safe].float()
            u = counter_uniform_reference(seed, offset + i, ROLE_TEST)
            accept = valid & (qx > 0) & (qx <= 1) & (u * qx < px)
        else:
            accept = valid & (tok == drawn[row])  # sample, then compare
        accept = torch.where(greedy, valid & (tok == argmax[row]), accept)
        took, now_rejected = live & accept, live & ~accept
        tokens[took, i] = tok[took]
        accepted += took.long()
        stop = torch.where(now_rejected, i, stop)
        rejected_draft = torch.where(now_rejected, draft, rejected_draft)
        rejected |= now_rejected
    row = row_start + stop
    final = drawn[row]  # the target's draw where the walk stopped (a rejected deterministic draft is not it)
    if stochastic and bool(rejected.any()):  # after a rejection: the residual, drawn with the same clocks
        p_row = p[row]
        residual = (p_row - sanitize_probs(draft_probs[rejected_draft])).clamp_min(0.0)
        use_residual = rejected & (residual.sum(-1) > RESIDUAL_EPS)  # else: draw from p
        final = torch.where(use_residual, race_reference(residual, clocks[row]), final)
    final = torch.where(greedy, argmax[row], final)
    tokens[every, accepted] = final
    tokens[invalid] = -1
    num_accepted = torch.where(invalid, 0, accepted)
    return ChainVerifyResult(tokens.to(torch.int32), num_accepted.to(torch.int32), invalid)
