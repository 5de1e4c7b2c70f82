"""Per-request sampling parameters as the sampling and verification ops take them: one group.

Every op that draws or tests tokens (``sample``, ``filtered_probs``, ``verify_chain``,
``verify_tree``) takes one ``SamplingParams`` of five ``[B]`` tensors on the logits' device:

    temperature  fp32   <= 0 is greedy (argmax, no softmax, no random number)
    top_k        int32  0 (or >= V) is off
    top_p        fp32   1 is off
    seed         int64  with ``offset``, the key of the request's random numbers:
    offset       int64  u = counter_uniform(seed, offset, counter); advance offset every step

A request's tokens depend on its own (seed, offset) only: the same request gives the same
tokens alone, in any batch and in any row order.

Verification rules (``rule=``, always explicit):

    "stochastic"     draft tokens were drawn from draft distributions q, passed as ``draft_probs``
                     (Leviathan / Chen chains; SpecInfer's i.i.d. siblings for trees)
    "deterministic"  draft tokens were chosen without sampling (n-gram, top-k children, top-1 heads):
                     q is one-hot, no ``draft_probs``
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from specdec.kernels._checks import check_tensor

RULES = ("stochastic", "deterministic")
_FIELDS = (
    ("temperature", torch.float32),
    ("top_k", torch.int32),
    ("top_p", torch.float32),
    ("seed", torch.int64),
    ("offset", torch.int64),
)

_Tensor, _F32, _I32, _I64 = torch.Tensor, torch.float32, torch.int32, torch.int64


class SamplingParams(NamedTuple):
    """Five ``[B]`` tensors: temperature fp32, top_k int32, top_p fp32, seed int64, offset int64.

    Example
    -------
    >>> p = SamplingParams.make(2, temperature=[0.0, 0.8], top_p=0.9, seed=[1, 2])
    >>> p.temperature.tolist(), p.top_k.tolist(), p.offset.dtype
    ([0.0, 0.800000011920929], [0, 0], torch.int64)
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    seed: torch.Tensor
    offset: torch.Tensor

    @classmethod
    def make(
        cls,
        batch: int,
        *,
        temperature=0.0,
        top_k=0,
        top_p=1.0,
        seed=0,
        offset=0,
        device: torch.device | str = "cpu",
    ) -> SamplingParams:
        """Build from Python scalars (broadcast to ``batch``) or per-request sequences / tensors."""
        if not isinstance(batch, int) or isinstance(batch, bool) or batch < 0:
            raise ValueError(f"batch must be a non-negative int, got {batch!r}")
        values = dict(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, offset=offset)
        tensors = []
        for name, dtype in _FIELDS:
            t = torch.as_tensor(values[name], dtype=dtype)
            if t.dim() == 0:
                t = t.expand(batch)
            if t.shape != (batch,):
                raise ValueError(f"{name} must be a scalar or hold {batch} values, got shape {tuple(t.shape)}")
            tensors.append(t.contiguous().to(device))
        return cls(*tensors)

    def check(self, batch: int, device: torch.device) -> None:
        """Dtypes, shapes ``[batch]`` and device of every field; errors name ``params.<field>``."""
        want = (batch,)
        t, k, p, s, o = self
        # the same conditions as check_tensor's, tested inline in one expression (every call of every op
        # checks them); any failure goes field by field through check_tensor, which names the field
        if (type(t) is _Tensor and type(k) is _Tensor and type(p) is _Tensor and type(s) is _Tensor
                and type(o) is _Tensor and t.dtype is _F32 and k.dtype is _I32 and p.dtype is _F32
                and s.dtype is _I64 and o.dtype is _I64 and t.shape == want and k.shape == want
                and p.shape == want and s.shape == want and o.shape == want and t.device == device
                and k.device == device and p.device == device and s.device == device
                and o.device == device):  # fmt: skip
            return
        for (name, dtype), value in zip(_FIELDS, self):
            check_tensor(f"params.{name}", value, dtype=dtype, shape=want, device=device)

    def select(self, rows: torch.Tensor) -> SamplingParams:
        """The parameters of requests ``rows`` (int64 indices), in that order."""
        return SamplingParams(*(t.index_select(0, rows) for t in self))

    def repeat_rows(self, repeats: torch.Tensor | int, total: int | None = None) -> SamplingParams:
        """Each request's parameters repeated ``repeats[b]`` times (one entry per row of its logits).

        Pass ``total`` (the sum, known on the host) to keep a device ``repeats`` free of a sync.
        """
        return SamplingParams(*(t.repeat_interleave(repeats, output_size=total) for t in self))


def check_params(params, batch: int, device: torch.device) -> None:
    """``params`` is a SamplingParams of ``[batch]`` tensors on ``device`` (errors name the field)."""
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
    params.check(batch, device)


def check_rule(rule, draft_probs) -> None:
    """``rule`` is one of RULES and agrees with ``draft_probs`` (given iff stochastic)."""
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
    if rule == "stochastic" and draft_probs is None:
        raise ValueError("rule='stochastic' needs draft_probs: the distributions the draft tokens were drawn from")
    if rule == "deterministic" and draft_probs is not None:
        raise ValueError("rule='deterministic' takes no draft_probs (q is one-hot); pass rule='stochastic' to use them")
