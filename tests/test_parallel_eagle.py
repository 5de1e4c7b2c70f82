"""The parallel EAGLE head and its strategy: mask rows, loading, chains and best-first trees from one head forward.

Random heads (far from the target) check shapes and exactness; the shipped head checks that one forward's trees
accept more than its chain. Every output must be the target's own: greedy equality, sampled exactness by total
variation.
"""

import json
import math
import shutil

import pytest
import torch
from helpers import random_eagle_head, random_model, tiny_config
from safetensors.torch import load_file, save_file
from sampling_helpers import model_joint

from specdec.decoding import NoDraft, ParallelEagleStrategy, SpeculativeDecoder
from specdec.model import EagleHead, ParallelEagleHead
from specdec.model.parallel_eagle import MASK
from specdec.testing import ASSETS, heldout_token_ids, load_pair

pytestmark = pytest.mark.usefixtures("torch_backend")

SHIPPED = ASSETS.parent / "parallel_eagle"
SHAPES = {
    "chain": dict(),
    "chain K=3 argmax": dict(depth=3, rule="deterministic"),
    "chain stochastic": dict(rule="stochastic"),
    "tree 16": dict(max_nodes=16),
    "tree 5 depth 3": dict(max_nodes=5, depth=3),
}


@pytest.fixture(scope="module")
def embedded():
    target, _, tokenizer = load_pair()
    return target, ParallelEagleHead.from_pretrained(SHIPPED, target), heldout_token_ids(tokenizer)[:3]


@pytest.fixture(scope="module")
def tiny():
    target = random_model(tiny_config(), seed=0)
    return target, random_eagle_head(target, seed=3, block_size=4)


def test_mask_rows_take_the_learned_input_and_real_rows_the_eagle_heads():
    target = random_model(tiny_config(), seed=0)
    head = random_eagle_head(target, seed=3, block_size=4)
    plain = EagleHead(head.config, target)
    plain.load_state_dict({k: v for k, v in head.state_dict().items() if k != "mask_input"})
    features = torch.randn(5, head.config.hidden_size)
    tokens = torch.tensor([3, MASK, 7, MASK, 0])
    x = head.layer_inputs(features, tokens)
    torch.testing.assert_close(x[[1, 3]], head.mask_input.expand(2, -1))
    torch.testing.assert_close(x[[0, 2, 4]], plain.layer_inputs(features[[0, 2, 4]], tokens[[0, 2, 4]]))


# ---- loading ------------------------------------------------------------------------------------------


def test_the_shipped_head_loads_and_its_trees_accept_more_than_its_chain(embedded):
    target, head, prompts = embedded
    assert head.block_size == 8 and head.lm_head_weight is target.lm_head_weight
    expected = SpeculativeDecoder(target, NoDraft()).generate(prompts, max_new_tokens=48, eos_token_id=None).tokens
    taus = []
    for strategy in (ParallelEagleStrategy(head, depth=5), ParallelEagleStrategy(head, max_nodes=16)):
        result = SpeculativeDecoder(target, strategy, adaptive=False).generate(
            prompts, max_new_tokens=48, eos_token_id=None
        )
        assert result.tokens == expected
        taus.append(sum(s.generated for s in result.stats) / sum(s.target_forwards for s in result.stats))
    assert taus[0] > 2.2, f"the trained head's chain accepts little: tau {taus[0]:.2f}"
    assert taus[1] > taus[0], f"best-first trees do not beat the chain: tau {taus}"


def copy_checkpoint(tmp_path, **config_changes):
    shutil.copytree(SHIPPED, tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(config_changes)
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    return tmp_path


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(parallel_block_size=None), "config.json has no 'parallel_block_size'"),
        (dict(parallel_block_size=1), "'parallel_block_size' must be an int >= 2, got 1"),
        (dict(parallel_block_size="8"), "'parallel_block_size' must be an int >= 2"),
        (dict(hidden_size=128), "its hidden_size is 128, the target's is 256"),
    ],
)
def test_bad_configs_are_refused_by_name(tmp_path, embedded, change, message):
    with pytest.raises(ValueError, match=message):
        ParallelEagleHead.from_pretrained(copy_checkpoint(tmp_path, **change), embedded[0])


def test_a_plain_head_and_a_parallel_head_are_told_apart(tmp_path, embedded):
    target = embedded[0]
    with pytest.raises(ValueError, match="a parallel EAGLE head, which loads with ParallelEagleHead"):
        EagleHead.from_pretrained(SHIPPED, target)
    with pytest.raises(ValueError, match="no 'parallel_block_size'"):
        ParallelEagleHead.from_pretrained(ASSETS.parent / "eagle", target)
    copy_checkpoint(tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["mask_input"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="lacks tensor 'mask_input'"):
        ParallelEagleHead.from_pretrained(tmp_path, target)


# ---- the strategy ------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", list(SHAPES))
def test_greedy_output_is_the_targets_greedy_output(embedded, shape):
    target, head, prompts = embedded
    expected = SpeculativeDecoder(target, NoDraft()).generate(prompts, max_new_tokens=32).tokens
    for adaptive in (True, False):
        decoder = SpeculativeDecoder(target, ParallelEagleStrategy(head, **SHAPES[shape]), adaptive=adaptive,
                                     cache_layout="paged", block_size=4)  # fmt: skip
        result = decoder.generate(prompts, max_new_tokens=32)
        assert result.tokens == expected, f"adaptive={adaptive}"
        assert sum(s.accepted for s in result.stats) > 0


def test_a_draft_vocabulary_is_honoured(embedded):
    target, _, prompts = embedded
    head = ParallelEagleHead.from_pretrained(SHIPPED, target).set_draft_vocabulary(range(1024))
    strategy = ParallelEagleStrategy(head, max_nodes=12)
    drafted, propose = [], strategy.propose

    def recorded(step):
        proposal = propose(step)
        roots = {sum(proposal.counts[:r]) for r in range(len(proposal.counts))}
        drafted.extend(t for i, t in enumerate(proposal.tokens.tolist()) if i not in roots)
        return proposal

    strategy.propose = recorded
    expected = SpeculativeDecoder(target, NoDraft()).generate(prompts, max_new_tokens=32).tokens
    assert SpeculativeDecoder(target, strategy).generate(prompts, max_new_tokens=32).tokens == expected
    assert drafted and max(drafted) < 1024


@pytest.mark.parametrize("shape", ["chain", "tree 16"])
def test_the_head_cache_keeps_committed_rows_only(tiny, shape):
    """After every step's forward the mask rows are gone: each running slot's head cache holds the rows of its
    history but the last token (whose feature the target has not computed yet)."""
    target, head = tiny
    strategy = ParallelEagleStrategy(head, **SHAPES[shape])
    seen, propose = [], strategy.propose

    def checked(step):
        proposal = propose(step)
        lengths = strategy.cache.seq_lens.tolist()
        seen.append([lengths[b] == len(h) - 1 for b, h in zip(step.running, step.histories)])
        return proposal

    strategy.propose = checked
    SpeculativeDecoder(target, strategy, adaptive=False).generate([[1, 2, 3], [4, 5, 6, 7, 8]], max_new_tokens=24)
    assert len(seen) > 3 and all(all(s) for s in seen)


class ForwardRecorder:
    """Records the rows of every head forward."""

    def __init__(self, head):
        self.rows, self._forward = [], head.forward
        head.forward = self

    def __call__(self, features, tokens, *args, **kwargs):
        self.rows.append((tokens == MASK).sum().item())
        return self._forward(features, tokens, *args, **kwargs)


def test_a_step_costs_one_head_forward_with_depth_minus_one_mask_rows_per_request():
    target = random_model(tiny_config(), seed=0)
    head = random_eagle_head(target, seed=3, block_size=6)
    recorder = ForwardRecorder(head)
    result = SpeculativeDecoder(target, ParallelEagleStrategy(head, depth=4, max_nodes=9), adaptive=False).generate(
        [[1, 2, 3], [4, 5, 6, 7]], max_new_tokens=10, eos_token_id=None
    )
    steps = max(s.target_forwards for s in result.stats) - 1  # the prefill's forward drafts nothing
    join, *per_step = recorder.rows
    assert join == 0 and len(per_step) == steps  # one head forward a step
    assert per_step[0] == 2 * 3  # two requests, depth 4: three mask rows each


def test_per_request_limits_shape_each_tree(tiny):
    target, head = tiny
    strategy = ParallelEagleStrategy(head, max_nodes=12, depth=4)
    assert [strategy.draft_nodes(d) for d in (0, 1, 2, 3, 4, 9)] == [1, 4, 7, 10, 12, 12]
    seen, propose = [], strategy.propose

    def recorded(step):
        proposal = propose(step)
        seen.append((proposal.counts, proposal.depths, list(step.max_depth), list(step.max_nodes)))
        return proposal

    strategy.propose = recorded
    engine = SpeculativeDecoder(target, strategy, adaptive=False).engine(max_batch=3, max_len=64)
    for p, new in zip([[1, 2, 3], [4, 5, 6, 7], [8, 9]], (9, 14, 20)):
        engine.add_request(p, max_new_tokens=new)
    while engine.has_unfinished():
        engine.step()
    for counts, depths, limits, nodes in seen:
        for count, depth, limit, most in zip(counts, depths, limits, nodes):
            assert count == min(most, strategy.draft_nodes(limit)) and depth <= max(limit, 0)
    assert any(len(set(counts)) > 1 for counts, *_ in seen), "no ragged step"
    chain = ParallelEagleStrategy(head, depth=3)
    assert [chain.draft_nodes(d) for d in (0, 1, 3, 7)] == [1, 2, 4, 4]
    assert (chain.max_nodes, chain.max_depth, strategy.max_nodes, strategy.max_depth) == (4, 3, 12, 4)


@pytest.mark.parametrize("vocabulary", [None, (0, 2, 3)], ids=["whole-vocabulary", "draft-vocabulary"])
@pytest.mark.parametrize("shape", ["chain", "chain stochastic", "tree 5 depth 3"])
def test_first_tokens_follow_the_exact_model_joint(shape, vocabulary):
    # The first token comes from the prefill; the next three from a drafted chain or tree of depth 2 and after it.
    # With a draft vocabulary of 3 of the 4 tokens, token 1 is never drafted, yet emitted as often as the target says.
    vocab, steps, draws, temperature, top_p = 4, 4, 20000, 1.0, 0.9
    target = random_model(tiny_config(vocab_size=vocab, num_layers=1), seed=5, scale=1.5)
    head = random_eagle_head(target, seed=6, block_size=3).set_draft_vocabulary(vocabulary)
    strategy = ParallelEagleStrategy(head, **{**SHAPES[shape], "depth": 2})
    prompt = [1, 2, 3]
    result = SpeculativeDecoder(target, strategy).generate(
        [prompt] * draws, max_new_tokens=steps, temperature=temperature, top_p=top_p, seed=1000, eos_token_id=None
    )
    index = torch.tensor([sum(t * vocab ** (steps - 1 - i) for i, t in enumerate(toks)) for toks in result.tokens])
    empirical = torch.bincount(index, minlength=vocab**steps).double() / draws
    exact = model_joint(target, prompt, steps, temperature, 0, top_p)
    expected_tvd = 0.5 * math.sqrt(2 * (int((exact > 0).sum()) - 1) / (math.pi * draws))
    assert 0.5 * (empirical - exact).abs().sum().item() < 2.5 * expected_tvd
    assert (empirical[exact == 0] == 0).all(), "a filtered-out sequence was emitted"
    hotter = model_joint(target, prompt, steps, temperature * 1.3, 0, top_p)
    assert 0.5 * (empirical - hotter).abs().sum().item() > 2.5 * expected_tvd, "the test cannot tell T=1 from T=1.3"
    assert sum(s.accepted for s in result.stats) > 0 and sum(s.drafted for s in result.stats) >= 2 * draws
    if vocabulary is not None:
        assert any(1 in toks[1:] for toks in result.tokens), "token 1, outside the draft vocabulary, is still emitted"


def test_bad_arguments_are_refused_by_name(tiny):
    target, head = tiny
    with pytest.raises(TypeError, match="head must be a ParallelEagleHead"):
        ParallelEagleStrategy(random_eagle_head(target, seed=3))
    with pytest.raises(ValueError, match=r"depth must be an int in \[1, 4\]"):
        ParallelEagleStrategy(head, depth=5)
    with pytest.raises(ValueError, match="max_nodes must be None"):
        ParallelEagleStrategy(head, max_nodes=1)
    with pytest.raises(ValueError, match="trees from a parallel EAGLE head are verified by the deterministic rule"):
        ParallelEagleStrategy(head, max_nodes=8, rule="coupled")
    with pytest.raises(ValueError, match="rule must be one of"):
        ParallelEagleStrategy(head, rule="greedy")
    with pytest.raises(ValueError, match="confidence_temperature must be a positive number"):
        ParallelEagleStrategy(head, max_nodes=8, confidence_temperature=0.0)
    with pytest.raises(ValueError, match="block_size must be an int >= 2"):
        ParallelEagleHead(head.config, target, block_size=1)
    other = random_model(tiny_config(), seed=1)
    with pytest.raises(ValueError, match="head was built for another target"):
        SpeculativeDecoder(other, ParallelEagleStrategy(head))
