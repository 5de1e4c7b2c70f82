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


def model_joint(target, prompt: list[int], steps: int, temperature: float, top_k: int, top_p: float):
    """The model's filtered joint distribution of the next ``steps`` tokens after ``prompt``, by enumeration
    (index = sum(token_i * vocab^(steps-1-i)))."""
    from helpers import forward_prompts

    from specdec.kernels.target_stats import target_probs_reference
    from specdec.kernels.top_k_top_p import filter_thresholds_reference, scaled_logits

    vocab = target.config.vocab_size
    contexts, probs = [[]], torch.ones(1)
    for _ in range(steps):
        texts = [prompt + c for c in contexts]
        logits, _, _ = forward_prompts(target, texts)
        rows = len(texts)
        t = torch.full((rows,), temperature)
        s = scaled_logits(logits, t)
        thr = filter_thresholds_reference(s, t, torch.full((rows,), top_k), torch.full((rows,), top_p))
        p, _, _ = target_probs_reference(s, thr)
        probs = (probs[:, None] * p.double()).flatten()
        contexts = [c + [v] for c in contexts for v in range(vocab)]
    return probs


def assert_sequences_follow(tokens: list[list[int]], exact: torch.Tensor, vocab: int) -> None:
    """Generated sequences (one per draw, all of one length) follow the exact joint ``exact``: total variation
    within 2.5x its expected noise, and nothing outside its support."""
    steps, draws = len(tokens[0]), len(tokens)
    index = torch.tensor([sum(t * vocab ** (steps - 1 - i) for i, t in enumerate(toks)) for toks in tokens])
    empirical = torch.bincount(index, minlength=vocab**steps).double() / draws
    support = int((exact > 0).sum())
    expected_tvd = 0.5 * math.sqrt(2 * (support - 1) / (math.pi * draws))
    tvd = 0.5 * (empirical - exact).abs().sum().item()
    assert tvd < 2.5 * expected_tvd, f"TVD {tvd:.4f} vs expected noise {expected_tvd:.4f}"
    assert (empirical[exact == 0] == 0).all(), "a filtered-out sequence was emitted"
