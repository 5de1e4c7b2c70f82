"""sample: one token per row of logits under temperature, top-k and top-p.

It is verification with no drafts (``verify_chain`` with K = 0 for every request): the same
filter, the same draw (the race keyed on position ``offset``, ``uniforms``) and the same edge cases, so a
request's first token and its later tokens follow one rule. On the Triton path it runs the
verification pipeline in chain mode without draft tokens.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from specdec.kernels._op import register_op
from specdec.kernels.sample_probs import race_reference
from specdec.kernels.sampling_params import SamplingParams, check_params
from specdec.kernels.target_stats import target_probs_reference
from specdec.kernels.top_k_top_p import filter_thresholds_torch, scaled_logits
from specdec.kernels.uniforms import ROLE_TARGET, race_clocks
from specdec.kernels.verification import check_logits, result_buffers, verify_triton, zero_offsets


class SampleResult(NamedTuple):
    """tokens int32 ``[B]`` (-1 for invalid rows), invalid bool ``[B]``."""

    tokens: torch.Tensor
    invalid: torch.Tensor


# ----------------------------------------------------------------------------- registered op


def _sample_triton(logits, temperature, top_k, top_p, seed, offset, tokens, invalid) -> None:
    batch = logits.shape[0]
    draft_offsets = zero_offsets(logits.device, batch + 1)
    # no draft tokens: the offsets stand in for them (never read); the walk's path and counts go to scratch
    verify_triton(logits, draft_offsets, draft_offsets, draft_offsets, None, (temperature, top_k, top_p, seed, offset),
                  (tokens.view(batch, 1), None, None, invalid), rule="deterministic", chain=True)  # fmt: skip


def _sample_torch(logits, temperature, top_k, top_p, seed, offset, tokens, invalid) -> None:
    ref = sample_reference(logits, SamplingParams(temperature, top_k, top_p, seed, offset))
    tokens.copy_(ref.tokens)
    invalid.copy_(ref.invalid)


@register_op("sample", mutates_args=("tokens", "invalid"), triton=_sample_triton, torch=_sample_torch)
def _sample_op(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    seed: torch.Tensor,
    offset: torch.Tensor,
    tokens: torch.Tensor,
    invalid: torch.Tensor,
) -> None:
    """Schema: logits ``[B, V]`` and the five parameter tensors; writes tokens and invalid ``[B]``."""


# ----------------------------------------------------------------------------- public function


def sample(
    logits: torch.Tensor, params: SamplingParams, *, out: SampleResult | None = None, check: bool = True
) -> SampleResult:
    """Draw one token per row (the target-side sampler: same filter, uniforms and edge cases as verification).

    Parameters
    ----------
    logits : fp32/fp16/bf16 ``[B, V]``.
    params : ``SamplingParams`` of ``[B]`` tensors; temperature <= 0 takes the argmax (no softmax,
        no random number); row b draws the token at position ``offset[b]``, ``argmax_i p_i / E_i``
        with the clocks ``race_clocks(seed[b], offset[b], ROLE_TARGET, V)``: the token every
        verification op emits there for a deterministic draft, whatever it drafted.
    out : optional ``SampleResult`` to write into.
    check : False skips every argument check, ``out``'s included (``specdec.kernels``): ``logits`` must
        then have contiguous rows and ``params`` be contiguous.

    Returns
    -------
    SampleResult(tokens int32 ``[B]``, invalid bool ``[B]``); rows with NaN or +inf, or no finite
    value, are invalid and get -1.

    Example
    -------
    >>> params = SamplingParams.make(2, temperature=[0.0, 0.8], top_k=[0, 20], top_p=[1.0, 0.9], seed=[1, 2])
    >>> tokens, invalid = sample(torch.randn(2, 100), params)
    >>> tokens.shape, bool(invalid.any())
    (torch.Size([2]), False)
    """
    if check:
        device = check_logits(logits, "logits")
        batch = logits.shape[0]
        check_params(params, batch, device)
        out = result_buffers(out, SampleResult, batch, 1, device)
        t, k, p, s, o = params
        params = (t.contiguous(), k.contiguous(), p.contiguous(), s.contiguous(), o.contiguous())
    elif out is None:
        out = result_buffers(None, SampleResult, logits.shape[0], 1, logits.device)
    _sample_op.run(logits, *params, *out)
    return out


# ----------------------------------------------------------------------------- PyTorch reference


def sample_reference(logits: torch.Tensor, params: SamplingParams) -> SampleResult:
    """Readable PyTorch implementation of ``sample``: the keyed race over the filtered target row."""
    temperature, top_k, top_p, seed, offset = params
    s = scaled_logits(logits, temperature)
    p, argmax, bad = target_probs_reference(s, filter_thresholds_torch(s, temperature, top_k, top_p))
    drawn = race_reference(p, race_clocks(seed, offset, ROLE_TARGET, p.shape[-1]))
    tokens = torch.where(temperature <= 0, argmax, drawn)
    return SampleResult(torch.where(bad, -1, tokens).to(torch.int32), bad)
