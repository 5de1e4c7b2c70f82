"""Counter-based uniforms, the temperature / top-k / top-p filter, and sample()."""

import math

import pytest
import torch
import triton
import triton.language as tl

from specdec import _backend
from specdec.kernels import counter_uniform, sample
from specdec.kernels.sampling import (
    counter_uniform_tl,
    filter_thresholds_reference,
    filter_thresholds_triton,
    scaled_logits,
    target_probs_reference,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@triton.jit
def _uniform_kernel(seed_ptr, offset_ptr, counter_ptr, out_ptr):
    i = tl.program_id(0)
    tl.store(out_ptr + i, counter_uniform_tl(tl.load(seed_ptr + i), tl.load(offset_ptr + i), tl.load(counter_ptr + i)))


def test_uniforms_are_bit_identical_in_triton_and_torch():
    n = 48
    seed = torch.cat([torch.tensor([0, -1, 2**40 + 3, -(2**62), 2**63 - 1]), torch.randint(-(2**62), 2**62, (n - 5,))])
    offset = torch.cat([torch.tensor([0, 2**33, -5, 7, 2**62]), torch.randint(0, 2**40, (n - 5,))])
    counter = torch.randint(0, 2**20, (n,), dtype=torch.int32)
    out = torch.full((n,), float("nan"), device=DEVICE)
    _uniform_kernel[(n,)](seed.to(DEVICE), offset.to(DEVICE), counter.to(DEVICE), out)
    expected = counter_uniform(seed, offset, counter)
    assert torch.equal(out.cpu(), expected)
    assert ((expected >= 0) & (expected < 1)).all()


def test_uniforms_look_uniform_and_independent():
    n = 1 << 20
    seeds = torch.arange(n)
    u = counter_uniform(seeds, torch.zeros(n, dtype=torch.int64), 2)
    v = counter_uniform(seeds, torch.zeros(n, dtype=torch.int64), 3)
    w = counter_uniform(torch.zeros(n, dtype=torch.int64), seeds, 2)  # offsets as the varying input
    for x in (u, v, w):
        counts = torch.histc(x, bins=64, min=0, max=1)
        chi2 = ((counts - n / 64) ** 2 / (n / 64)).sum().item()
        assert chi2 < 63 + 6 * math.sqrt(2 * 63)  # chi-square(63): mean 63, sd 11.2
    assert abs(torch.corrcoef(torch.stack([u, v]))[0, 1]) < 5 / math.sqrt(n)
    assert abs(torch.corrcoef(torch.stack([u, w]))[0, 1]) < 5 / math.sqrt(n)
    # the high words of seed and offset matter
    base = counter_uniform(torch.tensor([5]), torch.tensor([9]), 2)
    assert base != counter_uniform(torch.tensor([5 + 2**32]), torch.tensor([9]), 2)
    assert base != counter_uniform(torch.tensor([5]), torch.tensor([9 + 2**32]), 2)


# ----------------------------------------------------------------------------- filter


def _thresholds(logits, temp, top_k, top_p):
    s = scaled_logits(logits, temp)
    return s, filter_thresholds_reference(s, temp, top_k, top_p)


def test_filter_semantics_against_brute_force():
    rows, vocab = 40, 30
    logits = torch.randn(rows, vocab)
    logits[:, :6] = logits[:, 6:12]  # ties
    temp = torch.rand(rows) + 0.3
    top_k = torch.randint(0, vocab + 3, (rows,), dtype=torch.int32)
    top_p = torch.where(torch.rand(rows) < 0.3, 1.0, torch.rand(rows))
    s, thr = _thresholds(logits, temp, top_k, top_p)
    p = target_probs_reference(s, thr)[0]
    for r in range(rows):
        values = s[r].sort(descending=True).values
        keep_k = values if not 0 < top_k[r] < vocab else values[values >= values[int(top_k[r]) - 1]]
        if top_p[r] < 1:
            e = torch.exp(keep_k - keep_k[0])
            head = int((e.cumsum(0) < top_p[r] * e.sum()).sum()) + 1  # smallest head holding top_p
            keep = keep_k[keep_k >= keep_k[min(head, keep_k.numel()) - 1]]
        else:
            keep = keep_k
        assert int((p[r] > 0).sum()) == keep.numel(), f"row {r}"
        assert abs(p[r].sum().item() - 1) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_filter_thresholds_triton_match_reference(dtype):
    rows, vocab = 10, 77
    logits = (torch.randn(rows, vocab) * 3).to(dtype)
    logits[0, :10] = logits[0, 10:20]  # ties at the threshold
    logits[1, 50:] = float("-inf")
    logits[2, 3] = float("nan")  # invalid row: no filter
    logits[3] = float("-inf")
    temp = torch.tensor([1.0, 0.5, 1.0, 1.0, 0.0, 2.0, 1.0, 1.0, 0.9, 1.0])
    top_k = torch.tensor([12, 30, 5, 5, 3, 0, 77, 1, 9, 0], dtype=torch.int32)
    top_p = torch.tensor([1.0, 0.9, 0.5, 0.5, 0.5, 0.3, 1.0, 1.0, 0.75, -0.5])
    offsets = torch.arange(rows + 1, dtype=torch.int32)  # one row per request
    got, inv_row = filter_thresholds_triton(
        logits.to(DEVICE), offsets.to(DEVICE), temp.to(DEVICE), top_k.to(DEVICE), top_p.to(DEVICE), 32
    )
    assert torch.equal(inv_row.cpu(), torch.where(temp > 0, 1.0 / temp, 1.0))
    _, expected = _thresholds(logits, temp, top_k, top_p)
    assert torch.equal(got.cpu(), expected), f"{got}\n{expected}"
    assert got[9] == logits[9].float().max()  # top_p <= 0 keeps the maximum only


# ----------------------------------------------------------------------------- sample()


def test_sample_greedy_is_argmax_and_invalid_rows_are_flagged(backend, device):
    logits = torch.randn(5, 50) * 100
    logits[3] = float("nan")
    logits[4] = float("-inf")
    temp = torch.tensor([0.0, 0.0, 1.0, 0.0, 1.0])
    k, p = torch.zeros(5, dtype=torch.int32), torch.ones(5)
    tokens, invalid = sample(
        *(t.to(device) for t in (logits, temp, k, p, torch.arange(5), torch.zeros(5, dtype=torch.long)))
    )
    assert tokens[:2].tolist() == logits[:2].argmax(-1).tolist()
    assert 0 <= int(tokens[2]) < 50
    assert invalid.tolist() == [False, False, False, True, True]
    assert tokens[3:].tolist() == [-1, -1]


@pytest.mark.parametrize(
    "temp, top_k, top_p", [(1.0, 0, 1.0), (0.6, 0, 1.0), (1.5, 6, 1.0), (1.0, 0, 0.7), (0.8, 10, 0.9)]
)
def test_sample_distribution(temp, top_k, top_p):
    n, vocab = 200_000, 16
    logits = torch.randn(1, vocab) * 1.5
    with _backend.use_backend("torch"):
        tokens, _ = sample(
            logits.expand(n, vocab),
            torch.full((n,), temp),
            torch.full((n,), top_k, dtype=torch.int32),
            torch.full((n,), top_p),
            torch.arange(n),
            torch.zeros(n, dtype=torch.long),
        )
    t = torch.full((1,), temp)
    s = scaled_logits(logits, t)
    exact = target_probs_reference(
        s, filter_thresholds_reference(s, t, torch.full((1,), top_k, dtype=torch.int32), torch.full((1,), top_p))
    )[0][0].double()
    emp = torch.bincount(tokens.long(), minlength=vocab).double() / n
    tv = 0.5 * (emp - exact).abs().sum().item()
    mean = (exact * (1 - exact) / (2 * math.pi * n)).sqrt().sum().item()
    assert tv < mean + 3 * math.sqrt((exact * (1 - exact)).sum().item() / n)
    assert (emp[exact == 0] == 0).all()  # nothing outside the filtered support


def test_sample_triton_matches_torch_and_writes_out():
    rows, vocab = 12, 90
    logits = torch.randn(rows, vocab) * 2
    temp = torch.tensor([0.0, 1.0, 0.7, 1.3] * 3)
    top_k = torch.tensor([0, 0, 8, 0, 0, 20, 0, 0, 0, 0, 3, 0], dtype=torch.int32)
    top_p = torch.tensor([1.0, 1.0, 1.0, 0.8, 1.0, 0.9, 1.0, 1.0, 0.5, 1.0, 1.0, 1.0])
    args = [t.to(DEVICE) for t in (logits, temp, top_k, top_p, torch.arange(rows) * 7, torch.arange(rows))]
    out = (torch.full((rows,), -7, dtype=torch.int32, device=DEVICE), torch.ones(rows, dtype=torch.bool, device=DEVICE))
    with _backend.use_backend("triton"):
        fast = sample(*args, out=out)
    with _backend.use_backend("torch"):
        ref = sample(*args)
    assert fast[0] is out[0] and fast[1] is out[1]
    assert torch.equal(fast[0].cpu(), ref[0].cpu()) and torch.equal(fast[1].cpu(), ref[1].cpu())


def test_sample_bad_inputs():
    logits = torch.randn(2, 10)
    ok = [logits, torch.ones(2), torch.zeros(2, dtype=torch.int32), torch.ones(2), torch.zeros(2, dtype=torch.long),
          torch.zeros(2, dtype=torch.long)]  # fmt: skip
    with pytest.raises(TypeError, match="logits"):
        sample(logits.long(), *ok[1:])
    with pytest.raises(ValueError, match="logits must have 2 dimensions"):
        sample(logits[0], *ok[1:])
    with pytest.raises(TypeError, match="top_k"):
        sample(*ok[:2], ok[2].float(), *ok[3:])
    with pytest.raises(ValueError, match="seed must have shape"):
        sample(*ok[:4], torch.zeros(3, dtype=torch.long), ok[5])
    with pytest.raises(ValueError, match="out\\[0\\]"):
        sample(*ok, out=(torch.empty(3, dtype=torch.int32), torch.empty(2, dtype=torch.bool)))
