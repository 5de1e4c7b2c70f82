"""The sampling ops: counter-based uniforms and race clocks, the temperature / top-k / top-p filter,
filtered_probs, sample_probs and sample() (the keyed exponential race: exact, Triton equal to torch, and
coupling a draft to the target's draw); and every sampling / verification op through torch.library.opcheck."""

import math

import pytest
import torch
import triton
import triton.language as tl
from sampling_helpers import exact_probs, params, tv_bound, tv_distance

from specdec import _backend
from specdec.kernels import (
    FilteredProbs,
    SampleResult,
    SamplingParams,
    counter_uniform,
    filtered_probs,
    sample,
    sample_probs,
)
from specdec.kernels.sample_probs import race_reference, sample_probs_reference
from specdec.kernels.target_stats import target_probs_reference
from specdec.kernels.top_k_top_p import (
    filter_thresholds_reference,
    filter_thresholds_torch,
    filter_thresholds_triton,
    scaled_logits,
)
from specdec.kernels.uniforms import (
    ROLE_TARGET,
    counter_uniform_reference,
    counter_uniform_tl,
    race_clock_tl,
    race_clocks,
    race_key_tl,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# ----------------------------------------------------------------------------- uniforms


@triton.jit
def _scalar_uniform_kernel(seed_ptr, offset_ptr, counter_ptr, out_ptr):
    i = tl.program_id(0)
    tl.store(out_ptr + i, counter_uniform_tl(tl.load(seed_ptr + i), tl.load(offset_ptr + i), tl.load(counter_ptr + i)))


def extreme_uniform_inputs(n=48):
    seed = torch.cat([torch.tensor([0, -1, 2**40 + 3, -(2**62), 2**63 - 1]), torch.randint(-(2**62), 2**62, (n - 5,))])
    offset = torch.cat([torch.tensor([0, 2**33, -5, 7, 2**62]), torch.randint(0, 2**40, (n - 5,))])
    return seed, offset, torch.randint(0, 2**20, (n,))


def test_uniforms_are_bit_identical_in_triton_and_torch(backend, device):
    seed, offset, counter = extreme_uniform_inputs()
    expected = counter_uniform_reference(seed, offset, counter)
    out = torch.full((seed.numel(),), float("nan"), device=device)
    got = counter_uniform(seed.to(device), offset.to(device), counter.to(device), out=out)
    assert got is out and torch.equal(got.cpu(), expected)
    assert ((expected >= 0) & (expected < 1)).all()
    # the scalar form the kernels use inside their walks
    scalar = torch.full((seed.numel(),), float("nan"), device=DEVICE)
    _scalar_uniform_kernel[(seed.numel(),)](seed.to(DEVICE), offset.to(DEVICE), counter.int().to(DEVICE), scalar)
    assert torch.equal(scalar.cpu(), expected)


def test_uniforms_broadcast_and_take_a_plain_int_counter(backend, device):
    seed = torch.arange(6, device=device).view(2, 3)
    u = counter_uniform(seed, torch.zeros(1, dtype=torch.int64, device=device), 5)
    assert u.shape == (2, 3)
    assert torch.equal(u.cpu(), counter_uniform_reference(seed.cpu(), torch.zeros(1, dtype=torch.int64), 5))


def test_uniforms_look_uniform_and_independent():
    n = 1 << 20
    seeds = torch.arange(n)
    with _backend.use_backend("torch"):
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
    base = counter_uniform_reference(torch.tensor([5]), torch.tensor([9]), 2)
    assert base != counter_uniform_reference(torch.tensor([5 + 2**32]), torch.tensor([9]), 2)
    assert base != counter_uniform_reference(torch.tensor([5]), torch.tensor([9 + 2**32]), 2)


def test_uniform_bad_inputs():
    with pytest.raises(TypeError, match="seed must be an integer tensor"):
        counter_uniform(torch.zeros(2), torch.zeros(2, dtype=torch.int64), 1)
    with pytest.raises(TypeError, match="offset must be a torch.Tensor"):
        counter_uniform(torch.zeros(2, dtype=torch.int64), 0, 1)
    with pytest.raises(ValueError, match="out must have shape"):
        counter_uniform(torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64), 1, out=torch.empty(3))
    ids = torch.zeros(2, dtype=torch.int64)
    for counter in (1.5, True, "1"):  # never truncated or read as 1
        with pytest.raises(TypeError, match="counter must be an int or an integer tensor"):
            counter_uniform(ids, ids, counter)
    with pytest.raises(TypeError, match="counter must be an integer tensor, got float32"):
        counter_uniform(ids, ids, torch.tensor([1.5, 2.0]))


@triton.jit
def _race_clock_kernel(seed_ptr, offset_ptr, counter_ptr, out_ptr, V: tl.constexpr):
    i = tl.program_id(0)
    key = race_key_tl(tl.load(seed_ptr + i), tl.load(offset_ptr + i), tl.load(counter_ptr + i))
    cols = tl.arange(0, V)
    tl.store(out_ptr + i * V + cols, race_clock_tl(key, cols))


def test_race_clocks_are_the_counter_hash_with_the_index_folded_in():
    seed, offset, counter = extreme_uniform_inputs()
    clocks = race_clocks(seed, offset, counter, 64)
    assert clocks.shape == (48, 64) and clocks.dtype == torch.float32
    # entry 0 folds a sixth word of 0, as counter_uniform does: the same 24 bits, with the lowest one set
    bits = (counter_uniform_reference(seed, offset, counter) * 2**24).long()
    assert torch.equal(clocks[:, 0], -torch.log((bits | 1).float() * 2**-24))
    # u in [2**-24, 1 - 2**-24]: every clock finite and positive, whatever the key
    assert torch.isfinite(clocks).all() and (clocks > 0).all()
    lo, hi = -math.log1p(-(2**-24)), 24 * math.log(2)
    assert clocks.min() >= lo * 0.99 and clocks.max() <= hi * 1.0001
    # broadcasting over keys; each entry its own clock
    assert torch.equal(race_clocks(seed[:3], offset[:1], 7, 5), race_clocks(seed[:3], offset[:1].expand(3), 7, 5))
    assert len(set(clocks[5].tolist())) == 64


def test_race_clocks_are_exponential_and_independent():
    n = 1 << 18
    seeds = torch.arange(n)
    e = race_clocks(seeds, torch.zeros(n, dtype=torch.int64), ROLE_TARGET, 2)
    u = torch.exp(-e.double())  # Exp(1) clocks <=> u uniform
    for x in (u[:, 0], u[:, 1]):
        counts = torch.histc(x, bins=64, min=0, max=1)
        chi2 = ((counts - n / 64) ** 2 / (n / 64)).sum().item()
        assert chi2 < 63 + 6 * math.sqrt(2 * 63)
    assert abs(torch.corrcoef(u.T.float())[0, 1]) < 5 / math.sqrt(n)
    assert abs(e.double().mean().item() - 1) < 6 / math.sqrt(n)


@pytest.mark.interpreter
def test_race_clocks_triton_match_torch():
    seed, offset, counter = extreme_uniform_inputs(12)
    vocab = 256
    out = torch.full((12, vocab), float("nan"), device=DEVICE)
    _race_clock_kernel[(12,)](seed.to(DEVICE), offset.to(DEVICE), counter.to(DEVICE), out, V=vocab)
    expected = race_clocks(seed, offset, counter, vocab)
    # the same hash bits; the logarithm is each backend's own (within an ulp)
    torch.testing.assert_close(out.cpu(), expected, rtol=2.5e-7, atol=0)


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
    got, inv_row = filter_thresholds_triton(
        logits.to(DEVICE), temp.to(DEVICE), top_k.to(DEVICE), top_p.to(DEVICE), block=32
    )  # one row per request
    assert torch.equal(inv_row.cpu(), torch.where(temp > 0, 1.0 / temp, 1.0))
    _, expected = _thresholds(logits, temp, top_k, top_p)
    assert torch.equal(got.cpu(), expected), f"{got}\n{expected}"
    assert got[9] == logits[9].float().max()  # top_p <= 0 keeps the maximum only


@pytest.mark.parametrize("vocab", [77, 3000])
def test_filter_thresholds_torch_match_the_sorting_reference(vocab):
    """The PyTorch path sorts a head that widens until it holds every cut: flat rows need the whole row."""
    rows = 12
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(rows, vocab, generator=gen) * 3
    logits[0, :10] = logits[0, 10:20]  # ties at the threshold
    logits[1, 50:] = float("-inf")
    logits[2, 3] = float("nan")  # invalid row: no filter
    logits[3] = float("-inf")
    logits[10] = torch.randn(vocab, generator=gen) * 0.01  # nearly flat: top-p 0.99 needs most of the row
    logits[11, :40] = 5.0  # ties spanning the first head
    temp = torch.tensor([1.0, 0.5, 1.0, 1.0, 0.0, 2.0, 1.0, 1.0, 0.9, 1.0, 1.0, 1.0])
    top_k = torch.tensor([12, 30, 5, 5, 3, 0, 77, 1, 9, 0, 0, 20], dtype=torch.int32)
    top_p = torch.tensor([1.0, 0.9, 0.5, 0.5, 0.5, 0.3, 1.0, 1.0, 0.75, -0.5, 0.99, 0.9])
    s = scaled_logits(logits, temp)
    got = filter_thresholds_torch(s, temp, top_k, top_p)
    assert torch.equal(got, filter_thresholds_reference(s, temp, top_k, top_p)), got
    assert got[10] < s[10].sort(descending=True).values[64]  # the cut lies beyond the first head
    for top_p_only in (torch.full((rows,), 0.95), torch.ones(rows)):  # each filter on its own
        no_k = torch.zeros(rows, dtype=torch.int32)
        assert torch.equal(filter_thresholds_torch(s, temp, no_k, top_p_only),
                           filter_thresholds_reference(s, temp, no_k, top_p_only))  # fmt: skip
        assert torch.equal(filter_thresholds_torch(s, temp, top_k, torch.ones(rows)),
                           filter_thresholds_reference(s, temp, top_k, torch.ones(rows)))  # fmt: skip


# ----------------------------------------------------------------------------- filtered_probs


def test_filtered_probs_are_the_target_distribution(backend, device):
    rows, vocab = 9, 70
    logits = torch.randn(rows, vocab) * 2
    logits[0, :8] = logits[0, 8:16]  # ties at a threshold
    p = SamplingParams.make(rows, temperature=[1.0, 0.7, 1.3, 1.0, 0.5, 1.0, 2.0, 0.9, 1.0],
                            top_k=[0, 5, 0, 20, 0, 1, 0, 10, 69], top_p=[1.0, 1.0, 0.8, 0.9, 0.3, 1.0, 1.0, 0.6, 1.0],
                            device=device)  # fmt: skip
    out = FilteredProbs(torch.full((rows, vocab), float("nan"), device=device), torch.ones(rows, dtype=torch.bool,
                        device=device))  # fmt: skip
    got = filtered_probs(logits.to(device), p, out=out)
    assert got is out and not got.invalid.any()
    for r in range(rows):
        expected = exact_probs(logits[r : r + 1], float(p.temperature[r]), int(p.top_k[r]), float(p.top_p[r]))[0]
        assert torch.equal(got.probs[r].cpu() > 0, expected > 0), f"row {r}: support"
        torch.testing.assert_close(got.probs[r].cpu(), expected, atol=1e-6, rtol=1e-5)
        assert abs(got.probs[r].sum().item() - 1) < 1e-5


def test_filtered_probs_are_one_hot_for_greedy_and_invalid_rows(backend, device):
    vocab = 33
    logits = torch.randn(6, vocab) * 50  # greedy rows never take a softmax (this one would underflow)
    logits[1, 4] = float("nan")  # NaN reads as -inf for the argmax
    logits[2, [7, 9]] = float("inf")  # +inf is the maximum: its first column
    logits[3] = float("-inf")  # nothing finite: column 0
    logits[4] = float("nan")
    temp = [0.0, 1.0, 1.0, 0.0, 1.0, 0.0]
    got = filtered_probs(logits.to(device), SamplingParams.make(6, temperature=temp, top_k=3, device=device))
    clean = torch.where(torch.isnan(logits), float("-inf"), logits)
    expected_argmax = [int(clean[0].argmax()), int(clean[1].argmax()), 7, 0, 0, int(clean[5].argmax())]
    assert got.invalid.tolist() == [False, True, True, True, True, False]
    assert got.probs.cpu().argmax(-1).tolist() == expected_argmax
    assert torch.equal(got.probs.cpu(), torch.nn.functional.one_hot(torch.tensor(expected_argmax), vocab).float())


def test_filtered_probs_bad_inputs():
    logits = torch.randn(2, 10)
    with pytest.raises(TypeError, match="logits"):
        filtered_probs(logits.long(), params(2))
    with pytest.raises(ValueError, match="params.temperature must have shape"):
        filtered_probs(logits, params(3))
    with pytest.raises(TypeError, match="out must be a FilteredProbs"):
        filtered_probs(logits, params(2), out=(torch.empty(2, 10), torch.empty(2, dtype=torch.bool)))
    with pytest.raises(ValueError, match="out.probs must have shape"):
        filtered_probs(logits, params(2), out=FilteredProbs(torch.empty(2, 11), torch.empty(2, dtype=torch.bool)))


# ----------------------------------------------------------------------------- sample_probs


def test_sample_probs_draws_each_token_with_its_probability():
    n, vocab = 200_000, 16
    q = torch.softmax(torch.randn(vocab) * 1.5, -1)
    q[3] = 0.0  # never drawn
    q /= q.sum()
    with _backend.use_backend("torch"):
        tokens = sample_probs(q.expand(n, vocab) * 7.0, params(n), counter=4)  # unnormalised weights are fine
    assert tv_distance(tokens.long(), q) < tv_bound(q, n)
    assert not (tokens == 3).any()


def test_sample_probs_triton_matches_reference():
    rows, vocab = 24, 77  # not a multiple of the tile (32 here)
    probs = torch.softmax(torch.randn(rows, vocab) * 2, -1)
    probs[0] = 0.0  # no mass: -1
    probs[1, :70] = 0.0  # mass only in the last tile
    probs[2, 5] = float("nan")  # NaN, inf and negative entries count as 0
    probs[3, 6] = float("inf")
    probs[4, 7] = -1.0
    probs[5] = torch.nn.functional.one_hot(torch.tensor(76), vocab).float()
    p = params(rows, seed0=11, offset=3, device=DEVICE)
    counter = torch.arange(rows, dtype=torch.int32, device=DEVICE)
    out = torch.full((rows,), -7, dtype=torch.int32, device=DEVICE)
    with _backend.use_backend("triton"):
        fast = sample_probs(probs.to(DEVICE), p, counter=counter, out=out)
    expected = sample_probs_reference(probs, params(rows, seed0=11, offset=3, device="cpu"), counter=counter.cpu())
    assert fast is out and torch.equal(fast.cpu(), expected)
    assert expected[0] == -1 and expected[1] >= 70 and expected[5] == 76
    assert expected[2] != 5 and expected[3] != 6 and expected[4] != 7


def test_sample_probs_takes_the_counter_per_row_or_for_all(backend, device):
    probs = torch.softmax(torch.randn(5, 40), -1).to(device)
    p = params(5, device=device)
    by_int = sample_probs(probs, p, counter=9)
    by_rows = sample_probs(probs, p, counter=torch.full((5,), 9, device=device))
    assert torch.equal(by_int, by_rows)
    clocks = race_clocks(p.seed.cpu(), p.offset.cpu(), 9, 40)
    assert torch.equal(by_int.cpu(), (probs.cpu() / clocks).argmax(-1).int())


def test_sample_probs_bad_inputs():
    probs = torch.rand(3, 10)
    with pytest.raises(TypeError, match="probs"):
        sample_probs(probs.double(), params(3), counter=0)
    with pytest.raises(ValueError, match="params.seed must have shape"):
        sample_probs(probs, params(3)._replace(seed=torch.zeros(2, dtype=torch.int64)), counter=0)
    with pytest.raises(ValueError, match="counter must have shape"):
        sample_probs(probs, params(3), counter=torch.zeros(2, dtype=torch.int64))
    with pytest.raises(TypeError, match="counter must have dtype"):
        sample_probs(probs, params(3), counter=torch.zeros(3))
    with pytest.raises(TypeError, match="counter"):
        sample_probs(probs, params(3))  # counter is required
    with pytest.raises(ValueError, match="out must have shape"):
        sample_probs(probs, params(3), counter=0, out=torch.empty(4, dtype=torch.int32))


# ----------------------------------------------------------------------------- sample()


def test_sample_greedy_is_argmax_and_invalid_rows_are_flagged(backend, device):
    logits = torch.randn(5, 50) * 100
    logits[3] = float("nan")
    logits[4] = float("-inf")
    p = SamplingParams.make(5, temperature=[0.0, 0.0, 1.0, 0.0, 1.0], seed=torch.arange(5), device=device)
    tokens, invalid = sample(logits.to(device), p)
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
        tokens, _ = sample(logits.expand(n, vocab), params(n, temp, top_k, top_p))
    exact = exact_probs(logits, temp, top_k, top_p)[0].double()
    emp = torch.bincount(tokens.long(), minlength=vocab).double() / n
    tv = 0.5 * (emp - exact).abs().sum().item()
    mean = (exact * (1 - exact) / (2 * math.pi * n)).sqrt().sum().item()
    assert tv < mean + 3 * math.sqrt((exact * (1 - exact)).sum().item() / n)
    assert (emp[exact == 0] == 0).all()  # nothing outside the filtered support


def test_sample_triton_matches_torch_and_writes_out():
    rows, vocab = 12, 90
    logits = torch.randn(rows, vocab) * 2
    p = SamplingParams.make(
        rows, temperature=[0.0, 1.0, 0.7, 1.3] * 3, top_k=[0, 0, 8, 0, 0, 20, 0, 0, 0, 0, 3, 0],
        top_p=[1.0, 1.0, 1.0, 0.8, 1.0, 0.9, 1.0, 1.0, 0.5, 1.0, 1.0, 1.0], seed=torch.arange(rows) * 7,
        offset=torch.arange(rows), device=DEVICE,
    )  # fmt: skip
    out = SampleResult(torch.full((rows,), -7, dtype=torch.int32, device=DEVICE),
                       torch.ones(rows, dtype=torch.bool, device=DEVICE))  # fmt: skip
    with _backend.use_backend("triton"):
        fast = sample(logits.to(DEVICE), p, out=out)
    with _backend.use_backend("torch"):
        ref = sample(logits.to(DEVICE), p)
    assert fast is out
    assert torch.equal(fast.tokens.cpu(), ref.tokens.cpu()) and torch.equal(fast.invalid.cpu(), ref.invalid.cpu())


def test_sample_bad_inputs():
    logits = torch.randn(2, 10)
    with pytest.raises(TypeError, match="logits"):
        sample(logits.long(), params(2))
    with pytest.raises(ValueError, match="logits must have 2 dimensions"):
        sample(logits[0], params(2))
    with pytest.raises(TypeError, match="params.top_k"):
        sample(logits, params(2)._replace(top_k=torch.zeros(2)))
    with pytest.raises(ValueError, match="params.seed must have shape"):
        sample(logits, params(2)._replace(seed=torch.zeros(3, dtype=torch.long)))
    with pytest.raises(ValueError, match="out.tokens must have shape"):
        sample(logits, params(2), out=SampleResult(torch.empty(3, dtype=torch.int32), torch.empty(2, dtype=torch.bool)))


# ----------------------------------------------------------------------------- the race: exactness, paths, coupling


def race_keys(n, per_seed=40) -> tuple[torch.Tensor, torch.Tensor]:
    """(seeds, offsets) of n draws whose keys vary in both: ``per_seed`` positions per seed."""
    i = torch.arange(n)
    return i // per_seed, (i % per_seed) * 977 + 5


@pytest.mark.parametrize("temp, top_k, top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.9, 7, 0.9)])
def test_race_draw_is_distributed_as_p(temp, top_k, top_p):
    """Chi-square over seeds and positions: the target's draw follows the filtered p, zero entries never drawn."""
    n, vocab = 120_000, 12
    logits = torch.randn(1, vocab) * 1.5
    logits[0, 4] = float("-inf")  # p = 0 before any filter
    seeds, offsets = race_keys(n)
    p = SamplingParams.make(n, temperature=temp, top_k=top_k, top_p=top_p, seed=seeds, offset=offsets)
    with _backend.use_backend("torch"):
        tokens, _ = sample(logits.expand(n, vocab), p)
    counts = torch.bincount(tokens.long(), minlength=vocab).double()

    def chi2(exact):
        support = exact > 0
        expected = n * exact[support]
        return ((counts[support] - expected) ** 2 / expected).sum().item(), int(support.sum()) - 1

    exact = exact_probs(logits, temp, top_k, top_p)[0].double()
    stat, dof = chi2(exact)
    assert stat < dof + 6 * math.sqrt(2 * dof)
    assert counts[exact == 0].sum() == 0  # nothing outside the filtered support
    hotter, _ = chi2(exact_probs(logits, temp * 1.1, top_k, top_p)[0].double())
    assert hotter > dof + 6 * math.sqrt(2 * dof)  # the test can fail


def test_sample_probs_race_is_exact_on_weights_with_zeros():
    n, vocab = 120_000, 9
    w = torch.rand(vocab) * 3
    w[[0, 5]] = 0.0  # never drawn, including the first index (ties never fall to a zero entry)
    seeds, offsets = race_keys(n)
    with _backend.use_backend("torch"):
        tokens = sample_probs(w.expand(n, vocab), SamplingParams.make(n, seed=seeds, offset=offsets), counter=3)
    exact = (w / w.sum()).double()
    assert tv_distance(tokens.long(), exact) < tv_bound(exact, n)
    assert not ((tokens == 0) | (tokens == 5)).any()


def test_race_takes_the_lowest_index_on_ties_and_never_a_zero_entry():
    clocks = torch.tensor([[1.0, 2.0, 1.0, 0.5], [1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    w = torch.tensor([[0.0, 2.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0], [0.0, 3.0, 0.0, 3.0]])
    assert race_reference(w, clocks).tolist() == [1, -1, 1]  # 2/2 == 1/1: index 1; no mass: -1


@pytest.mark.interpreter
@pytest.mark.parametrize("vocab", [37, 300, 1000])
def test_race_triton_equals_torch_token_for_token(vocab):
    rows = 48
    logits = torch.randn(rows, vocab) * 3
    logits[::7, : vocab // 3] = float("-inf")  # zero entries, some of them first
    seeds, offsets = race_keys(rows, per_seed=4)
    p = SamplingParams.make(rows, temperature=[1.0, 0.7, 1.3, 0.0] * 12, top_k=[0, 0, 9, 0, 20, 0] * 8,
                            top_p=[1.0, 0.9, 1.0, 1.0, 1.0, 0.6] * 8, seed=seeds, offset=offsets)  # fmt: skip
    q = torch.softmax(torch.randn(rows, vocab) * 2, -1)
    q[::5, 1::2] = 0.0
    results = {}
    for name in ("torch", "triton"):
        with _backend.use_backend(name):
            results[name] = (sample(logits, p).tokens, sample_probs(q, p, counter=ROLE_TARGET))
    assert torch.equal(results["torch"][0], results["triton"][0])
    assert torch.equal(results["torch"][1], results["triton"][1])


def gumbel_agreement(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``[...]``: P(argmax p_i / E_i == argmax q_i / E_i) for shared Exp(1) clocks, exactly, per row of p and q:
    sum over i of 1 / sum_j max(p_j / p_i, q_j / q_i) (given E_i = t, i wins both when every E_j > t max(...))."""
    both = (p > 0) & (q > 0)
    ratio = torch.maximum(p[..., None, :] / p[..., :, None], q[..., None, :] / q[..., :, None])
    return torch.where(both, 1 / ratio.sum(-1), 0.0).sum(-1)


@pytest.mark.parametrize("vocab, spread, noise", [(16, 1.5, 0.5), (64, 2.0, 0.5), (64, 2.0, 1.0), (256, 2.0, 0.7)])
def test_coupled_draw_agrees_with_the_target_as_the_gumbel_coupling_predicts(vocab, spread, noise):
    """A coupled draft (sample_probs with ROLE_TARGET) equals the target's draw (sample) as often as the exact
    Gumbel-max coupling says, at least (1 - TV) / (1 + TV), and more often than the inverse CDF in vocabulary
    order did on the same random nearby p and q; with q = p it always equals it."""
    pairs, keys = 400, 100
    logits = torch.randn(pairs, vocab, dtype=torch.float64) * spread
    p = torch.softmax(logits, -1)
    q = torch.softmax(logits + torch.randn(pairs, vocab, dtype=torch.float64) * noise, -1)
    n = pairs * keys
    seeds, offsets = race_keys(n, per_seed=8)
    params = SamplingParams.make(n, temperature=1.0, seed=seeds, offset=offsets)
    rows = logits.float().repeat_interleave(keys, 0)
    with _backend.use_backend("torch"):
        target = sample(rows, params).tokens
        coupled = sample_probs(q.float().repeat_interleave(keys, 0), params, counter=ROLE_TARGET)
        itself = sample_probs(filtered_probs(rows, params).probs, params, counter=ROLE_TARGET)
    rate = (target == coupled).double().mean().item()
    theory = gumbel_agreement(p, q)
    assert abs(rate - theory.mean().item()) < 5 * math.sqrt(0.25 / n)
    tv = 0.5 * (p - q).abs().sum(-1)
    assert (theory >= (1 - tv) / (1 + tv) - 1e-12).all()
    start_p, start_q = p.cumsum(-1) - p, q.cumsum(-1) - q
    inverse_cdf = (torch.minimum(start_p + p, start_q + q) - torch.maximum(start_p, start_q)).clamp(min=0).sum(-1)
    assert rate > inverse_cdf.mean().item() + 0.1
    assert torch.equal(itself, target)


# ----------------------------------------------------------------------------- registered ops


def _op_cases():
    """(registered name, args) of every sampling / verification op on small random inputs."""
    vocab = 20
    p = tuple(params(2, 0.8, 5, 0.9))
    chain_logits, drafts = torch.randn(5, vocab), torch.randint(0, vocab, (3,), dtype=torch.int32)
    chain_offsets = torch.tensor([0, 2, 3], dtype=torch.int32)
    tree_logits, nodes = torch.randn(5, vocab), torch.randint(0, vocab, (5,), dtype=torch.int32)
    parents = torch.tensor([-1, 0, 0, -1, 0], dtype=torch.int32)
    node_offsets = torch.tensor([0, 3, 5], dtype=torch.int32)
    tokens, accepted, invalid = (torch.empty(2, 3, dtype=torch.int32), torch.empty(2, dtype=torch.int32),
                                 torch.empty(2, dtype=torch.bool))  # fmt: skip
    tree_outs = (tokens, accepted, torch.empty(2, 3, dtype=torch.int32), invalid)
    q3, q5 = torch.softmax(torch.randn(3, vocab), -1), torch.softmax(torch.randn(5, vocab), -1)
    return {
        "counter_uniform": (p[3], p[4], torch.tensor([1, 2]), torch.empty(2)),
        "filtered_probs": (torch.randn(2, vocab), *p[:3], torch.empty(2, vocab), torch.empty(2, dtype=torch.bool)),
        "sample_probs": (q3[:2], p[3], p[4], torch.tensor([0, 1]), torch.empty(2, dtype=torch.int32)),
        "sample": (torch.randn(2, vocab), *p, torch.empty(2, dtype=torch.int32), torch.empty(2, dtype=torch.bool)),
        "verify_chain": (chain_logits, drafts, chain_offsets, q3, *p, "stochastic", tokens, accepted, invalid),
        "verify_tree": (tree_logits, nodes, parents, node_offsets, q5, *p, "stochastic", *tree_outs),
        "verify_chain_greedy": (chain_logits, drafts, chain_offsets, tokens, accepted, invalid),
        "verify_tree_greedy": (tree_logits, nodes, parents, node_offsets, *tree_outs),
    }


@pytest.mark.parametrize("name", list(_op_cases()))
def test_every_sampling_op_passes_opcheck(name, backend, device):
    """Each op is a torch custom op (torch.compile / CUDA graphs see it whole) with both bodies registered."""
    import specdec.kernels  # noqa: F401  (registers the ops)

    args = tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in _op_cases()[name])
    torch.library.opcheck(getattr(torch.ops.specdec, name).default, args)
