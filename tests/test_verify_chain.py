"""verify_chain: exactness (total variation on the PyTorch path), the Triton kernels token for token
against the PyTorch reference, structure invariants, edge cases and input validation."""

import math

import pytest
import torch
from triton_bounds import bounds_checked

from specdec import _backend
from specdec.kernels import ChainVerifyResult, counter_uniform, sample, verify_chain
from specdec.kernels.sampling import filter_thresholds_reference, scaled_logits, target_probs_reference
from specdec.kernels.verify_chain import verify_chain_reference
from specdec.kernels.verify_tree import _pick_block

# ----------------------------------------------------------------------------- helpers


def filtered_probs(logits, temp=1.0, top_k=0, top_p=1.0):
    """Exact target distribution(s) of ``logits [R, V]`` under one set of sampling parameters."""
    rows = logits.shape[0]
    t = torch.full((rows,), float(temp))
    s = scaled_logits(logits, t)
    thr = filter_thresholds_reference(
        s, t, torch.full((rows,), top_k, dtype=torch.int32), torch.full((rows,), float(top_p))
    )
    return target_probs_reference(s, thr)[0]


def tv_distance(samples: torch.Tensor, exact: torch.Tensor) -> float:
    counts = torch.bincount(samples, minlength=exact.numel()).double()
    return 0.5 * (counts / samples.numel() - exact.double()).abs().sum().item()


def tv_bound(exact: torch.Tensor, n: int) -> float:
    """Mean of the TV distance of n exact draws (sum sqrt(p(1-p)/(2 pi n))) plus six standard deviations."""
    p = exact.double()
    mean = (p * (1 - p) / (2 * math.pi * n)).sqrt().sum().item()
    std = 0.5 * math.sqrt((1 - 2 / math.pi) * (p * (1 - p)).sum().item() / n)
    return mean + 6 * std


def params(batch, temp=1.0, top_k=0, top_p=1.0, seed0=0, offset=0, device="cpu"):
    return (
        torch.full((batch,), float(temp), device=device),
        torch.full((batch,), top_k, dtype=torch.int32, device=device),
        torch.full((batch,), float(top_p), device=device),
        torch.arange(batch, device=device) + seed0,
        torch.full((batch,), offset, dtype=torch.int64, device=device),
    )


def random_batch(ks, vocab, *, stochastic=True, dtype=torch.float32, device="cpu", scale=2.0):
    """Random ragged chains: logits, drafts sampled from the given draft rows, offsets."""
    offsets = torch.tensor([0] + list(ks)).cumsum(0).to(torch.int32)
    total, batch = int(offsets[-1]), len(ks)
    logits = (torch.randn(total + batch, vocab) * scale).to(dtype)
    q = torch.softmax(torch.randn(total, vocab) * scale, -1)
    tokens = torch.multinomial(q, 1)[:, 0].to(torch.int32) if total else torch.empty(0, dtype=torch.int32)
    return logits.to(device), tokens.to(device), offsets.to(device), (q.to(device) if stochastic else None)


def chain_as_tree(tokens, offsets):
    """The tree view of a chain batch: (node_tokens, parents, node_offsets, q_rows), on the host."""
    node_tokens, parents, q_rows, node_offsets = [], [], [], [0]
    for b in range(offsets.numel() - 1):
        lo, hi = int(offsets[b]), int(offsets[b + 1])
        node_tokens += [0] + tokens[lo:hi].tolist()
        parents += list(range(-1, hi - lo))
        q_rows += [min(lo + j, max(tokens.numel() - 1, 0)) for j in range(hi - lo + 1)]  # node j's child: draft lo + j
        node_offsets.append(node_offsets[-1] + hi - lo + 1)
    as_int = lambda x: torch.tensor(x, dtype=torch.int32)
    return as_int(node_tokens), as_int(parents), as_int(node_offsets), as_int(q_rows)


def run(backend, *args, **kwargs):
    with _backend.use_backend(backend):
        return verify_chain(*args, **kwargs)


def assert_same(a, b):
    for name, x, y in zip(ChainVerifyResult._fields, a, b):
        assert torch.equal(x.cpu(), y.cpu()), f"{name} differs:\n{x}\n{y}"


def check_structure(result, ks, draft_tokens, offsets, vocab):
    """-1 only after the emitted tokens, emitted = accepted + 1, accepted tokens are the drafts' prefix."""
    tokens, accepted, invalid = (t.cpu() for t in result)
    for b, k in enumerate(ks):
        row = tokens[b].tolist()
        if invalid[b]:
            assert accepted[b] == 0 and all(t == -1 for t in row)
            continue
        a = int(accepted[b])
        assert 0 <= a <= k
        assert row[:a] == draft_tokens[int(offsets[b]) : int(offsets[b]) + a].tolist()
        assert 0 <= row[a] < vocab, f"request {b}: emitted {row[a]}"
        assert all(t == -1 for t in row[a + 1 :])


# ----------------------------------------------------------------------------- exactness (PyTorch path)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
V_STAT = 8
N_STAT = 200_000


def chain_joint(k, temp, top_k, top_p, stochastic, seed):
    """Emit with verify_chain until every request has two tokens; return (joint samples, exact joint)."""
    gen = torch.Generator().manual_seed(seed)
    l0 = torch.randn(V_STAT, generator=gen) * 1.5
    lc = torch.randn(V_STAT, V_STAT, generator=gen) * 1.5  # target logits after token x: lc[x]
    q0, qc = torch.softmax(l0.flip(0), -1), torch.softmax(lc.flip(1), -1)  # draft far from the target
    n = N_STAT

    def step(first_logits, first_q, offset):
        drafts, qrows, rows = [], [], [first_logits]
        q = first_q
        for _ in range(k):
            x = (
                torch.multinomial(q, 1, generator=gen)[:, 0]
                if stochastic
                else torch.randint(0, V_STAT, (n,), generator=gen)
            )
            drafts.append(x)
            qrows.append(q)
            rows.append(lc[x])
            q = qc[x]
        logits = torch.stack(rows, 1).reshape(n * (k + 1), V_STAT)
        tokens = torch.stack(drafts, 1).reshape(-1).to(torch.int32)
        probs = torch.stack(qrows, 1).reshape(n * k, V_STAT) if stochastic else None
        offsets = (torch.arange(n + 1) * k).to(torch.int32)
        with _backend.use_backend("torch"):
            return verify_chain(logits, tokens, offsets, probs, *params(n, temp, top_k, top_p, seed * n, offset))

    first = step(l0.expand(n, V_STAT), q0.expand(n, V_STAT), 0)
    y1 = first.output_tokens[:, 0].long()
    y2 = first.output_tokens[:, 1].long() if k else torch.full((n,), -1)
    again = first.num_accepted == 0
    second = step(lc[y1], qc[y1], 1)
    y2 = torch.where(again, second.output_tokens[:, 0].long(), y2)
    assert not first.invalid.any() and (y2 >= 0).all()
    exact = filtered_probs(l0[None], temp, top_k, top_p)[0][:, None] * filtered_probs(lc, temp, top_k, top_p)
    return y1 * V_STAT + y2, exact.reshape(-1)


@pytest.mark.parametrize(
    "k, temp, top_k, top_p, stochastic",
    [
        (2, 1.0, 0, 1.0, True),
        (1, 1.3, 5, 1.0, True),
        (3, 1.0, 0, 0.8, True),
        (2, 1.0, 0, 1.0, False),
        (3, 1.4, 5, 0.85, False),
    ],
)
def test_joint_of_first_two_tokens_is_the_target(k, temp, top_k, top_p, stochastic):
    samples, exact = chain_joint(k, temp, top_k, top_p, stochastic, seed=17 + k)
    bound = tv_bound(exact, N_STAT)
    assert tv_distance(samples, exact) < bound
    # the bound resolves a distribution only slightly off (temperature 10% higher): the test can fail
    gen = torch.Generator().manual_seed(17 + k)
    l0 = torch.randn(V_STAT, generator=gen) * 1.5
    lc = torch.randn(V_STAT, V_STAT, generator=gen) * 1.5
    off = filtered_probs(l0[None], temp * 1.1, top_k, top_p)[0][:, None] * filtered_probs(lc, temp * 1.1, top_k, top_p)
    assert tv_distance(samples, off.reshape(-1)) > bound


def test_stat_helpers_flag_a_wrong_sampler():
    # sampling the draft instead of the target must fail the same bound
    exact = torch.softmax(torch.randn(16), -1)
    wrong = torch.multinomial(torch.softmax(torch.randn(16), -1), N_STAT, replacement=True)
    right = torch.multinomial(exact, N_STAT, replacement=True)
    assert tv_distance(right, exact) < tv_bound(exact, N_STAT) < tv_distance(wrong, exact)


# ----------------------------------------------------------------------------- Triton == PyTorch, token for token


@pytest.mark.parametrize("stochastic", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_matches_reference(stochastic, dtype):
    device = DEVICE
    ks = [3, 0, 1, 4, 2, 2]
    vocab = 77  # not a multiple of the tile (32 here)
    logits, tokens, offsets, q = random_batch(ks, vocab, stochastic=stochastic, dtype=dtype, device=device)
    tokens[4:8] = logits[7:11].float().argmax(-1).to(torch.int32)  # request 3 drafts the target's argmax
    temp = torch.tensor([1.0, 0.0, 0.6, 1.5, 0.0, 1.0], device=device)
    top_k = torch.tensor([0, 0, 10, 0, 3, 0], dtype=torch.int32, device=device)
    top_p = torch.tensor([1.0, 1.0, 1.0, 0.7, 1.0, 0.9], device=device)
    seed = torch.tensor([5, 6, 7, 8, 9, 10], device=device)
    offset = torch.arange(6, device=device) * 3
    args = (logits, tokens, offsets, q, temp, top_k, top_p, seed, offset)
    for rep in range(3):
        poison = ChainVerifyResult(
            torch.full((6, 5), -7, dtype=torch.int32, device=device),
            torch.full((6,), -7, dtype=torch.int32, device=device),
            torch.ones(6, dtype=torch.bool, device=device),
        )
        fast = run("triton", *args[:-1], offset + rep, out=poison, max_draft_len=4)
        ref = run("torch", *args[:-1], offset + rep)
        assert_same(fast, ref)
        check_structure(ref, ks, tokens, offsets, vocab)


@pytest.mark.gpu
@pytest.mark.parametrize("stochastic", [True, False])
def test_triton_matches_reference_bf16_large_vocab(stochastic):
    ks = [4, 8, 0, 3] * 4
    logits, tokens, offsets, q = random_batch(ks, 128256, stochastic=stochastic, dtype=torch.bfloat16, device="cuda")
    args = (logits, tokens, offsets, q, *params(len(ks), 0.9, 0, 0.95, device="cuda"))
    assert_same(run("triton", *args, max_draft_len=8), run("torch", *args))


def test_reference_is_the_tree_engine_on_a_chain():
    """The chain reference (written from the chain math) and the tree reference agree on chains."""
    from specdec.kernels.verify_tree import verify_tree_reference

    ks = [3, 0, 5, 1, 2]
    for stochastic in (True, False):
        logits, tokens, offsets, q = random_batch(ks, 40, stochastic=stochastic, scale=1.0)
        tokens[::3] = -1 if stochastic else 45  # invalid ids take the same route in both
        p = params(5, 0.9, 7, 0.95)
        chain = verify_chain_reference(logits, tokens, offsets, q, *p, max_draft_len=5)
        node_tokens, parents, node_offsets, q_rows = chain_as_tree(tokens, offsets)
        tree = verify_tree_reference(logits, node_tokens, parents, node_offsets, q, *p, max_depth=5, q_rows=q_rows)
        assert torch.equal(chain.output_tokens, tree.output_tokens)
        assert torch.equal(chain.num_accepted, tree.num_accepted)


# ----------------------------------------------------------------------------- invariants and edge cases


def test_draft_equal_to_target_accepts_everything(backend, device):
    ks = [3, 4, 1]
    vocab = 50
    logits, tokens, offsets, _ = random_batch(ks, vocab, device=device)
    temp, top_k, top_p, seed, offset = params(3, 0.8, 0, 1.0, device=device)
    rows = torch.cat([torch.arange(int(offsets[b]) + b, int(offsets[b + 1]) + b) for b in range(3)]).to(device)
    q = filtered_probs(logits[rows].float().cpu(), 0.8).to(device)
    tokens = torch.multinomial(q, 1)[:, 0].to(torch.int32)
    for rep in range(4):
        r = verify_chain(logits, tokens, offsets, q, temp, top_k, top_p, seed, offset + rep)
        assert r.num_accepted.tolist() == ks
        check_structure(r, ks, tokens, offsets, vocab)


def test_disjoint_supports_reject_and_resample_inside_the_target(backend, device):
    vocab, n = 40, 8
    logits = torch.full((2 * n, vocab), float("-inf"))
    logits[:, :20] = torch.randn(2 * n, 20)  # target lives on 0..19
    q = torch.zeros(n, vocab)
    q[:, 20:] = torch.softmax(torch.randn(n, 20), -1)  # draft on 20..39
    tokens = (torch.multinomial(q, 1)[:, 0]).to(torch.int32)
    offsets = torch.arange(n + 1, dtype=torch.int32)
    r = verify_chain(logits.to(device), tokens.to(device), offsets.to(device), q.to(device), *params(n, device=device))
    assert (r.num_accepted == 0).all()
    assert ((r.output_tokens[:, 0] >= 0) & (r.output_tokens[:, 0] < 20)).all()


def test_residual_with_one_nonzero_entry(backend, device):
    vocab, n = 70, 6
    every = torch.arange(n)
    lucky = torch.randint(0, vocab, (n,))
    logits = torch.randn(2 * n, vocab)
    logits[2 * every, lucky] += 3.0  # p(lucky) is large, so rejections are frequent
    q = filtered_probs(logits[::2])
    q[every, lucky] = 0
    q /= q.sum(-1, keepdim=True)  # q >= p everywhere but at `lucky`: the residual is one-hot there
    tokens = torch.multinomial(q, 1)[:, 0].to(torch.int32)
    offsets = torch.arange(n + 1, dtype=torch.int32)
    args = (logits.to(device), tokens.to(device), offsets.to(device), q.to(device))
    hits = 0
    for rep in range(6):
        r = verify_chain(*args, *params(n, offset=rep, device=device))
        rejected = (r.num_accepted == 0).cpu()
        assert torch.equal(r.output_tokens[rejected, 0].cpu().long(), lucky[rejected])
        hits += int(rejected.sum())
    assert hits > 0


def test_residual_spread_over_many_tiles():
    device = DEVICE
    """Mean sampled index of a residual spread over 4 tiles of 64 is within 4 standard errors (paths agree)."""
    vocab, n = 256, 96
    logits = torch.zeros(2 * n, vocab) + torch.linspace(0, 1, vocab)  # smooth target over all tiles
    q = torch.zeros(n, vocab)
    q[:, :10] = 0.1  # draft concentrated on the first tile, so the residual covers the rest
    tokens = torch.randint(0, 10, (n,), dtype=torch.int32)
    offsets = torch.arange(n + 1, dtype=torch.int32)
    args = (logits.to(device), tokens.to(device), offsets.to(device), q.to(device), *params(n, device=device))
    ref = run("torch", *args)
    fast = run("triton", *args)
    assert_same(fast, ref)
    rejected = ref.num_accepted.cpu() == 0
    assert rejected.sum() > 0.9 * n  # a draft is accepted with probability about 1%
    p = filtered_probs(logits[:1])[0]
    residual = (p - q[0]).clamp_min(0)
    residual /= residual.sum()
    idx = torch.arange(vocab, dtype=torch.float64)
    mean = (residual * idx).sum()
    se = ((residual * (idx - mean) ** 2).sum() / n).sqrt()
    got = ref.output_tokens[rejected, 0].double().mean()
    assert abs(got - mean) < 4 * se * (n / rejected.sum()).sqrt()


@pytest.mark.parametrize("vocab", [31, 32, 33, 64, 65, 151937])
def test_vocab_at_tile_edges_never_emits_out_of_range(vocab, backend, device):
    n = 1 if vocab > 1000 else 6
    logits = torch.randn(2 * n, vocab)
    block = _pick_block(vocab)
    last_tile = (vocab - 1) // block * block
    logits[:, last_tile:] = float("-inf")  # the last tile carries no mass at all
    q = torch.softmax(torch.randn(n, vocab), -1)
    tokens = torch.randint(0, vocab, (n,), dtype=torch.int32)
    offsets = torch.arange(n + 1, dtype=torch.int32)
    args = (logits.to(device), tokens.to(device), offsets.to(device), q.to(device))
    for rep in range(1 if vocab > 1000 else 3):
        r = verify_chain(*args, *params(n, offset=rep, device=device))
        emitted = r.output_tokens[:, :2].cpu()
        assert ((emitted >= -1) & (emitted < last_tile)).all()
        check_structure(r, [1] * n, tokens, offsets, vocab)


def test_bad_draft_probabilities_are_never_accepted(backend, device):
    vocab, n = 20, 7
    logits = torch.zeros(2 * n, vocab)  # p = 1/20 everywhere
    q = torch.full((n, vocab), 1.0 / vocab)
    tokens = torch.arange(n, dtype=torch.int32)
    for b, bad in enumerate([0.0, float("nan"), float("inf"), 1.5, -0.5, float("-inf"), 1e-30]):
        q[b, b] = bad
    offsets = torch.arange(n + 1, dtype=torch.int32)
    for rep in range(5):
        r = verify_chain(
            logits.to(device),
            tokens.to(device),
            offsets.to(device),
            q.to(device),
            *params(n, offset=rep, device=device),
        )
        assert r.num_accepted[:6].tolist() == [0] * 6
        assert not r.invalid.any()
        assert ((r.output_tokens[:, 0] >= 0) & (r.output_tokens[:, 0] < vocab)).all()


def test_zero_target_probability_is_never_accepted(backend, device):
    vocab, n = 30, 6
    logits = torch.randn(2 * n, vocab)
    tokens = torch.randint(0, vocab, (n,), dtype=torch.int32)
    logits[torch.arange(0, 2 * n, 2), tokens.long()] = float("-inf")
    q = torch.softmax(torch.randn(n, vocab), -1)
    offsets = torch.arange(n + 1, dtype=torch.int32)
    for draft_probs in (q.to(device), None):
        for rep in range(4):
            args = (logits.to(device), tokens.to(device), offsets.to(device), draft_probs)
            r = verify_chain(*args, *params(n, offset=rep, device=device))
            assert (r.num_accepted == 0).all()
            assert (r.output_tokens[:, 0].cpu() != tokens).all()


# seeds whose first acceptance uniform (counter 2, offset 0) is exactly 0 and the largest value, 1 - 2**-24
SEED_U0, SEED_U1 = 3692362, 4570619


def test_extreme_uniforms(backend, device):
    """u = 0 accepts any p > 0 and none with p = 0; the largest u still accepts p >= q."""
    lo_seed, hi_seed = SEED_U0, SEED_U1
    u = counter_uniform(torch.tensor([lo_seed, hi_seed]), torch.zeros(2, dtype=torch.int64), 2)
    assert u.tolist() == [0.0, 1 - 2**-24]
    vocab = 16
    logits = torch.randn(6, vocab)
    logits[4, 5] = float("-inf")
    tokens = torch.tensor([3, 3, 5], dtype=torch.int32)
    q = filtered_probs(logits[[0, 2, 4]])
    q[1, 3] *= 1 - 1e-5  # q just below p: accepted even by the largest uniform
    q[2, 5] = 0.1  # p = 0 here: never accepted, even by the smallest uniform
    seed = torch.tensor([lo_seed, hi_seed, lo_seed])
    args = (logits.to(device), tokens.to(device), torch.arange(4, dtype=torch.int32).to(device), q.to(device))
    p = params(3, device=device)
    r = verify_chain(*args, p[0], p[1], p[2], seed.to(device), p[4])
    assert r.num_accepted.tolist() == [1, 1, 0]


@pytest.mark.parametrize("bad", ["nan_row", "all_ninf", "one_nan", "pos_inf"])
def test_rows_that_cannot_be_sampled_are_flagged(bad, backend, device):
    ks = [2, 1, 0]
    logits, tokens, offsets, q = random_batch(ks, 24)
    row = {"nan_row": 1, "all_ninf": 2, "one_nan": 0, "pos_inf": 1}[bad]
    if bad == "nan_row":
        logits[row] = float("nan")
    elif bad == "all_ninf":
        logits[row] = float("-inf")
    elif bad == "one_nan":
        logits[row, 7] = float("nan")
    else:
        logits[row, 3] = float("inf")
    args = (logits.to(device), tokens.to(device), offsets.to(device), q.to(device))
    r = verify_chain(*args, *params(3, device=device))
    assert r.invalid.tolist() == [True, False, False]
    assert r.output_tokens[0].tolist() == [-1, -1, -1] and int(r.num_accepted[0]) == 0
    alone = verify_chain(logits[3:].to(device), tokens[2:].to(device), offsets[1:].sub(2).to(device), q[2:].to(device),
                         *params(2, seed0=1, device=device), max_draft_len=2)  # fmt: skip
    assert torch.equal(alone.output_tokens, r.output_tokens[1:])


def test_greedy_follows_argmax_and_mixes_with_sampling(backend, device):
    ks = [3, 3, 2, 4]
    vocab = 60
    logits, tokens, offsets, q = random_batch(ks, vocab)
    logits = logits * 50  # softmax of these would underflow; greedy never computes it
    tokens[:3] = logits[:3].argmax(-1).to(torch.int32)  # request 0 drafts the argmax: all accepted
    tokens[6] = logits[8].argmax(-1)  # request 2: first draft right, second wrong
    tokens[7] = (logits[9].argmax(-1) + 1) % vocab
    temp = torch.tensor([0.0, 1.0, 0.0, 0.7])
    _, top_k, top_p, seed, offset = params(4)
    args = (logits.to(device), tokens.to(device), offsets.to(device), q.to(device))
    r = verify_chain(*args, temp.to(device), top_k.to(device), top_p.to(device), seed.to(device), offset.to(device))
    assert r.output_tokens[0].tolist() == tokens[:3].tolist() + [int(logits[3].argmax()), -1]
    assert int(r.num_accepted[2]) == 1
    assert int(r.output_tokens[2, 1]) == int(logits[9].argmax())
    for b in range(4):  # each request alone gives the same as in the mixed batch
        lo, hi = int(offsets[b]), int(offsets[b + 1])
        alone = verify_chain(
            logits[lo + b : hi + b + 1].to(device), tokens[lo:hi].to(device),
            torch.tensor([0, hi - lo], dtype=torch.int32, device=device), q[lo:hi].to(device),
            temp[b : b + 1].to(device), top_k[b : b + 1].to(device), top_p[b : b + 1].to(device),
            seed[b : b + 1].to(device), offset[b : b + 1].to(device), max_draft_len=4,
        )  # fmt: skip
        assert torch.equal(alone.output_tokens[0, : hi - lo + 1], r.output_tokens[b, : hi - lo + 1])


def test_filtered_tokens_stay_in_the_filtered_support(backend, device):
    ks = [2, 2, 2, 2]
    vocab = 48
    logits, tokens, offsets, q = random_batch(ks, vocab, scale=1.0)
    temp = torch.tensor([1.0, 0.7, 1.2, 1.0])
    top_k = torch.tensor([4, 0, 6, 0], dtype=torch.int32)
    top_p = torch.tensor([1.0, 0.6, 0.8, 0.5])
    rows = torch.arange(12)
    support = torch.stack(
        [
            filtered_probs(logits[r : r + 1], float(temp[r // 3]), int(top_k[r // 3]), float(top_p[r // 3]))[0] > 0
            for r in rows
        ]
    )
    tokens = torch.multinomial(torch.ones(8, vocab), 1)[:, 0].to(torch.int32)  # many drafts outside the support
    args = (logits.to(device), tokens.to(device), offsets.to(device), q.to(device))
    for rep in range(2):
        r = verify_chain(*args, temp.to(device), top_k.to(device), top_p.to(device), torch.arange(4, device=device),
                         torch.full((4,), rep, device=device))  # fmt: skip
        for b in range(4):
            for i in range(int(r.num_accepted[b]) + 1):
                assert support[3 * b + i, int(r.output_tokens[b, i])], f"request {b}, position {i}"


def test_structure_ragged_and_empty_drafts(backend, device):
    ks = [0, 5, 1, 0, 3]
    vocab = 35
    logits, tokens, offsets, q = random_batch(ks, vocab)
    args = (logits.to(device), tokens.to(device), offsets.to(device), q.to(device))
    r = verify_chain(*args, *params(5, device=device))
    assert r.output_tokens.shape == (5, 6)
    check_structure(r, ks, tokens, offsets, vocab)
    assert (r.output_tokens[[0, 3], 1:] == -1).all()


def test_bonus_only_when_all_accepted(backend, device):
    ks = [2, 2, 2, 2, 2, 2]
    vocab = 12
    logits, tokens, offsets, q = random_batch(ks, vocab, scale=0.5)
    for rep in range(3):
        r = verify_chain(
            logits.to(device),
            tokens.to(device),
            offsets.to(device),
            q.to(device),
            *params(6, offset=rep, device=device),
        )
        check_structure(r, ks, tokens, offsets, vocab)
        for b in range(6):
            a = int(r.num_accepted[b])
            if a < 2:  # rejected at a: the emitted token comes from the residual of row a, never the bonus row
                assert int(r.output_tokens[b, 2]) == -1


def test_seeds_are_batch_and_order_invariant(backend, device):
    ks = [2, 3, 1, 4]
    logits, tokens, offsets, q = random_batch(ks, 45, scale=0.5)
    temp, top_k, top_p, seed, offset = params(4, 0.9, 0, 0.95, seed0=100)
    args = (logits, tokens, offsets, q, temp, top_k, top_p, seed, offset)
    full = verify_chain(*(a.to(device) for a in args), max_draft_len=4)
    again = verify_chain(*(a.to(device) for a in args), max_draft_len=4)
    assert_same(full, again)
    order = [2, 0, 3, 1]
    starts = offsets.tolist()
    sub_logits = torch.cat([logits[starts[b] + b : starts[b + 1] + b + 1] for b in order])
    sub_tokens = torch.cat([tokens[starts[b] : starts[b + 1]] for b in order])
    sub_q = torch.cat([q[starts[b] : starts[b + 1]] for b in order])
    sub_offsets = torch.tensor([0] + [ks[b] for b in order]).cumsum(0).to(torch.int32)
    perm = torch.tensor(order)
    shuffled = verify_chain(
        sub_logits.to(device), sub_tokens.to(device), sub_offsets.to(device), sub_q.to(device),
        *(t[perm].to(device) for t in (temp, top_k, top_p, seed, offset)), max_draft_len=4,
    )  # fmt: skip
    assert torch.equal(shuffled.output_tokens.cpu(), full.output_tokens.cpu()[perm])


def test_max_draft_len_truncates_exactly(backend, device):
    ks = [4, 1]
    logits, tokens, offsets, q = random_batch(ks, 20)
    r = verify_chain(
        logits.to(device),
        tokens.to(device),
        offsets.to(device),
        q.to(device),
        *params(2, device=device),
        max_draft_len=2,
    )
    assert r.output_tokens.shape == (2, 3)
    assert int(r.num_accepted[0]) <= 2


# ----------------------------------------------------------------------------- regressions (issue 13)


@pytest.mark.parametrize("stochastic", [True, False])
def test_a_batch_where_no_request_drafted_samples_one_token_per_request(stochastic, backend, device):
    vocab = 40
    logits = torch.randn(3, vocab)
    draft_probs = torch.empty(0, vocab, device=device) if stochastic else None
    no_drafts = torch.empty(0, dtype=torch.int32, device=device)
    with bounds_checked():
        r = verify_chain(logits.to(device), no_drafts, torch.zeros(4, dtype=torch.int32, device=device), draft_probs,
                         *params(3, 0.9, device=device))  # fmt: skip
    with _backend.use_backend("torch"):
        expected, _ = sample(logits, *params(3, 0.9))
    assert r.num_accepted.tolist() == [0, 0, 0] and not r.invalid.any()
    assert r.output_tokens[:, 0].tolist() == expected.tolist()


@pytest.mark.parametrize("stochastic", [True, False])
def test_the_last_request_accepting_every_draft_reads_nothing_past_the_drafts(stochastic, backend, device):
    """The final sample after a fully accepted chain must not touch draft row T (one past the end)."""
    ks = [1, 3]
    vocab = 37
    logits, tokens, offsets, _ = random_batch(ks, vocab)
    rows = torch.tensor([0, 2, 3, 4])  # the target rows that score the four drafts
    logits[rows, tokens.long()] += 40.0  # p(draft) = 1 up to rounding: every draft is accepted
    q = filtered_probs(logits[rows]) if stochastic else None
    for rep in range(3):
        with bounds_checked():
            r = verify_chain(logits.to(device), tokens.to(device), offsets.to(device),
                             None if q is None else q.to(device), *params(2, offset=rep, device=device))  # fmt: skip
        assert r.num_accepted.tolist() == ks
        check_structure(r, ks, tokens, offsets, vocab)


# ----------------------------------------------------------------------------- input validation


def test_bad_inputs():
    ks = [2, 1]
    logits, tokens, offsets, q = random_batch(ks, 10)
    p = params(2)
    ok = (logits, tokens, offsets, q, *p)

    def call(**change):
        names = ["target_logits", "draft_tokens", "draft_offsets", "draft_probs", "temperature", "top_k", "top_p",
                 "seed", "offset"]  # fmt: skip
        kwargs = dict(zip(names, ok))
        kwargs.update(change)
        return verify_chain(*[kwargs[n] for n in names])

    with pytest.raises(TypeError, match="target_logits"):
        call(target_logits=logits.double())
    with pytest.raises(TypeError, match="draft_tokens"):
        call(draft_tokens=tokens.long())
    with pytest.raises(TypeError, match="draft_offsets"):
        call(draft_offsets=offsets.long())
    with pytest.raises(TypeError, match="temperature"):
        call(temperature=p[0].double())
    with pytest.raises(TypeError, match="top_k"):
        call(top_k=p[1].long())
    with pytest.raises(TypeError, match="seed"):
        call(seed=p[3].int())
    with pytest.raises(ValueError, match="draft_probs has vocabulary 11"):
        call(draft_probs=torch.rand(3, 11))
    with pytest.raises(ValueError, match="draft_probs must have 3 rows"):
        call(draft_probs=torch.rand(4, 10))
    with pytest.raises(ValueError, match="target_logits must have T \\+ B"):
        call(target_logits=logits[:-1])
    with pytest.raises(ValueError, match="top_p must have shape"):
        call(top_p=torch.ones(3))
    with pytest.raises(ValueError, match="draft_offsets must be non-decreasing"):
        call(draft_offsets=torch.tensor([0, 4, 3], dtype=torch.int32))
    with pytest.raises(ValueError, match="draft_offsets\\[-1\\] must equal"):
        call(draft_offsets=torch.tensor([0, 1, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match="max_draft_len"):
        verify_chain(*ok, max_draft_len=-1)
    with pytest.raises(ValueError, match="out.output_tokens must have shape"):
        verify_chain(*ok, out=ChainVerifyResult(torch.empty(2, 2, dtype=torch.int32), torch.empty(2, dtype=torch.int32),
                                                torch.empty(2, dtype=torch.bool)))  # fmt: skip


@pytest.mark.gpu
def test_device_mismatch():
    logits, tokens, offsets, q = random_batch([2], 10)
    with pytest.raises(ValueError, match="draft_tokens is on"):
        verify_chain(logits.cuda(), tokens, offsets.cuda(), None, *params(1, device="cuda"))
