"""Chain verification (draft-model / n-gram / top-1-head speculation) and plain sampling.

A chain of K draft tokens is the token tree whose parents are ``i - 1``, so the Triton
path reuses ``verify_tree``'s kernels in their chain mode, where the kernels derive the
tree view (node j > 0 of request b is draft ``draft_offsets[b] + j - 1``, its parent is
j - 1) from the draft offsets themselves: no extra tensors, no host synchronisation.
The PyTorch reference below is written from the chain math itself
(Leviathan et al. 2022; Chen et al. 2023), independently of the tree engine, so the
two paths check each other token for token.

Math. For draft tokens x_1..x_K with draft distributions q_i and filtered target
distributions p_i: accept x_i when ``u_i * q_i(x_i) < p_i(x_i)`` (probability
min(1, p/q)); at the first rejection sample from norm(max(0, p_i - q_i)) and stop;
if all K are accepted sample the bonus token from p_{K+1}. A deterministic draft
(``draft_probs=None``) has q one-hot: accept with probability p_i(x_i), and the
residual is p_i with x_i removed. Greedy (temperature <= 0): accept while x_i is
argmax p_i, then emit the argmax. Uniforms: ``counter_uniform(seed, offset, 2i)`` for
the test of x_i (i = 1..K), ``2i + 1`` for the sample drawn from target row i (0-based).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from specdec import _backend
from specdec.kernels._checks import check_offsets, check_tensor
from specdec.kernels.sampling import (
    filter_thresholds_reference,
    inverse_cdf_reference,
    request_key,
    sanitize_draft_probs,
    scaled_logits,
    target_probs_reference,
    uniform_from_key,
)
from specdec.kernels.verify_tree import (
    RESIDUAL_EPS,
    _check_common,
    _check_draft_rows,
    _check_out,
    _verify_tree_op,
)


class ChainVerifyResult(NamedTuple):
    output_tokens: torch.Tensor
    num_accepted: torch.Tensor
    invalid: torch.Tensor


# ----------------------------------------------------------------------------- public ops


def verify_chain(
    target_logits: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_offsets: torch.Tensor,
    draft_probs: torch.Tensor | None,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seed: torch.Tensor,
    offset: torch.Tensor,
    *,
    max_draft_len: int | None = None,
    out: ChainVerifyResult | None = None,
) -> ChainVerifyResult:
    """Verify ragged draft chains: accepted prefix, then a residual sample or the bonus token.

    Parameters
    ----------
    target_logits : fp32/fp16/bf16 ``[T + B, V]``; request b owns rows
        ``draft_offsets[b] + b .. draft_offsets[b+1] + b`` (K_b + 1 rows): row i scores
        draft token i, the last one gives the bonus token.
    draft_tokens : int32 ``[T]``; the drafts of all requests, flattened.
    draft_offsets : int32 ``[B+1]``; request b drafted ``draft_tokens[draft_offsets[b]:draft_offsets[b+1]]``
        (K_b = 0 allowed: that request just samples one token).
    draft_probs : float ``[T, V]`` or None; row t is exactly the distribution draft token t was
        sampled from (after the draft's own filtering). None = deterministic draft (q one-hot).
    temperature : fp32 ``[B]`` (<= 0 = greedy, no softmax). top_k : int32 ``[B]`` (0 = off).
        top_p : fp32 ``[B]`` (1 = off). The filter applies to the target distribution.
    seed, offset : int64 ``[B]``; uniforms are ``counter_uniform(seed, offset, counter)``; advance
        ``offset`` every step. Same seed -> same tokens, alone or in any batch and row order.
    max_draft_len : host int, the output width minus one; passing it avoids one host
        synchronisation. Longer drafts are truncated to it (still exact). On CUDA with it
        given, ``draft_offsets`` values are trusted (not read back); CPU inputs are always checked.
    out : optional ChainVerifyResult of buffers to write into.

    Returns
    -------
    ChainVerifyResult(output_tokens int32 ``[B, max_K+1]``: accepted drafts, then one sampled
    token, -1 padded; num_accepted int32 ``[B]`` (emitted = accepted + 1); invalid bool ``[B]``).

    Edge cases (specified): a request with a NaN/+inf or all -inf target row is ``invalid``
    (tokens -1, num_accepted 0); a draft token outside ``[0, V)`` is rejected and never used
    as an index; p(x) = 0 (also when top-k/top-p removed x) and q(x) = 0, NaN, inf or > 1
    are never accepted; non-finite or negative q count as 0 in the residual; a residual with
    mass below ``RESIDUAL_EPS`` (p == q up to rounding) is replaced by p; no id >= V is ever
    returned whatever the tile size.

    Example
    -------
    >>> logits = torch.randn(4, 50)                        # B = 1, K = 3
    >>> r = verify_chain(logits, torch.tensor([3, 1, 4], dtype=torch.int32),
    ...                  torch.tensor([0, 3], dtype=torch.int32), None, torch.zeros(1),
    ...                  torch.zeros(1, dtype=torch.int32), torch.ones(1), torch.tensor([0]), torch.tensor([0]))
    >>> r.output_tokens.shape, int(r.num_accepted[0]) <= 3
    (torch.Size([1, 4]), True)
    """
    device = _check_common(target_logits, "draft_offsets", draft_offsets, draft_probs, temperature, top_k, top_p,
                           seed, offset)  # fmt: skip
    rows, vocab = target_logits.shape
    batch = draft_offsets.numel() - 1
    check_tensor("draft_tokens", draft_tokens, dtype=torch.int32, ndim=1, device=device)
    total = draft_tokens.numel()
    if rows != total + batch:
        raise ValueError(f"target_logits must have T + B = {total} + {batch} rows (K_b + 1 per request), got {rows}")
    if draft_probs is not None:
        _check_draft_rows("draft_probs", draft_probs, total, vocab)
    if max_draft_len is None or device.type == "cpu":
        bounds = check_offsets("draft_offsets", draft_offsets, total=total)
        if max_draft_len is None:
            max_draft_len = max((bounds[i + 1] - bounds[i] for i in range(batch)), default=0)
    if not isinstance(max_draft_len, int) or max_draft_len < 0:
        raise ValueError(f"max_draft_len must be a non-negative int, got {max_draft_len!r}")
    width = max_draft_len + 1
    buffers = None if out is None else (out.output_tokens, out.num_accepted, None, out.invalid)
    tokens, path, num_acc, invalid = _check_out(buffers, batch, width, device)
    if _backend.select_backend(target_logits) == "triton":
        draft_tokens = draft_tokens.contiguous()
        _verify_tree_op(
            target_logits, draft_tokens, draft_tokens, draft_offsets, draft_probs, None,
            temperature, top_k, top_p, seed, offset, width, True, tokens, path, num_acc, invalid,
        )  # fmt: skip
    else:
        ref = verify_chain_reference(
            target_logits, draft_tokens, draft_offsets, draft_probs, temperature, top_k, top_p, seed, offset,
            max_draft_len=max_draft_len,
        )  # fmt: skip
        for dst, src in zip((tokens, num_acc, invalid), ref):
            dst.copy_(src)
    return ChainVerifyResult(tokens, num_acc, invalid)


def sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seed: torch.Tensor,
    offset: torch.Tensor,
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row: ``verify_chain`` with K = 0 (same filter, uniforms and edge cases).

    Parameters
    ----------
    logits : fp32/fp16/bf16 ``[B, V]``. temperature fp32 ``[B]`` (<= 0 = argmax), top_k int32
        ``[B]`` (0 = off), top_p fp32 ``[B]`` (1 = off), seed / offset int64 ``[B]`` (the token of
        row b uses ``counter_uniform(seed[b], offset[b], 1)``).
    out : optional (tokens int32 ``[B]``, invalid bool ``[B]``) to write into.

    Returns
    -------
    (tokens int32 ``[B]``, invalid bool ``[B]``); invalid rows (NaN/+inf or all -inf) get -1.

    Example
    -------
    >>> top_k = torch.tensor([0, 20], dtype=torch.int32)
    >>> tokens, invalid = sample(torch.randn(2, 100), torch.tensor([0.0, 0.8]), top_k, torch.tensor([1.0, 0.9]),
    ...                          torch.tensor([1, 2]), torch.tensor([0, 0]))
    >>> tokens.shape, bool(invalid.any())
    (torch.Size([2]), False)
    """
    check_tensor("logits", logits, dtype=(torch.float32, torch.float16, torch.bfloat16), ndim=2)
    batch = logits.shape[0]
    device = logits.device
    if out is None:
        tokens = torch.empty(batch, dtype=torch.int32, device=device)
        invalid = torch.empty(batch, dtype=torch.bool, device=device)
    else:
        tokens, invalid = out
        check_tensor("out[0]", tokens, dtype=torch.int32, shape=(batch,), device=device, contiguous=True)
        check_tensor("out[1]", invalid, dtype=torch.bool, shape=(batch,), device=device, contiguous=True)
    verify_chain(
        logits, torch.empty(0, dtype=torch.int32, device=device), torch.zeros(batch + 1, dtype=torch.int32,
        device=device), None, temperature, top_k, top_p, seed, offset, max_draft_len=0,
        out=ChainVerifyResult(tokens.view(batch, 1), torch.empty(batch, dtype=torch.int32, device=device), invalid),
    )  # fmt: skip
    return tokens, invalid


# ----------------------------------------------------------------------------- PyTorch reference


def verify_chain_reference(
    target_logits, draft_tokens, draft_offsets, draft_probs, temperature, top_k, top_p, seed, offset,
    *, max_draft_len: int,
) -> ChainVerifyResult:  # fmt: skip
    """Readable PyTorch implementation of ``verify_chain`` (same contract), vectorised over requests."""
    bounds = check_offsets("draft_offsets", draft_offsets, total=draft_tokens.numel())
    device = target_logits.device
    vocab = target_logits.shape[1]
    batch, total = len(bounds) - 1, draft_tokens.numel()
    every = torch.arange(batch, device=device)
    draft_start = torch.tensor(bounds[:-1], device=device)
    k = (torch.tensor(bounds[1:], device=device) - draft_start).clamp_max(max_draft_len)
    row_start = draft_start + every  # request b's first target row
    row_req = torch.repeat_interleave(every, torch.tensor(bounds[1:], device=device) - draft_start + 1)
    temp_rows = temperature[row_req]
    s = scaled_logits(target_logits, temp_rows)
    p, argmax, bad = target_probs_reference(
        s, filter_thresholds_reference(s, temp_rows, top_k[row_req], top_p[row_req])
    )
    invalid = torch.zeros(batch, dtype=torch.long, device=device).scatter_reduce(0, row_req, bad.long(), "amax") > 0
    greedy = temperature <= 0
    key = request_key(seed, offset)
    tokens = torch.full((batch, max_draft_len + 1), -1, dtype=torch.long, device=device)
    accepted = torch.zeros(batch, dtype=torch.long, device=device)
    rejected = torch.zeros(batch, dtype=torch.bool, device=device)
    stop = k.clone()  # target row (0-based within the request) of the final sample
    rejected_draft = torch.zeros(batch, dtype=torch.long, device=device)  # which draft index was rejected
    for i in range(max_draft_len):
        live = ~invalid & ~rejected & (i < k)
        draft = (draft_start + i).clamp_max(max(total - 1, 0))
        tok = draft_tokens[draft].long() if total else torch.zeros_like(draft)
        row = row_start + k.clamp_max(i)  # rows past a request's drafts are never used
        valid = (tok >= 0) & (tok < vocab)
        safe = torch.where(valid, tok, 0)
        px = torch.where(valid, p[row, safe], 0.0)
        u = uniform_from_key(key, 2 * (i + 1))
        if draft_probs is not None:
            qx = draft_probs[draft, safe].float()
            accept = valid & (qx > 0) & (qx <= 1) & (u * qx < px)
        else:
            accept = valid & (u < px)  # q one-hot: min(1, p/q) = p(x)
        accept = torch.where(greedy, valid & (tok == argmax[row]), accept)
        took, now_rejected = live & accept, live & ~accept
        tokens[took, i] = tok[took]
        accepted += took.long()
        stop = torch.where(now_rejected, i, stop)
        rejected_draft = torch.where(now_rejected, draft, rejected_draft)
        rejected |= now_rejected
    row = row_start + stop
    p_row = p[row]
    if draft_probs is not None:
        residual = (p_row - sanitize_draft_probs(draft_probs[rejected_draft])).clamp_min(0.0)
        mass_total = residual.sum(-1)
    else:
        tok = draft_tokens[rejected_draft].long() if total else torch.zeros_like(rejected_draft)
        valid = (tok >= 0) & (tok < vocab)
        drop = torch.zeros_like(p_row, dtype=torch.bool)
        drop[every[valid], tok[valid]] = True
        residual = torch.where(drop, 0.0, p_row)
        mass_total = 1.0 - (p_row * drop).sum(-1)
    use_residual = rejected & (mass_total > RESIDUAL_EPS)  # else: sample from p
    mass = torch.where(use_residual[:, None], residual, p_row)
    total_mass = torch.where(use_residual, mass_total, 1.0)
    u = uniform_from_key(key, 2 * stop + 1)
    final = torch.where(greedy, argmax[row], inverse_cdf_reference(mass, u * total_mass))
    tokens[every, accepted] = final
    tokens[invalid] = -1
    num_accepted = torch.where(invalid, 0, accepted)
    return ChainVerifyResult(tokens.to(torch.int32), num_accepted.to(torch.int32), invalid)
