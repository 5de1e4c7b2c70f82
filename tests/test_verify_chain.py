"""verify_chain: exactness (total variation on the PyTorch path), the Triton kernels token for token
against the PyTorch reference, structure invariants, edge cases and input validation."""

import pytest
import torch
from sampling_helpers import (
    N_STAT,
    V_STAT,
    assert_joint_is_exact,
    exact_probs,
    joint_case,
    params,
    tv_bound,
    tv_distance,
)
from triton_bounds import bounds_checked

from specdec import _backend
from specdec.kernels import ChainVerifyResult, SamplingParams, counter_uniform, sample, verify_chain
from specdec.kernels.top_k_top_p import vocab_block
from specdec.kernels.uniforms import ROLE_TEST
from specdec.kernels.verify_chain import verify_chain_reference
from specdec.kernels.verify_tree import verify_tree_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# ----------------------------------------------------------------------------- helpers


def random_batch(ks, vocab, *, stochastic=True, dtype=torch.float32, device="cpu", scale=2.0):
    """Random ragged chains: logits, drafts sampled from the given draft rows, offsets, draft rows (or None)."""
    offsets = torch.tensor([0] + list(ks)).cumsum(0).to(torch.int32)
    total, batch = int(offsets[-1]), len(ks)
    logits = (torch.randn(total + batch, vocab) * scale).to(dtype)
    q = torch.softmax(torch.randn(total, vocab) * scale, -1)
    tokens = torch.multinomial(q, 1)[:, 0].to(torch.int32) if total else torch.empty(0, dtype=torch.int32)
    return logits.to(device), tokens.to(device), offsets.to(device), (q.to(device) if stochastic else None)


def rule_of(draft_probs) -> str:
    return "deterministic" if draft_probs is None else "stochastic"


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


def chain_joint(k, temp, top_k, top_p, stochastic, seed):
    """Emit with verify_chain until every request has two tokens; return the joint samples (y1 * V + y2)."""
    l0, lc, q0, qc = joint_case(seed)
    gen = torch.Generator().manual_seed(seed + 1)
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
            return verify_chain(logits, tokens, offsets, params(n, temp, top_k, top_p, seed * n, offset),
                                rule=rule_of(probs), draft_probs=probs)  # fmt: skip

    first = step(l0.expand(n, V_STAT), q0.expand(n, V_STAT), 0)
    y1 = first.output_tokens[:, 0].long()
    y2 = first.output_tokens[:, 1].long() if k else torch.full((n,), -1)
    again = first.num_accepted == 0
    second = step(lc[y1], qc[y1], 1)
    y2 = torch.where(again, second.output_tokens[:, 0].long(), y2)
    assert not first.invalid.any() and (y2 >= 0).all()
    return y1 * V_STAT + y2


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
    assert_joint_is_exact(chain_joint(k, temp, top_k, top_p, stochastic, seed=17 + k), 17 + k, temp, top_k, top_p)


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
    p = SamplingParams.make(
        6, temperature=[1.0, 0.0, 0.6, 1.5, 0.0, 1.0], top_k=[0, 0, 10, 0, 3, 0], top_p=[1.0, 1.0, 1.0, 0.7, 1.0, 0.9],
        seed=[5, 6, 7, 8, 9, 10], offset=torch.arange(6) * 3, device=device,
    )  # fmt: skip
    for rep in range(3):
        poison = ChainVerifyResult(
            torch.full((6, 5), -7, dtype=torch.int32, device=device),
            torch.full((6,), -7, dtype=torch.int32, device=device),
            torch.ones(6, dtype=torch.bool, device=device),
        )
        p_rep = p._replace(offset=p.offset + rep)
        args = (logits, tokens, offsets, p_rep)
        fast = run("triton", *args, rule=rule_of(q), draft_probs=q, out=poison, max_draft_len=4)
        ref = run("torch", *args, rule=rule_of(q), draft_probs=q)
        assert fast is poison
        assert_same(fast, ref)
        check_structure(ref, ks, tokens, offsets, vocab)


@pytest.mark.gpu
@pytest.mark.parametrize("stochastic", [True, False])
def test_triton_matches_reference_bf16_large_vocab(stochastic):
    ks = [4, 8, 0, 3] * 4
    logits, tokens, offsets, q = random_batch(ks, 128256, stochastic=stochastic, dtype=torch.bfloat16, device="cuda")
    args = (logits, tokens, offsets, params(len(ks), 0.9, 0, 0.95, device="cuda"))
    kwargs = dict(rule=rule_of(q), draft_probs=q)
    assert_same(run("triton", *args, max_draft_len=8, **kwargs), run("torch", *args, **kwargs))


def test_reference_is_the_tree_engine_on_a_chain():
    """The chain reference (written from the chain math) and the tree reference agree on chains."""
    ks = [3, 0, 5, 1, 2]
    for stochastic in (True, False):
        logits, tokens, offsets, q = random_batch(ks, 40, stochastic=stochastic, scale=1.0)
        tokens[::3] = -1 if stochastic else 45  # invalid ids take the same route in both
        p = params(5, 0.9, 7, 0.95)
        chain = verify_chain_reference(logits, tokens, offsets, p, rule=rule_of(q), draft_probs=q, max_draft_len=5)
        node_tokens, parents, node_offsets, q_rows = chain_as_tree(tokens, offsets)
        tree = verify_tree_reference(logits, node_tokens, parents, node_offsets, p, rule=rule_of(q), draft_probs=q,
                                     max_depth=5, q_rows=q_rows)  # fmt: skip
        assert torch.equal(chain.output_tokens, tree.output_tokens)
        assert torch.equal(chain.num_accepted, tree.num_accepted)


@pytest.mark.parametrize("stochastic", [True, False])
def test_unchecked_verify_chain_equals_the_checked_function(stochastic, backend, device):
    """The unchecked hot-path call (check=False) gives verify_chain's results, token for token, on either backend."""
    ks = [2, 0, 5, 3]
    logits, tokens, offsets, q = random_batch(ks, 45, stochastic=stochastic, device=device)
    p = SamplingParams.make(4, temperature=[0.7, 1.0, 0.0, 1.3], top_k=[0, 5, 0, 0], top_p=[1.0, 1.0, 1.0, 0.8],
                            seed=[11, 12, 13, 14], device=device)  # fmt: skip
    for width in (5, 2):
        expected = verify_chain(logits, tokens, offsets, p, rule=rule_of(q), draft_probs=q, max_draft_len=width)
        got = verify_chain(logits, tokens, offsets, p, rule=rule_of(q), draft_probs=q, max_draft_len=width, check=False)
        assert_same(got, expected)


# ----------------------------------------------------------------------------- invariants and edge cases


def test_draft_equal_to_target_accepts_everything(backend, device):
    ks = [3, 4, 1]
    vocab = 50
    logits, tokens, offsets, _ = random_batch(ks, vocab, device=device)
    rows = torch.cat([torch.arange(int(offsets[b]) + b, int(offsets[b + 1]) + b) for b in range(3)]).to(device)
    q = exact_probs(logits[rows].float().cpu(), 0.8).to(device)
    tokens = torch.multinomial(q, 1)[:, 0].to(torch.int32)
    for rep in range(4):
        r = verify_chain(logits, tokens, offsets, params(3, 0.8, offset=rep, device=device), rule="stochastic",
                         draft_probs=q)  # fmt: skip
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
    r = verify_chain(logits.to(device), tokens.to(device), offsets.to(device), params(n, device=device),
                     rule="stochastic", draft_probs=q.to(device))  # fmt: skip
    assert (r.num_accepted == 0).all()
    assert ((r.output_tokens[:, 0] >= 0) & (r.output_tokens[:, 0] < 20)).all()


def test_residual_with_one_nonzero_entry(backend, device):
    vocab, n = 70, 6
    every = torch.arange(n)
    lucky = torch.randint(0, vocab, (n,))
    logits = torch.randn(2 * n, vocab)
    logits[2 * every, lucky] += 3.0  # p(lucky) is large, so rejections are frequent
    q = exact_probs(logits[::2])
    q[every, lucky] = 0
    q /= q.sum(-1, keepdim=True)  # q >= p everywhere but at `lucky`: the residual is one-hot there
    tokens = torch.multinomial(q, 1)[:, 0].to(torch.int32)
    offsets = torch.arange(n + 1, dtype=torch.int32)
    args = (logits.to(device), tokens.to(device), offsets.to(device))
    hits = 0
    for rep in range(6):
        r = verify_chain(*args, params(n, offset=rep, device=device), rule="stochastic", draft_probs=q.to(device))
        rejected = (r.num_accepted == 0).cpu()
        assert torch.equal(r.output_tokens[rejected, 0].cpu().long(), lucky[rejected])
        hits += int(rejected.sum())
    assert hits > 0


def test_residual_spread_over_many_tiles():
    """Mean sampled index of a residual spread over 4 tiles of 64 is within 4 standard errors (paths agree)."""
    device = DEVICE
    vocab, n = 256, 96
    logits = torch.zeros(2 * n, vocab) + torch.linspace(0, 1, vocab)  # smooth target over all tiles
    q = torch.zeros(n, vocab)
    q[:, :10] = 0.1  # draft concentrated on the first tile, so the residual covers the rest
    tokens = torch.randint(0, 10, (n,), dtype=torch.int32)
    offsets = torch.arange(n + 1, dtype=torch.int32)
    args = (logits.to(device), tokens.to(device), offsets.to(device), params(n, device=device))
    kwargs = dict(rule="stochastic", draft_probs=q.to(device))
    ref = run("torch", *args, **kwargs)
    fast = run("triton", *args, **kwargs)
    assert_same(fast, ref)
    rejected = ref.num_accepted.cpu() == 0
    assert rejected.sum() > 0.9 * n  # a draft is accepted with probability about 1%
    p = exact_probs(logits[:1])[0]
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
    block = vocab_block(vocab)
    last_tile = (vocab - 1) // block * block
    logits[:, last_tile:] = float("-inf")  # the last tile carries no mass at all
    q = torch.softmax(torch.randn(n, vocab), -1)
    tokens = torch.randint(0, vocab, (n,), dtype=torch.int32)
    offsets = torch.arange(n + 1, dtype=torch.int32)
    args = (logits.to(device), tokens.to(device), offsets.to(device))
    for rep in range(1 if vocab > 1000 else 3):
        r = verify_chain(*args, params(n, offset=rep, device=device), rule="stochastic", draft_probs=q.to(device))
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
        r = verify_chain(logits.to(device), tokens.to(device), offsets.to(device), params(n, offset=rep, device=device),
                         rule="stochastic", draft_probs=q.to(device))  # fmt: skip
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
            r = verify_chain(logits.to(device), tokens.to(device), offsets.to(device),
                             params(n, offset=rep, device=device), rule=rule_of(draft_probs),
                             draft_probs=draft_probs)  # fmt: skip
            assert (r.num_accepted == 0).all()
            assert (r.output_tokens[:, 0].cpu() != tokens).all()


# seeds whose first acceptance uniform (role ROLE_TEST at position 0) is exactly 0 and the largest value, 1 - 2**-24
SEED_U0, SEED_U1 = 20787457, 1300165


def test_extreme_uniforms(backend, device):
    """u = 0 accepts any p > 0 and none with p = 0; the largest u still accepts p >= q."""
    seeds, offsets = torch.tensor([SEED_U0, SEED_U1], device=device), torch.zeros(2, dtype=torch.int64, device=device)
    u = counter_uniform(seeds, offsets, ROLE_TEST)
    assert u.tolist() == [0.0, 1 - 2**-24]
    vocab = 16
    logits = torch.randn(6, vocab)
    logits[4, 5] = float("-inf")
    tokens = torch.tensor([3, 3, 5], dtype=torch.int32)
    q = exact_probs(logits[[0, 2, 4]])
    q[1, 3] *= 1 - 1e-5  # q just below p: accepted even by the largest uniform
    q[2, 5] = 0.1  # p = 0 here: never accepted, even by the smallest uniform
    p = SamplingParams.make(3, temperature=1.0, seed=[SEED_U0, SEED_U1, SEED_U0], device=device)
    r = verify_chain(logits.to(device), tokens.to(device), torch.arange(4, dtype=torch.int32).to(device), p,
                     rule="stochastic", draft_probs=q.to(device))  # fmt: skip
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
    r = verify_chain(logits.to(device), tokens.to(device), offsets.to(device), params(3, device=device),
                     rule="stochastic", draft_probs=q.to(device))  # fmt: skip
    assert r.invalid.tolist() == [True, False, False]
    assert r.output_tokens[0].tolist() == [-1, -1, -1] and int(r.num_accepted[0]) == 0
    alone = verify_chain(logits[3:].to(device), tokens[2:].to(device), offsets[1:].sub(2).to(device),
                         params(2, seed0=1, device=device), rule="stochastic", draft_probs=q[2:].to(device),
                         max_draft_len=2)  # fmt: skip
    assert torch.equal(alone.output_tokens, r.output_tokens[1:])


def test_greedy_follows_argmax_and_mixes_with_sampling(backend, device):
    ks = [3, 3, 2, 4]
    vocab = 60
    logits, tokens, offsets, q = random_batch(ks, vocab)
    logits = logits * 50  # softmax of these would underflow; greedy never computes it
    tokens[:3] = logits[:3].argmax(-1).to(torch.int32)  # request 0 drafts the argmax: all accepted
    tokens[6] = logits[8].argmax(-1)  # request 2: first draft right, second wrong
    tokens[7] = (logits[9].argmax(-1) + 1) % vocab
    p = params(4, device=device)._replace(temperature=torch.tensor([0.0, 1.0, 0.0, 0.7], device=device))
    r = verify_chain(logits.to(device), tokens.to(device), offsets.to(device), p, rule="stochastic",
                     draft_probs=q.to(device))  # fmt: skip
    assert r.output_tokens[0].tolist() == tokens[:3].tolist() + [int(logits[3].argmax()), -1]
    assert int(r.num_accepted[2]) == 1
    assert int(r.output_tokens[2, 1]) == int(logits[9].argmax())
    for b in range(4):  # each request alone gives the same as in the mixed batch
        lo, hi = int(offsets[b]), int(offsets[b + 1])
        alone = verify_chain(
            logits[lo + b : hi + b + 1].to(device), tokens[lo:hi].to(device),
            torch.tensor([0, hi - lo], dtype=torch.int32, device=device), p.select(torch.tensor([b], device=device)),
            rule="stochastic", draft_probs=q[lo:hi].to(device), max_draft_len=4,
        )  # fmt: skip
        assert torch.equal(alone.output_tokens[0, : hi - lo + 1], r.output_tokens[b, : hi - lo + 1])


def test_filtered_tokens_stay_in_the_filtered_support(backend, device):
    ks = [2, 2, 2, 2]
    vocab = 48
    logits, tokens, offsets, q = random_batch(ks, vocab, scale=1.0)
    temp, top_k, top_p = [1.0, 0.7, 1.2, 1.0], [4, 0, 6, 0], [1.0, 0.6, 0.8, 0.5]
    support = torch.stack(
        [exact_probs(logits[r : r + 1], temp[r // 3], top_k[r // 3], top_p[r // 3])[0] > 0 for r in range(12)]
    )
    tokens = torch.multinomial(torch.ones(8, vocab), 1)[:, 0].to(torch.int32)  # many drafts outside the support
    args = (logits.to(device), tokens.to(device), offsets.to(device))
    for rep in range(2):
        p = SamplingParams.make(4, temperature=temp, top_k=top_k, top_p=top_p, seed=torch.arange(4), offset=rep,
                                device=device)  # fmt: skip
        r = verify_chain(*args, p, rule="stochastic", draft_probs=q.to(device))
        for b in range(4):
            for i in range(int(r.num_accepted[b]) + 1):
                assert support[3 * b + i, int(r.output_tokens[b, i])], f"request {b}, position {i}"


def test_structure_ragged_and_empty_drafts(backend, device):
    ks = [0, 5, 1, 0, 3]
    vocab = 35
    logits, tokens, offsets, q = random_batch(ks, vocab)
    r = verify_chain(logits.to(device), tokens.to(device), offsets.to(device), params(5, device=device),
                     rule="stochastic", draft_probs=q.to(device))  # fmt: skip
    assert r.output_tokens.shape == (5, 6)
    check_structure(r, ks, tokens, offsets, vocab)
    assert (r.output_tokens[[0, 3], 1:] == -1).all()


def test_an_empty_batch_gives_empty_results(backend, device):
    logits, no_drafts = torch.empty(0, 19, device=device), torch.empty(0, dtype=torch.int32, device=device)
    offsets = torch.zeros(1, dtype=torch.int32, device=device)
    for q in (torch.empty(0, 19, device=device), None):
        r = verify_chain(logits, no_drafts, offsets, params(0, device=device), rule=rule_of(q), draft_probs=q)
        assert [tuple(t.shape) for t in r] == [(0, 1), (0,), (0,)]
    assert tuple(sample(logits, params(0, device=device)).tokens.shape) == (0,)


def test_bonus_only_when_all_accepted(backend, device):
    ks = [2, 2, 2, 2, 2, 2]
    vocab = 12
    logits, tokens, offsets, q = random_batch(ks, vocab, scale=0.5)
    for rep in range(3):
        r = verify_chain(logits.to(device), tokens.to(device), offsets.to(device), params(6, offset=rep, device=device),
                         rule="stochastic", draft_probs=q.to(device))  # fmt: skip
        check_structure(r, ks, tokens, offsets, vocab)
        for b in range(6):
            a = int(r.num_accepted[b])
            if a < 2:  # rejected at a: the emitted token comes from the residual of row a, never the bonus row
                assert int(r.output_tokens[b, 2]) == -1


def test_seeds_are_batch_and_order_invariant(backend, device):
    ks = [2, 3, 1, 4]
    logits, tokens, offsets, q = random_batch(ks, 45, scale=0.5)
    p = params(4, 0.9, 0, 0.95, seed0=100, device=device)
    args = [a.to(device) for a in (logits, tokens, offsets)]
    full = verify_chain(*args, p, rule="stochastic", draft_probs=q.to(device), max_draft_len=4)
    again = verify_chain(*args, p, rule="stochastic", draft_probs=q.to(device), max_draft_len=4)
    assert_same(full, again)
    order = [2, 0, 3, 1]
    starts = offsets.tolist()
    sub_logits = torch.cat([logits[starts[b] + b : starts[b + 1] + b + 1] for b in order])
    sub_tokens = torch.cat([tokens[starts[b] : starts[b + 1]] for b in order])
    sub_q = torch.cat([q[starts[b] : starts[b + 1]] for b in order])
    sub_offsets = torch.tensor([0] + [ks[b] for b in order]).cumsum(0).to(torch.int32)
    perm = torch.tensor(order)
    shuffled = verify_chain(sub_logits.to(device), sub_tokens.to(device), sub_offsets.to(device),
                            p.select(perm.to(device)), rule="stochastic", draft_probs=sub_q.to(device),
                            max_draft_len=4)  # fmt: skip
    assert torch.equal(shuffled.output_tokens.cpu(), full.output_tokens.cpu()[perm])


def test_max_draft_len_truncates_exactly(backend, device):
    ks = [4, 1]
    logits, tokens, offsets, q = random_batch(ks, 20)
    r = verify_chain(logits.to(device), tokens.to(device), offsets.to(device), params(2, device=device),
                     rule="stochastic", draft_probs=q.to(device), max_draft_len=2)  # fmt: skip
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
        r = verify_chain(logits.to(device), no_drafts, torch.zeros(4, dtype=torch.int32, device=device),
                         params(3, 0.9, device=device), rule=rule_of(draft_probs), draft_probs=draft_probs)  # fmt: skip
    with _backend.use_backend("torch"):
        expected, _ = sample(logits, params(3, 0.9))
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
    q = exact_probs(logits[rows]).to(device) if stochastic else None
    for rep in range(3):
        with bounds_checked():
            r = verify_chain(logits.to(device), tokens.to(device), offsets.to(device),
                             params(2, offset=rep, device=device), rule=rule_of(q), draft_probs=q)  # fmt: skip
        assert r.num_accepted.tolist() == ks
        check_structure(r, ks, tokens, offsets, vocab)


# ----------------------------------------------------------------------------- input validation


def test_bad_inputs():
    ks = [2, 1]
    logits, tokens, offsets, q = random_batch(ks, 10)
    p = params(2)
    names = ["target_logits", "draft_tokens", "draft_offsets", "params"]
    ok = dict(zip(names, (logits, tokens, offsets, p)))

    def call(rule="stochastic", draft_probs=q, **change):
        return verify_chain(*[{**ok, **change}[n] for n in names], rule=rule, draft_probs=draft_probs)

    with pytest.raises(TypeError, match="target_logits"):
        call(target_logits=logits.double())
    with pytest.raises(TypeError, match="draft_tokens"):
        call(draft_tokens=tokens.long())
    with pytest.raises(TypeError, match="draft_offsets"):
        call(draft_offsets=offsets.long())
    with pytest.raises(TypeError, match="params.temperature"):
        call(params=p._replace(temperature=p.temperature.double()))
    with pytest.raises(TypeError, match="params.top_k"):
        call(params=p._replace(top_k=p.top_k.long()))
    with pytest.raises(TypeError, match="params.seed"):
        call(params=p._replace(seed=p.seed.int()))
    with pytest.raises(TypeError, match="params must be a SamplingParams"):
        call(params=tuple(p))
    with pytest.raises(ValueError, match="draft_probs has vocabulary 11"):
        call(draft_probs=torch.rand(3, 11))
    with pytest.raises(ValueError, match="draft_probs must have 3 rows"):
        call(draft_probs=torch.rand(4, 10))
    with pytest.raises(ValueError, match="target_logits must have T \\+ B"):
        call(target_logits=logits[:-1])
    with pytest.raises(ValueError, match="params.top_p must have shape"):
        call(params=p._replace(top_p=torch.ones(3)))
    with pytest.raises(ValueError, match="draft_offsets must be non-decreasing"):
        call(draft_offsets=torch.tensor([0, 4, 3], dtype=torch.int32))
    with pytest.raises(ValueError, match="draft_offsets\\[-1\\] must equal"):
        call(draft_offsets=torch.tensor([0, 1, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match="rule='stochastic' needs draft_probs"):
        call(draft_probs=None)
    with pytest.raises(ValueError, match="rule='deterministic' takes no draft_probs"):
        call(rule="deterministic")
    with pytest.raises(ValueError, match="rule must be one of"):
        call(rule="greedy")
    with pytest.raises(TypeError, match="rule"):
        verify_chain(logits, tokens, offsets, p, draft_probs=q)  # rule is required
    with pytest.raises(ValueError, match="max_draft_len"):
        verify_chain(*ok.values(), rule="stochastic", draft_probs=q, max_draft_len=-1)
    short = ChainVerifyResult(torch.empty(2, 2, dtype=torch.int32), torch.empty(2, dtype=torch.int32),
                              torch.empty(2, dtype=torch.bool))  # fmt: skip
    with pytest.raises(ValueError, match="out.output_tokens must have shape"):
        verify_chain(*ok.values(), rule="stochastic", draft_probs=q, out=short)
    with pytest.raises(TypeError, match="out must be a ChainVerifyResult"):
        verify_chain(*ok.values(), rule="stochastic", draft_probs=q, out=tuple(short))


@pytest.mark.gpu
def test_device_mismatch():
    logits, tokens, offsets, q = random_batch([2], 10)
    with pytest.raises(ValueError, match="draft_tokens is on"):
        verify_chain(logits.cuda(), tokens, offsets.cuda(), params(1, device="cuda"), rule="deterministic")


@pytest.mark.parametrize("temp, top_k, top_p", [(1.0, 0, 1.0), (0.7, 5, 0.9)])
def test_deterministic_rule_emits_plain_samplings_tokens(backend, device, temp, top_k, top_p):
    # Row i of a request is position offset + i: each emitted token is `sample`'s draw on that row there,
    # whatever was drafted; drafts copy that draw with probability 3/4, so chains get accepted deep.
    ks, vocab = [4, 0, 6, 2, 5], 30
    batch, rows = len(ks), sum(ks) + len(ks)
    logits = torch.randn(rows, vocab) * 2
    seeds, starts = torch.randint(0, 2**40, (batch,)), torch.randint(0, 1000, (batch,))
    row_req = torch.repeat_interleave(torch.arange(batch), torch.tensor(ks) + 1)
    first_row = torch.tensor([sum(k + 1 for k in ks[:b]) for b in range(batch)])  # request b's first row
    index = torch.arange(rows) - first_row[row_req]
    per_row = SamplingParams.make(rows, temperature=temp, top_k=top_k, top_p=top_p, seed=seeds[row_req],
                                  offset=starts[row_req] + index, device=device)  # fmt: skip
    drawn = sample(logits.to(device), per_row).tokens.cpu()
    drafts = []
    for b, k in enumerate(ks):
        for i in range(k):
            copy = torch.rand(()) < 0.75
            drafts.append(int(drawn[first_row[b] + i]) if copy else int(torch.randint(0, vocab, ())))
    draft_tokens = torch.tensor(drafts, dtype=torch.int32)
    offsets = torch.tensor([0] + ks).cumsum(0).to(torch.int32)
    p = SamplingParams.make(batch, temperature=temp, top_k=top_k, top_p=top_p, seed=seeds, offset=starts,
                            device=device)  # fmt: skip
    r = verify_chain(logits.to(device), draft_tokens.to(device), offsets.to(device), p, rule="deterministic")
    check_structure(r, ks, draft_tokens, offsets, vocab)
    out, accepted = r.output_tokens.cpu(), r.num_accepted.cpu()
    for b in range(batch):
        assert out[b, : int(accepted[b]) + 1].tolist() == drawn[first_row[b] : first_row[b] + accepted[b] + 1].tolist()
    assert int(accepted.sum()) >= 4
