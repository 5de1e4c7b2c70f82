"""filtered_probs: logits to probabilities under temperature, top-k and top-p, exactly the target
distribution the verification ops use (``top_k_top_p`` for the filter, ``target_stats`` for the
normalisation), so a draft can sample its tokens from the same rule it is verified against.

Rows that are not sampled get a one-hot row at the argmax (NaN read as -inf, column 0 when no
value is finite): greedy rows (temperature <= 0, where verification compares with the argmax)
and rows that cannot be sampled (any NaN or +inf, or no finite value), which are also flagged
``invalid``. A one-hot row keeps a draft strategy well defined either way: sampling it returns
its argmax, and verification treats it as the draft's q.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from specdec.kernels._checks import check_tensor
from specdec.kernels._op import register_op
from specdec.kernels._triton import cdiv, jit, next_power_of_2, tl
from specdec.kernels.sampling_params import SamplingParams, check_params
from specdec.kernels.target_stats import (
    row_argmax_tl,
    row_normaliser_tl,
    row_stats_triton,
    target_probs_reference,
    target_tile_tl,
)
from specdec.kernels.top_k_top_p import (
    FLOAT_DTYPES,
    filter_thresholds_torch,
    filter_thresholds_triton,
    scaled_logits,
    vocab_block,
)
from specdec.kernels.tuning import TuningSpace, candidates, launch


class FilteredProbs(NamedTuple):
    """probs fp32 ``[R, V]`` (rows sum to 1), invalid bool ``[R]``."""

    probs: torch.Tensor
    invalid: torch.Tensor


# ----------------------------------------------------------------------------- Triton


@jit
def _probs_kernel(
    logits_ptr,  # [R, V], unit column stride
    inv_row_ptr,  # [R] fp32 1/T from the filter kernel
    thr_ptr,  # [R] fp32 threshold from the filter kernel
    max_ptr,  # [R, n_tiles] tile statistics (target_stats)
    sum_ptr,
    arg_ptr,
    bad_ptr,
    temp_ptr,  # [R] fp32
    probs_ptr,  # [R, V] fp32 out, unit column stride
    invalid_ptr,  # [R] bool out
    V,
    n_tiles,
    stride_in,
    stride_out,
    BLOCK: tl.constexpr,
    T_PAD: tl.constexpr,
):
    row = tl.program_id(0)
    tile = tl.program_id(1)
    m, argmax, bad = row_argmax_tl(max_ptr, arg_ptr, bad_ptr, row, n_tiles, T_PAD)
    cols = tile * BLOCK + tl.arange(0, BLOCK)
    if bad | (tl.load(temp_ptr + row) <= 0):
        p = (cols == argmax).to(tl.float32)
    else:
        z = row_normaliser_tl(max_ptr, sum_ptr, row, m, n_tiles, T_PAD)
        row_ptr = logits_ptr + row.to(tl.int64) * stride_in
        inv_t, thr = tl.load(inv_row_ptr + row), tl.load(thr_ptr + row)
        cols, p = target_tile_tl(row_ptr, tile * BLOCK, V, inv_t, thr, m, z, BLOCK)
    out_row = probs_ptr + row.to(tl.int64) * stride_out
    if tile * BLOCK + BLOCK <= V:  # a whole tile: one plain (vectorised) store; the row's last one is clamped
        tl.store(out_row + cols, p)
    else:
        tl.store(out_row + tl.minimum(cols, V - 1), p, mask=cols < V)
    if tile == 0:
        tl.store(invalid_ptr + row, bad)


PROBS_SPACE = TuningSpace(candidates(num_warps=(2, 4, 8)), key=("V",))  # the statistics' tile: warps only


def _filtered_probs_triton(logits, temperature, top_k, top_p, probs, invalid) -> None:
    rows, vocab = logits.shape
    if rows == 0:
        return
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    block = vocab_block(vocab)
    n_tiles = cdiv(vocab, block)
    thr, inv_row = filter_thresholds_triton(logits, temperature, top_k, top_p, block)
    stats = row_stats_triton(logits, inv_row, thr, block)
    args = (logits, inv_row, thr, *stats, temperature, probs, invalid, vocab, n_tiles, logits.stride(0),
            probs.stride(0))  # fmt: skip
    meta = dict(BLOCK=block, T_PAD=next_power_of_2(n_tiles))
    launch(_probs_kernel, (rows, n_tiles), args, meta, dict(num_warps=4), PROBS_SPACE)


def _filtered_probs_torch(logits, temperature, top_k, top_p, probs, invalid) -> None:
    ref = _filtered_probs_reference(logits, temperature, top_k, top_p)
    probs.copy_(ref.probs)
    invalid.copy_(ref.invalid)


# ----------------------------------------------------------------------------- registered op


@register_op(
    "filtered_probs", mutates_args=("probs", "invalid"), triton=_filtered_probs_triton, torch=_filtered_probs_torch
)
def _filtered_probs_op(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    probs: torch.Tensor,
    invalid: torch.Tensor,
) -> None:
    """Schema: logits ``[R, V]``, ``[R]`` temperature / top_k / top_p; writes probs ``[R, V]``, invalid ``[R]``."""


# ----------------------------------------------------------------------------- public function


def filtered_probs(
    logits: torch.Tensor, params: SamplingParams, *, out: FilteredProbs | None = None, check: bool = True
) -> FilteredProbs:
    """The probabilities a sampled token is drawn from: temperature, then top-k, then top-p, renormalised.

    Parameters
    ----------
    logits : fp32/fp16/bf16 ``[R, V]``.
    params : ``SamplingParams`` with one entry per row (``seed`` and ``offset`` are not read).
    out : optional ``FilteredProbs`` to write into (probs fp32 ``[R, V]`` with unit column stride,
        invalid bool ``[R]`` contiguous).
    check : False skips every argument check, ``out``'s included (``specdec.kernels``).

    Returns
    -------
    FilteredProbs(probs fp32 ``[R, V]``, invalid bool ``[R]``). Sampled rows hold
    ``softmax(l / T)`` restricted to the top-k / top-p set (see ``top_k_top_p``) and renormalised;
    greedy rows (temperature <= 0) and invalid rows (any NaN or +inf, or no finite value) are
    one-hot at the argmax, NaN read as -inf (column 0 when no value is finite).

    Example
    -------
    >>> logits = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.5, 3.0, 0.0, 0.0]])
    >>> r = filtered_probs(logits, SamplingParams.make(2, temperature=[1.0, 0.0], top_k=[2, 0]))
    >>> (r.probs[0] > 0).tolist(), r.probs[1].tolist(), r.invalid.tolist()
    ([True, True, False, False], [0.0, 1.0, 0.0, 0.0], [False, False])
    """
    if check:
        check_tensor("logits", logits, dtype=FLOAT_DTYPES, ndim=2)
        rows, vocab = logits.shape
        device = logits.device
        if vocab < 1:
            raise ValueError(f"logits must have a vocabulary of at least 1, got shape {tuple(logits.shape)}")
        check_params(params, rows, device)
        if out is None:
            out = _fresh_buffers(logits)
        elif not isinstance(out, FilteredProbs):
            raise TypeError(f"out must be a FilteredProbs, got {type(out).__name__}")
        check_tensor("out.probs", out.probs, dtype=torch.float32, shape=(rows, vocab), device=device)
        if out.probs.stride(-1) != 1:
            raise ValueError("out.probs must have unit stride in its last dimension")
        check_tensor("out.invalid", out.invalid, dtype=torch.bool, shape=(rows,), device=device, contiguous=True)
    elif out is None:
        out = _fresh_buffers(logits)
    _filtered_probs_op.run(logits, params.temperature, params.top_k, params.top_p, *out)
    return out


def _fresh_buffers(logits: torch.Tensor) -> FilteredProbs:
    """Output buffers for ``logits [R, V]``: fp32 probs ``[R, V]``, bool invalid ``[R]``."""
    rows, vocab = logits.shape
    return FilteredProbs(
        torch.empty(rows, vocab, dtype=torch.float32, device=logits.device),
        torch.empty(rows, dtype=torch.bool, device=logits.device),
    )


# ----------------------------------------------------------------------------- PyTorch reference


def filtered_probs_reference(logits: torch.Tensor, params: SamplingParams) -> FilteredProbs:
    """Readable PyTorch implementation of ``filtered_probs``."""
    return _filtered_probs_reference(logits, params.temperature, params.top_k, params.top_p)


def _filtered_probs_reference(logits, temperature, top_k, top_p) -> FilteredProbs:
    s = scaled_logits(logits, temperature)
    p, argmax, bad = target_probs_reference(s, filter_thresholds_torch(s, temperature, top_k, top_p))
    one_hot = torch.nn.functional.one_hot(argmax, logits.shape[1]).float()
    return FilteredProbs(torch.where(((temperature <= 0) | bad)[:, None], one_hot, p), bad)
