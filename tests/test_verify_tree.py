"""verify_tree: exactness of both tree rules (total variation on the PyTorch path), the Triton kernels
token for token against the PyTorch reference, path structure, edge cases and input validation."""

import pytest
import torch
from sampling_helpers import N_STAT, V_STAT, assert_joint_is_exact, exact_probs, joint_case, params

from specdec import _backend
from specdec.kernels import SamplingParams, TreeVerifyResult, sample, verify_tree

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# ----------------------------------------------------------------------------- helpers


def rule_of(draft_probs) -> str:
    return "deterministic" if draft_probs is None else "stochastic"


def random_trees(sizes, vocab, *, dtype=torch.float32, scale=1.5):
    """Random trees (parents first), logits, tokens drawn from each parent's draft row, draft rows."""
    parents = []
    for n in sizes:
        parents += [-1] + [int(torch.randint(0, i, (1,))) for i in range(1, n)]
    parents = torch.tensor(parents, dtype=torch.int32)
    offsets = torch.tensor([0] + list(sizes)).cumsum(0).to(torch.int32)
    total = int(offsets[-1])
    logits = (torch.randn(total, vocab) * scale).to(dtype)
    q = torch.softmax(torch.randn(total, vocab) * scale, -1)
    tokens = torch.zeros(total, dtype=torch.int32)
    for b, n in enumerate(sizes):
        start = int(offsets[b])
        for i in range(1, n):
            tokens[start + i] = torch.multinomial(q[start + int(parents[start + i])], 1)[0]
    return logits, tokens, parents, offsets, q


def run(backend, *args, **kwargs):
    with _backend.use_backend(backend):
        return verify_tree(*args, **kwargs)


def assert_same(a, b):
    for name, x, y in zip(TreeVerifyResult._fields, a, b):
        assert torch.equal(x.cpu(), y.cpu()), f"{name} differs:\n{x}\n{y}"


def check_structure(result, tokens, parents, offsets, vocab):
    """The path is a root-to-node chain of the tree, the tokens are its nodes' tokens, then one more."""
    out, accepted, path, invalid = (t.cpu() for t in result)
    for b in range(offsets.numel() - 1):
        start = int(offsets[b])
        row, prow = out[b].tolist(), path[b].tolist()
        a = int(accepted[b])
        assert prow[0] == 0
        if invalid[b]:
            assert a == 0 and all(t == -1 for t in row) and all(t == -1 for t in prow[1:])
            continue
        for d in range(1, a + 1):
            assert int(parents[start + prow[d]]) == prow[d - 1], f"request {b}: path {prow} is not a chain"
            assert row[d - 1] == int(tokens[start + prow[d]])
        assert 0 <= row[a] < vocab
        assert all(t == -1 for t in row[a + 1 :]) and all(t == -1 for t in prow[a + 1 :])


# ----------------------------------------------------------------------------- exactness (PyTorch path)

SHAPE = [-1, 0, 0, 0, 1, 1, 2]  # root with 3 children, depth 2, branching 2 below the first child


def tree_joint(temp, top_k, top_p, stochastic, seed):
    """First two emitted tokens of many seeded tree verifications (one sample() to finish short ones)."""
    l0, lc, q0, qc = joint_case(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    n, size = N_STAT, len(SHAPE)
    tokens = torch.zeros(n, size, dtype=torch.long)
    rows, qrows = [l0.expand(n, V_STAT)], [q0.expand(n, V_STAT)]
    for i in range(1, size):
        parent_q = qrows[SHAPE[i]]
        if stochastic:
            tokens[:, i] = torch.multinomial(parent_q, 1, generator=gen)[:, 0]  # siblings i.i.d. from q
        else:
            tokens[:, i] = torch.randint(0, V_STAT, (n,), generator=gen)  # any choice, duplicates included
        rows.append(lc[tokens[:, i]])
        qrows.append(qc[tokens[:, i]])
    logits = torch.stack(rows, 1).reshape(n * size, V_STAT)
    draft = torch.stack(qrows, 1).reshape(n * size, V_STAT) if stochastic else None
    parents = torch.tensor(SHAPE, dtype=torch.int32).repeat(n)
    offsets = (torch.arange(n + 1) * size).to(torch.int32)
    p = params(n, temp, top_k, top_p, seed * n)
    with _backend.use_backend("torch"):
        r = verify_tree(logits, tokens.reshape(-1).to(torch.int32), parents, offsets, p, rule=rule_of(draft),
                        draft_probs=draft, max_depth=2)  # fmt: skip
        y1 = r.output_tokens[:, 0].long()
        more, _ = sample(lc[y1], p._replace(offset=p.offset + 1))
    assert not r.invalid.any()
    y2 = torch.where(r.num_accepted == 0, more.long(), r.output_tokens[:, 1].long())
    return y1 * V_STAT + y2


@pytest.mark.parametrize(
    "temp, top_k, top_p, stochastic",
    [
        (1.0, 0, 1.0, True),
        (0.7, 5, 1.0, True),
        (1.2, 0, 0.8, True),
        (1.0, 0, 1.0, False),
        (1.3, 5, 0.9, False),
    ],
)
def test_joint_of_first_two_tokens_is_the_target(temp, top_k, top_p, stochastic):
    assert_joint_is_exact(tree_joint(temp, top_k, top_p, stochastic, seed=23), 23, temp, top_k, top_p)


# ----------------------------------------------------------------------------- Triton == PyTorch, token for token


@pytest.mark.parametrize("stochastic", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_matches_reference(stochastic, dtype):
    sizes = [7, 1, 5, 9, 4]
    vocab = 45
    logits, tokens, parents, offsets, q = random_trees(sizes, vocab, dtype=dtype)
    tokens[3] = logits[int(parents[3])].float().argmax()  # some children likely accepted
    tokens[14] = -1  # and some ids that must never be used as an index
    tokens[20] = vocab
    if not stochastic:
        tokens[2] = tokens[1]  # duplicate siblings
    q = q.to(DEVICE) if stochastic else None
    p = SamplingParams.make(
        5, temperature=[1.0, 0.0, 0.7, 1.4, 0.0], top_k=[0, 0, 6, 0, 0], top_p=[1.0, 1.0, 1.0, 0.8, 1.0],
        seed=[3, 1, 4, 1, 5], offset=torch.arange(5), device=DEVICE,
    )  # fmt: skip
    args = [t.to(DEVICE) for t in (logits, tokens, parents, offsets)]
    for rep in range(2):
        poison = TreeVerifyResult(
            torch.full((5, 6), -7, dtype=torch.int32, device=DEVICE),
            torch.full((5,), -7, dtype=torch.int32, device=DEVICE),
            torch.full((5, 6), -7, dtype=torch.int32, device=DEVICE),
            torch.ones(5, dtype=torch.bool, device=DEVICE),
        )
        p_rep = p._replace(offset=p.offset + rep)
        fast = run("triton", *args, p_rep, rule=rule_of(q), draft_probs=q, max_depth=5, out=poison)
        ref = run("torch", *args, p_rep, rule=rule_of(q), draft_probs=q, max_depth=5)
        assert fast is poison
        assert_same(fast, ref)
        check_structure(ref, tokens, parents, offsets, vocab)


@pytest.mark.gpu
@pytest.mark.parametrize("stochastic", [True, False])
def test_triton_matches_reference_bf16_large_vocab(stochastic):
    logits, tokens, parents, offsets, q = random_trees([64, 17, 33, 64], 128256, dtype=torch.bfloat16)
    args = [t.cuda() for t in (logits, tokens, parents, offsets)] + [params(4, 0.9, 40, 0.95, device="cuda")]
    kwargs = dict(rule="stochastic" if stochastic else "deterministic", draft_probs=q.cuda() if stochastic else None)
    assert_same(run("triton", *args, max_depth=63, **kwargs), run("torch", *args, max_depth=63, **kwargs))


# ----------------------------------------------------------------------------- invariants and edge cases


def test_draft_equal_to_target_accepts_the_first_child(backend, device):
    vocab, n = 30, 6
    logits = torch.randn(3 * n, vocab)
    p = exact_probs(logits, 0.9)
    parents = torch.tensor([-1, 0, 0] * n, dtype=torch.int32)
    tokens = torch.zeros(3 * n, dtype=torch.int32)
    tokens[1::3] = torch.multinomial(p[0::3], 1)[:, 0].to(torch.int32)
    tokens[2::3] = torch.multinomial(p[0::3], 1)[:, 0].to(torch.int32)
    offsets = (torch.arange(n + 1) * 3).to(torch.int32)
    for rep in range(3):
        r = verify_tree(logits.to(device), tokens.to(device), parents.to(device), offsets.to(device),
                        params(n, 0.9, offset=rep, device=device), rule="stochastic",
                        draft_probs=p.to(device))  # fmt: skip
        assert r.accepted_path[:, 1].tolist() == [1] * n
        check_structure(r, tokens, parents, offsets, vocab)


def test_deterministic_rule_never_accepts_a_rejected_sibling_twice(backend, device):
    vocab, n = 12, 24
    logits = torch.randn(3 * n, vocab)
    parents = torch.tensor([-1, 0, 0] * n, dtype=torch.int32)
    tokens = torch.randint(0, vocab, (3 * n,), dtype=torch.int32)
    tokens[2::3] = tokens[1::3]  # both children carry the same token
    offsets = (torch.arange(n + 1) * 3).to(torch.int32)
    r = verify_tree(logits.to(device), tokens.to(device), parents.to(device), offsets.to(device),
                    params(n, device=device), rule="deterministic")  # fmt: skip
    assert (r.accepted_path[:, 1] != 2).all()
    rejected = r.num_accepted.cpu() == 0
    assert (r.output_tokens[rejected, 0].cpu() != tokens[1::3][rejected]).all()  # excluded from the final sample


def test_greedy_follows_the_first_child_equal_to_argmax(backend, device):
    vocab = 20
    logits = torch.randn(5, vocab) * 4
    parents = torch.tensor([-1, 0, 0, 0, 2], dtype=torch.int32)
    top = logits.argmax(-1)
    tokens = torch.tensor([0, (top[0] + 1) % vocab, top[0], top[0], top[2]], dtype=torch.int32)
    offsets = torch.tensor([0, 5], dtype=torch.int32)
    args = (t.to(device) for t in (logits, tokens, parents, offsets))
    r = verify_tree(*args, params(1, 0.0, device=device), rule="deterministic")
    assert r.accepted_path[0].tolist() == [0, 2, 4]
    assert r.output_tokens[0].tolist() == [int(top[0]), int(top[2]), int(top[4])]


def test_children_outside_the_vocabulary_are_rejected(backend, device):
    vocab, n = 16, 5
    logits = torch.randn(3 * n, vocab)
    parents = torch.tensor([-1, 0, 0] * n, dtype=torch.int32)
    tokens = torch.tensor([0, -1, vocab] * n, dtype=torch.int32)
    offsets = (torch.arange(n + 1) * 3).to(torch.int32)
    q = torch.softmax(torch.randn(3 * n, vocab), -1)
    for draft in (q.to(device), None):
        r = verify_tree(logits.to(device), tokens.to(device), parents.to(device), offsets.to(device),
                        params(n, device=device), rule=rule_of(draft), draft_probs=draft)  # fmt: skip
        assert (r.num_accepted == 0).all() and not r.invalid.any()
        assert ((r.output_tokens[:, 0] >= 0) & (r.output_tokens[:, 0] < vocab)).all()


def test_invalid_rows_are_flagged(backend, device):
    logits, tokens, parents, offsets, q = random_trees([4, 3], 20)
    logits[5, 2] = float("nan")  # a row of the second tree
    r = verify_tree(*(t.to(device) for t in (logits, tokens, parents, offsets)), params(2, device=device),
                    rule="stochastic", draft_probs=q.to(device))  # fmt: skip
    assert r.invalid.tolist() == [False, True]
    assert r.output_tokens[1].tolist() == [-1] * r.output_tokens.shape[1]
    assert r.accepted_path[1, 0] == 0 and (r.accepted_path[1, 1:] == -1).all()
    check_structure(r, tokens, parents, offsets, 20)


def test_max_depth_truncates_the_tree(backend, device):
    vocab, n = 10, 8
    logits = torch.randn(4 * n, vocab)
    q = exact_probs(logits)  # draft = target: everything reachable is accepted
    parents = torch.tensor([-1, 0, 1, 2] * n, dtype=torch.int32)
    tokens = torch.zeros(4 * n, dtype=torch.int32)
    for i in (1, 2, 3):
        tokens[i::4] = torch.multinomial(q[i - 1 :: 4], 1)[:, 0].to(torch.int32)
    offsets = (torch.arange(n + 1) * 4).to(torch.int32)
    args = (t.to(device) for t in (logits, tokens, parents, offsets))
    r = verify_tree(*args, params(n, device=device), rule="stochastic", draft_probs=q.to(device), max_depth=2)
    assert r.accepted_path.shape == (n, 3)
    assert r.num_accepted.tolist() == [2] * n
    check_structure(r, tokens, parents, offsets, vocab)


def test_seeds_are_batch_and_order_invariant(backend, device):
    sizes = [5, 3, 6]
    logits, tokens, parents, offsets, q = random_trees(sizes, 25)
    p = params(3, 0.9, 0, 1.0, seed0=50, device=device)
    full = verify_tree(*(t.to(device) for t in (logits, tokens, parents, offsets)), p, rule="stochastic",
                       draft_probs=q.to(device), max_depth=5)  # fmt: skip
    lo, hi = int(offsets[1]), int(offsets[2])
    alone = verify_tree(
        *(t[lo:hi].to(device) for t in (logits, tokens, parents)),
        torch.tensor([0, hi - lo], dtype=torch.int32, device=device), p.select(torch.tensor([1], device=device)),
        rule="stochastic", draft_probs=q[lo:hi].to(device), max_depth=5,
    )  # fmt: skip
    for a, b in zip(alone, full):
        assert torch.equal(a[0].cpu(), b[1].cpu())


# ----------------------------------------------------------------------------- input validation


def test_bad_inputs():
    logits, tokens, parents, offsets, q = random_trees([3, 2], 10)
    p = params(2)
    names = ["target_logits", "node_tokens", "parents", "node_offsets", "params"]
    ok = dict(zip(names, (logits, tokens, parents, offsets, p)))

    def call(rule="stochastic", draft_probs=q, **change):
        return verify_tree(*[{**ok, **change}[n] for n in names], rule=rule, draft_probs=draft_probs)

    with pytest.raises(TypeError, match="parents"):
        call(parents=parents.long())
    with pytest.raises(TypeError, match="node_tokens"):
        call(node_tokens=tokens.float())
    with pytest.raises(TypeError, match="params.top_p"):
        call(params=p._replace(top_p=p.top_p.half()))
    with pytest.raises(TypeError, match="params.offset"):
        call(params=p._replace(offset=p.offset.float()))
    with pytest.raises(ValueError, match="node_tokens must have shape"):
        call(node_tokens=tokens[:-1])
    with pytest.raises(ValueError, match="draft_probs has vocabulary 12"):
        call(draft_probs=torch.rand(5, 12))
    with pytest.raises(ValueError, match="draft_probs must have 5 rows"):
        call(draft_probs=torch.rand(4, 10))
    with pytest.raises(ValueError, match="root of tree 1"):
        call(parents=torch.tensor([-1, 0, 0, 0, 0], dtype=torch.int32))
    with pytest.raises(ValueError, match="parents come first"):
        call(parents=torch.tensor([-1, 2, 0, -1, 0], dtype=torch.int32))
    with pytest.raises(ValueError, match="node_offsets\\[-1\\] must equal"):
        call(node_offsets=torch.tensor([0, 3, 4], dtype=torch.int32))
    with pytest.raises(ValueError, match="params.temperature must have shape"):
        call(params=p._replace(temperature=torch.ones(3)))
    with pytest.raises(ValueError, match="rule='stochastic' needs draft_probs"):
        call(draft_probs=None)
    with pytest.raises(ValueError, match="rule='deterministic' takes no draft_probs"):
        call(rule="deterministic")
    with pytest.raises(ValueError, match="max_depth"):
        verify_tree(*ok.values(), rule="stochastic", draft_probs=q, max_depth=-2)
    bad_out = TreeVerifyResult(torch.empty(2, 3, dtype=torch.int32), torch.empty(2, dtype=torch.int32),
                               torch.empty(2, 2, dtype=torch.int32), torch.empty(2, dtype=torch.bool))  # fmt: skip
    with pytest.raises(ValueError, match="out.accepted_path must have shape"):
        verify_tree(*ok.values(), rule="stochastic", draft_probs=q, max_depth=2, out=bad_out)
    swapped = TreeVerifyResult(bad_out.output_tokens, bad_out.output_tokens.clone(), bad_out.num_accepted,
                               bad_out.invalid)  # fmt: skip
    with pytest.raises(ValueError, match="out.num_accepted must have 1 dimensions"):  # fields go in result order
        verify_tree(*ok.values(), rule="stochastic", draft_probs=q, max_depth=2, out=swapped)


# ----------------------------------------------------------------------------- sample, then compare


@pytest.mark.parametrize("temp, top_k, top_p", [(1.0, 0, 1.0), (0.7, 5, 0.9), (0.0, 0, 1.0)])
def test_deterministic_rule_emits_plain_samplings_tokens(backend, device, temp, top_k, top_p):
    # Each emitted token is what `sample` draws at that node's row and position, whatever the tree;
    # children copy their parent's draw half the time, so paths go deep.
    sizes, vocab = [7, 1, 5, 9, 4, 6], 24
    logits, tokens, parents, offsets, _ = random_trees(sizes, vocab, scale=2.0)
    batch = len(sizes)
    seeds, starts = torch.randint(0, 2**40, (batch,)), torch.randint(0, 1000, (batch,))
    p = SamplingParams.make(batch, temperature=temp, top_k=top_k, top_p=top_p, seed=seeds, offset=starts,
                            device=device)  # fmt: skip
    depth = torch.zeros(len(parents), dtype=torch.long)
    row_req = torch.repeat_interleave(torch.arange(batch), torch.tensor(sizes))
    for i in range(len(parents)):
        if parents[i] >= 0:
            depth[i] = depth[i - (i - int(offsets[row_req[i]])) + int(parents[i])] + 1
    per_row = SamplingParams.make(len(parents), temperature=temp, top_k=top_k, top_p=top_p, seed=seeds[row_req],
                                  offset=starts[row_req] + depth, device=device)  # fmt: skip
    drawn = sample(logits.to(device), per_row).tokens.cpu()  # (this backend's sampler)
    copy = torch.rand(len(parents)) < 0.5
    for i in range(len(parents)):
        if parents[i] >= 0 and copy[i]:
            tokens[i] = drawn[i - (i - int(offsets[row_req[i]])) + int(parents[i])]
    r = verify_tree(*(t.to(device) for t in (logits, tokens, parents, offsets)), p, rule="deterministic")
    check_structure(r, tokens, parents, offsets, vocab)
    out, accepted, path = r.output_tokens.cpu(), r.num_accepted.cpu(), r.accepted_path.cpu()
    for b in range(batch):
        for i in range(int(accepted[b]) + 1):
            row = int(offsets[b]) + int(path[b, i])
            assert int(depth[row]) == i
            assert int(out[b, i]) == int(drawn[row]), (b, i)
    assert int(accepted.sum()) >= 3  # the copied children were accepted
