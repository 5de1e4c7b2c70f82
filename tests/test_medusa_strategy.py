"""Medusa drafting (specdec.decoding.medusa) through the engine: greedy equals the target's greedy, sampling
follows the target's distribution exactly, per-request limits and seeds hold, bad input is refused by name."""

import itertools
import json

import pytest
import torch
from helpers import forward_prompts, random_heads, random_model, random_prompts, tiny_config
from sampling_helpers import model_joint, tv_bound, tv_distance

from specdec import testing
from specdec.decoding import Prefill, SpeculativeDecoder, StepContext, StepResult
from specdec.decoding.autoregressive import generate as autoregressive_generate
from specdec.decoding.medusa import MedusaStrategy, presets
from specdec.kernels.sampling_params import SamplingParams
from specdec.model import MedusaHeads

pytestmark = pytest.mark.usefixtures("torch_backend")

CHOICES = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
# Every path over the heads' top 4, to depth 3: 85 nodes (two mask words), deep acceptance on an 8-token target.
WIDE = [list(p) for depth in (1, 2, 3) for p in itertools.product(range(4), repeat=depth)]


@pytest.fixture(scope="module")
def tiny():
    """A target over 8 tokens (random guesses are often right, so every depth gets accepted) and its heads."""
    target = random_model(tiny_config(vocab_size=8), seed=0)
    return target, random_heads(target, seed=1)


# ---- greedy: the target's own tokens ----------------------------------------------------------------


@pytest.fixture(scope="module")
def embedded():
    target, _, tokenizer = testing.load_pair("cpu")
    prompts = testing.heldout_token_ids(tokenizer)[:8]
    return target, MedusaStrategy.from_pretrained(testing.ASSETS.parent / "medusa", target), prompts


@pytest.mark.parametrize("batch", [1, 8])
def test_greedy_equals_target_greedy_on_the_embedded_pair(embedded, batch):
    target, strategy, prompts = embedded
    groups = [[p] for p in prompts[:2]] if batch == 1 else [prompts]
    for group in groups:
        expected = autoregressive_generate(target, group, max_new_tokens=40, eos_token_id=None)
        result = SpeculativeDecoder(target, strategy, adaptive=False).generate(
            group, max_new_tokens=40, eos_token_id=None
        )
        assert result.tokens == expected
        assert all(s.tau > 1.5 for s in result.stats), [s.tau for s in result.stats]


def test_greedy_with_ragged_lengths_limits_and_eos(tiny):
    target, heads = tiny
    prompts = random_prompts([3, 1, 7, 2, 5], vocab=8, seed=0)
    limits = [30, 5, 1, 17, 0]
    strategy = MedusaStrategy(heads, WIDE, max_nodes=128)
    expected = autoregressive_generate(target, prompts, max_new_tokens=limits, eos_token_id=None)
    result = SpeculativeDecoder(target, strategy, adaptive=False).generate(
        prompts, max_new_tokens=limits, eos_token_id=None
    )
    assert result.tokens == expected
    accepted_at = [sum(s.accepted_at[j] for s in result.stats if len(s.accepted_at) > j) for j in range(3)]
    assert all(a > 0 for a in accepted_at), accepted_at  # every depth accepted somewhere
    eos = expected[0][9]
    result = SpeculativeDecoder(target, strategy, adaptive=False).generate(
        prompts, max_new_tokens=limits, eos_token_id=eos
    )
    for tokens, full in zip(result.tokens, expected):
        assert tokens == (full[: full.index(eos) + 1] if eos in full else full)


# ---- sampling: exact, per request, reproducible ---------------------------------------------------------


def test_sampled_requests_are_reproducible_alone_and_in_any_batch(tiny):
    target, heads = tiny
    prompts = random_prompts([4, 2, 6, 3], vocab=8, seed=1)
    options = dict(
        max_new_tokens=[12, 9, 15, 12], temperature=[0.0, 0.7, 1.0, 1.3], top_k=[0, 3, 0, 5],
        top_p=[1.0, 1.0, 0.8, 1.0], eos_token_id=None,
    )  # fmt: skip
    seeds = [11, 22, 33, 44]

    def run(order):
        picked = {k: [v[i] for i in order] if isinstance(v, list) else v for k, v in options.items()}
        result = SpeculativeDecoder(target, MedusaStrategy(heads, CHOICES), adaptive=False).generate(
            [prompts[i] for i in order], seed=[seeds[i] for i in order], **picked
        )
        return {i: tokens for i, tokens in zip(order, result.tokens)}

    batch = run([0, 1, 2, 3])
    assert run([0, 1, 2, 3]) == batch
    assert run([2, 0, 3, 1]) == batch
    assert run([1]) == {1: batch[1]}
    greedy = autoregressive_generate(target, [prompts[0]], max_new_tokens=12, eos_token_id=None)
    assert batch[0] == greedy[0], "the greedy request of a mixed batch gets the target's greedy tokens"


def heads_guessing_marginals(target, prompt, joint) -> MedusaHeads:
    """Two heads that, on the hidden state of the prompt's last token, rank the target's second and third
    tokens by their marginal probabilities (``joint``: ``[V, V, V]``, the first three tokens): identity
    blocks and projections fitted to that one hidden state. Good guesses for no context in particular,
    so both depths are often accepted and often rejected."""
    _, hidden, _ = forward_prompts(target, [prompt])
    h = hidden[-1]
    heads = MedusaHeads(h.numel(), joint.shape[0], num_heads=2).requires_grad_(False)
    for k, marginal in enumerate((joint.sum((0, 2)), joint.sum((0, 1)))):
        heads.proj_weight[k] = torch.outer(marginal.float().clamp_min(1e-9).log(), h) / h.dot(h)
    return heads.eval()


def test_first_tokens_follow_the_exact_target_joint_at_temperature_1_top_k_20():
    """The joint of the first two tokens (the prefill's sample, then the first Medusa step's) and of the second
    and third (both from that step when depth 2 is accepted) are the target's, within the bound of the
    sample count; the joints of a 10% hotter target are rejected by the same bounds."""
    vocab, draws, top_k = 24, 16_000, 20
    target = random_model(tiny_config(vocab_size=vocab, num_layers=1), seed=5, scale=2.0)
    prompt = [1, 2, 3]
    joint = model_joint(target, prompt, 3, 1.0, top_k, 1.0).view(vocab, vocab, vocab)
    tree = [[0], [1], [2], [3], [0, 0], [0, 1], [0, 2], [0, 3], [1, 0], [1, 1], [1, 2], [1, 3]]
    strategy = MedusaStrategy(heads_guessing_marginals(target, prompt, joint), tree)
    result = SpeculativeDecoder(target, strategy).generate(
        [prompt] * draws, max_new_tokens=4, temperature=1.0, top_k=top_k, seed=1000, eos_token_id=None
    )
    tokens = torch.tensor(result.tokens)  # [draws, 4]; the first step drafts 2 deep (the last token: 1)
    drafted_at = [sum(s.drafted_at[j] for s in result.stats if len(s.drafted_at) > j) for j in range(2)]
    accepted_at = [sum(s.accepted_at[j] for s in result.stats if len(s.accepted_at) > j) for j in range(2)]
    for j in range(2):  # both depths accepted and rejected often
        assert 0.1 < accepted_at[j] / drafted_at[j] < 0.9, (drafted_at, accepted_at)
    for temperature in (1.0, 1.1):
        exact = joint if temperature == 1.0 else model_joint(target, prompt, 3, temperature, top_k, 1.0)
        exact = exact.view(vocab, vocab, vocab)
        for name, samples, expected in (
            ("first two", tokens[:, 0] * vocab + tokens[:, 1], exact.sum(2).flatten()),
            ("second and third", tokens[:, 1] * vocab + tokens[:, 2], exact.sum(0).flatten()),
        ):
            tvd, bound = tv_distance(samples, expected), tv_bound(expected, draws)
            assert (tvd < bound) == (temperature == 1.0), f"{name} at T={temperature}: TVD {tvd:.4f}, bound {bound:.4f}"
    assert (joint.sum(0).flatten()[tokens[:, 1] * vocab + tokens[:, 2]] > 0).all(), "a filtered-out token"


# ---- per-request limits -----------------------------------------------------------------------------


def test_trees_are_cut_to_each_requests_limits_and_carry_the_heads_candidates(tiny):
    target, heads = tiny
    strategy = MedusaStrategy(heads, CHOICES, top_k=3)
    rows, hidden_size = 4, target.config.hidden_size
    hidden = torch.randn(rows, hidden_size)
    strategy.prefill(Prefill([[1, 2]] * rows, 32, {}, torch.randn(2 * rows, hidden_size),
                              torch.arange(0, 9, 2, dtype=torch.int32)))  # fmt: skip
    # After a step where request r accepted r nodes of a 5-node chain: its last accepted node is row 5r + r.
    rows_hidden = torch.randn(5 * rows, hidden_size)
    for r in range(rows):
        rows_hidden[5 * r + r] = hidden[r]
    path = torch.tensor([[0, 1, 2, 3]] * rows, dtype=torch.int32)
    strategy.commit(StepResult(list(range(rows)), [8] * rows, [], [0, 1, 2, 3], path, rows_hidden,
                               torch.arange(0, 21, 5, dtype=torch.int32)))  # fmt: skip
    max_nodes, max_depth = [1, 3, 8, 8], [3, 3, 1, 3]
    step = StepContext(
        running=list(range(rows)), batch_size=rows, roots=[5, 6, 7, 0], previous=[1] * rows,
        histories=[[1, 2, 5], [1, 2, 6], [1, 2, 7], [1, 2, 0]], max_depth=max_depth, max_nodes=max_nodes,
        params=SamplingParams.make(rows), greedy=True, device=torch.device("cpu"),
    )  # fmt: skip
    proposal = strategy.propose(step)
    top = heads(hidden).topk(3, dim=-1).indices  # [K, R, 3]
    expected_paths = [[()], [(), (0,), (1,)], [(), (0,), (1,), (2,)], [(), *map(tuple, CHOICES)]]
    start = 0
    for r, paths in enumerate(expected_paths):
        tree = proposal.parents[r]
        assert [strategy.tree.paths[node] for node in strategy.tree.cut(max_depth[r], max_nodes[r])[1]] == paths
        assert len(tree) == len(paths) <= max_nodes[r]
        tokens = proposal.tokens[start : start + len(tree)].tolist()
        assert tokens == [step.roots[r]] + [top[len(p) - 1, r, p[-1]].item() for p in paths[1:]], f"request {r}"
        start += len(tree)
    assert proposal.rule == "deterministic"


# ---- bad input ----------------------------------------------------------------------------------------


def test_heads_for_another_target_are_refused(tiny, tmp_path):
    target, heads = tiny
    other = random_model(tiny_config(vocab_size=8, hidden_size=48, num_heads=3, head_dim=16), seed=2)
    with pytest.raises(ValueError, match=r"MedusaStrategy\(heads=...\) does not fit the target: its hidden_size is 32"):
        SpeculativeDecoder(other, MedusaStrategy(heads, CHOICES))
    heads.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="does not fit the target: its hidden_size is 32, the target's is 48"):
        MedusaStrategy.from_pretrained(tmp_path, other)
    with pytest.raises(ValueError, match=r"the Medusa heads must be on the target's dtype: theirs is torch.float64"):
        SpeculativeDecoder(target, MedusaStrategy(random_heads(target, 3).double(), CHOICES))


def test_a_pickle_checkpoint_is_refused(tiny, tmp_path):
    target, heads = tiny
    (tmp_path / "config.json").write_text(json.dumps({"medusa_num_heads": 3, "medusa_num_layers": 1}))
    torch.save(heads.state_dict(), tmp_path / "medusa_lm_head.pt")
    with pytest.raises(ValueError, match="holds only medusa_lm_head.pt, a pickle checkpoint"):
        MedusaStrategy.from_pretrained(tmp_path, target)


@pytest.mark.parametrize(
    "choices, options, error, match",
    [
        ([[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]], {}, ValueError, r"choices\[3\] = \[0, 0, 0, 0\] is 4 deep; at most 3"),
        ([[0], [1, 0]], {}, ValueError, r"choices\[1\] = \[1, 0\]: its prefix \[1\] is missing"),
        ([[0], [4]], {"top_k": 4}, ValueError, r"choices\[1\] = \[4\] takes candidate 4; top_k is 4"),
        ([[i] for i in range(8)], {"max_nodes": 8}, ValueError, "more than the budget of 8"),
        ("tree-5", {}, ValueError, r"choices 'tree-5' is not a preset; the presets are \['chain', 'default'"),
        ({0: [0]}, {}, TypeError, "choices must be a list of paths"),
        (CHOICES, {"top_k": 0}, ValueError, "top_k must be an int >= 1, got 0"),
        (CHOICES, {"max_nodes": 1}, ValueError, "max_nodes must be an int >= 2, got 1"),
        (CHOICES, {"max_nodes": 8.0}, ValueError, "max_nodes must be an int >= 2, got 8.0"),
    ],
)
def test_invalid_arguments_are_refused_by_name(tiny, choices, options, error, match):
    with pytest.raises(error, match=match):
        MedusaStrategy(tiny[1], choices, **options)


def test_heads_must_be_medusa_heads(tiny):
    with pytest.raises(TypeError, match="heads must be MedusaHeads, got LlamaModel"):
        MedusaStrategy(tiny[0])


def test_presets_and_the_default_tree(tiny):
    target, heads = tiny  # 3 heads: the default tree is cut to depth 3, the chain has 3 nodes
    named = presets()
    assert MedusaStrategy(heads, "chain").tree.choices() == [[0], [0, 0], [0, 0, 0]]
    default = MedusaStrategy(heads)
    assert default.tree.choices() == [p for p in named["default"] if len(p) <= 3]
    assert default.max_nodes <= 64 and default.max_depth == 3
    for n in (8, 12, 16, 24, 32, 64):
        assert len(named[f"tree-{n}"]) == n - 1
