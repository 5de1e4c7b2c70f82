"""Shared by the sampling and verification tests: exact target distributions, the total-variation
test of an empirical histogram, the two-token joint used by the chain and tree exactness tests,
and parameter builders. (Import as ``from sampling_helpers import ...``.)"""

import math

import torch

from specdec.kernels import SamplingParams
from specdec.kernels.filtered_probs import filtered_probs_reference

V_STAT = 8  # vocabulary of the exactness tests
N_STAT = 200_000  # seeded draws per exactness test


def params(batch, temp=1.0, top_k=0, top_p=1.0, seed0=0, offset=0, device="cpu") -> SamplingParams:
    """One set of sampling parameters for every request; request b gets seed ``seed0 + b``."""
    seeds = torch.arange(batch) + seed0
    return SamplingParams.make(batch, temperature=temp, top_k=top_k, top_p=top_p, seed=seeds, offset=offset,
                               device=device)  # fmt: skip


def exact_probs(logits, temp=1.0, top_k=0, top_p=1.0) -> torch.Tensor:
    """The exact filtered target distribution of each row of ``logits [R, V]`` (fp32 ``[R, V]``)."""
    return filtered_probs_reference(logits, params(logits.shape[0], temp, top_k, top_p)).probs


def tv_distance(samples: torch.Tensor, exact: torch.Tensor) -> float:
    """Total-variation distance between the histogram of int ``samples`` and ``exact``."""
    counts = torch.bincount(samples, minlength=exact.numel()).double()
    return 0.5 * (counts / samples.numel() - exact.double()).abs().sum().item()


def tv_bound(exact: torch.Tensor, n: int) -> float:
    """Mean of the TV distance of n exact draws (sum sqrt(p(1-p)/(2 pi n))) plus six standard deviations."""
    p = exact.double()
    mean = (p * (1 - p) / (2 * math.pi * n)).sqrt().sum().item()
    std = 0.5 * math.sqrt((1 - 2 / math.pi) * (p * (1 - p)).sum().item() / n)
    return mean + 6 * std


def joint_case(seed: int):
    """A two-step target and a draft far from it: (l0 [V], lc [V, V], q0 [V], qc [V, V]); after token x
    the target's logits are ``lc[x]`` and the draft's distribution ``qc[x]`` (the target reversed)."""
    gen = torch.Generator().manual_seed(seed)
    l0 = torch.randn(V_STAT, generator=gen) * 1.5
    lc = torch.randn(V_STAT, V_STAT, generator=gen) * 1.5
    return l0, lc, torch.softmax(l0.flip(0), -1), torch.softmax(lc.flip(1), -1)


def exact_joint(l0, lc, temp, top_k, top_p) -> torch.Tensor:
    """Exact joint of the first two target tokens, flattened (index y1 * V + y2)."""
    first = exact_probs(l0[None], temp, top_k, top_p)[0]
    return (first[:, None] * exact_probs(lc, temp, top_k, top_p)).reshape(-1)


def assert_joint_is_exact(samples, seed, temp, top_k, top_p) -> None:
    """The two-token samples pass the TV bound of the exact joint, and the same bound rejects the joint
    at a 10% higher temperature (so the test can fail)."""
    l0, lc, _, _ = joint_case(seed)
    bound = tv_bound(exact_joint(l0, lc, temp, top_k, top_p), samples.numel())
    assert tv_distance(samples, exact_joint(l0, lc, temp, top_k, top_p)) < bound
    assert tv_distance(samples, exact_joint(l0, lc, temp * 1.1, top_k, top_p)) > bound
