"""The parallel draft model (PARD): loading, best-first trees, and its strategy's chains and trees.

Before the trained draft is used, the embedded pair's AR draft stands in as a parallel draft with
an in-vocabulary mask id: its drafts are poor, its shapes right, and every output must still be the
target's own (greedy equality, sampled exactness by total variation).
"""

import heapq
import json
import shutil

import pytest
import torch
from helpers import noisy_copy, random_model, tiny_config
from safetensors.torch import load_file, save_file
from sampling_helpers import assert_sequences_follow, model_joint

from specdec.decoding import NoDraft, ParallelDraftStrategy, SpeculativeDecoder
from specdec.decoding.block_trees import best_first_trees
from specdec.model import ParallelDraft
from specdec.testing import ASSETS, heldout_token_ids, load_pair, pair_dirs

pytestmark = pytest.mark.usefixtures("torch_backend")

PARALLEL_DIR = ASSETS.parent / "parallel"


@pytest.fixture(scope="module")
def pair():
    target, draft, tokenizer = load_pair()
    stand_in = ParallelDraft(draft, mask_token=5, block_size=6, vocab_size=target.config.vocab_size)
    return target, stand_in, heldout_token_ids(tokenizer)[:3]


# ---- best-first trees ---------------------------------------------------------------------------------


def brute_force_paths(log_probs: torch.Tensor, depth: int, keep: int) -> set[tuple[int, ...]]:
    """The ``keep`` most probable token paths of 1..depth tokens (every path enumerated, host)."""
    vocab = log_probs.shape[-1]
    heap = [(-log_probs[0, t].item(), (t,)) for t in range(vocab)]
    heapq.heapify(heap)
    chosen = set()
    while len(chosen) < keep:
        score, path = heapq.heappop(heap)
        chosen.add(path)
        if len(path) < depth:
            for t in range(vocab):
                heapq.heappush(heap, (score - log_probs[len(path), t].item(), path + (t,)))
    return chosen


def tree_paths(tokens: list[int], parents: list[int], count: int) -> set[tuple[int, ...]]:
    paths = {0: ()}
    for i in range(1, count):
        paths[i] = paths[parents[i]] + (tokens[i],)
    return {paths[i] for i in range(1, count)}


@pytest.mark.parametrize("seed", range(4))
def test_best_first_trees_keep_the_most_probable_paths(seed):
    gen = torch.Generator().manual_seed(seed)
    rows, levels, vocab, width = 3, 4, 6, 12
    log_probs = torch.log_softmax(2 * torch.randn(rows, levels, vocab, generator=gen), dim=-1)
    max_depth, keep = torch.tensor([4, 2, 3]), torch.tensor([11, 7, 4])
    tokens, parents = best_first_trees(log_probs, torch.tensor([9, 8, 7]), max_depth, keep, width)
    for r in range(rows):
        n = 1 + int(keep[r])
        assert tokens[r, 0] == 9 - r and parents[r, 0] == -1
        assert all(0 <= parents[r, i] < i for i in range(1, n)), "not topological"
        got = tree_paths(tokens[r].tolist(), parents[r].tolist(), n)
        assert got == brute_force_paths(log_probs[r], int(max_depth[r]), int(keep[r]))


# ---- loading ------------------------------------------------------------------------------------------


def write_parallel_checkpoint(path, *, drop=(), **config_changes):
    """The embedded AR draft as a parallel-draft checkpoint: one mask row appended (id 4096), tokenizer copied."""
    _, draft_dir = pair_dirs()
    path.mkdir()
    tensors = load_file(str(draft_dir / "model.safetensors"))
    embed = tensors["model.embed_tokens.weight"]
    tensors["model.embed_tokens.weight"] = torch.cat((embed, embed.mean(0, keepdim=True)))
    save_file(tensors, str(path / "model.safetensors"))
    config = json.loads((draft_dir / "config.json").read_text())
    config.update(vocab_size=config["vocab_size"] + 1, pard_token=config["vocab_size"], pard_block_size=8)
    config.update(config_changes)
    for key in drop:
        del config[key]
    (path / "config.json").write_text(json.dumps(config))
    shutil.copy(draft_dir / "tokenizer.json", path / "tokenizer.json")
    return path


def test_a_checkpoint_with_a_mask_row_loads_and_drafts_target_tokens_only(tmp_path, pair):
    target = pair[0]
    path = write_parallel_checkpoint(tmp_path / "pard")
    draft = ParallelDraft.from_pretrained(path, target, target_path=pair_dirs()[0])
    assert (draft.mask_token, draft.block_size, draft.vocab_size) == (4096, 8, 4096)
    assert draft.model.config.vocab_size == 4097
    logits = torch.randn(2, 3, 4097)
    assert torch.equal(draft.target_logits(logits), logits[..., :4096])
    inside = ParallelDraft(draft.model, mask_token=7, block_size=4, vocab_size=4097)  # a mask id inside the vocabulary
    masked = inside.target_logits(logits)
    assert masked.shape == logits.shape and masked[..., 7].eq(float("-inf")).all()
    assert torch.equal(masked[..., 8:], logits[..., 8:])


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(drop=("pard_token",)), "has no 'pard_token'"),
        (dict(drop=("pard_block_size",)), "has no 'pard_block_size'"),
        (dict(pard_block_size=1), "pard_block_size"),
        (dict(pard_token=5000), "pard_token must be a token id"),
        (dict(pard_token=12), "cannot draft for a target of 4096 tokens"),
        (dict(pard_token="4096"), "pard_token"),
    ],
)
def test_bad_parallel_draft_configs_are_refused_by_name(tmp_path, pair, change, message):
    path = write_parallel_checkpoint(tmp_path / "pard", **change)
    with pytest.raises((ValueError, TypeError), match=message):
        ParallelDraft.from_pretrained(path, pair[0])


def test_another_targets_draft_is_refused(tmp_path, pair):
    path = write_parallel_checkpoint(tmp_path / "pard")
    other = random_model(tiny_config(vocab_size=300), seed=0)
    with pytest.raises(ValueError, match="cannot draft for a target of 300 tokens"):
        ParallelDraft.from_pretrained(path, other)
    tokenizer = json.loads((path / "tokenizer.json").read_text())
    first, second = list(tokenizer["model"]["vocab"])[:2]
    vocab = tokenizer["model"]["vocab"]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (path / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ValueError, match="token-to-id maps are not the same"):
        ParallelDraft.from_pretrained(path, pair[0], target_path=pair_dirs()[0])
    ParallelDraft.from_pretrained(path, pair[0])  # no target path: no tokenizer to compare


def test_a_pickle_checkpoint_is_refused(tmp_path, pair):
    path = write_parallel_checkpoint(tmp_path / "pard")
    (path / "model.safetensors").rename(path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="safetensors only"):
        ParallelDraft.from_pretrained(path, pair[0])


# ---- the shipped draft -------------------------------------------------------------------------------


def test_the_shipped_draft_loads_and_its_trees_accept_more_than_its_chain(pair):
    target, _, prompts = pair
    shipped = ParallelDraft.from_pretrained(PARALLEL_DIR, target, target_path=pair_dirs()[0])
    assert (shipped.mask_token, shipped.block_size, shipped.model.config.vocab_size) == (4096, 8, 4097)
    expected = SpeculativeDecoder(target, NoDraft()).generate(prompts, max_new_tokens=48, eos_token_id=None).tokens
    taus = []
    for strategy in (ParallelDraftStrategy(shipped, depth=5), ParallelDraftStrategy(shipped, max_nodes=16)):
        result = SpeculativeDecoder(target, strategy, adaptive=False).generate(
            prompts, max_new_tokens=48, eos_token_id=None
        )
        assert result.tokens == expected
        taus.append(sum(s.generated for s in result.stats) / sum(s.target_forwards for s in result.stats))
    assert taus[0] > 1.8, f"the trained draft's chain accepts little: tau {taus[0]:.2f}"
    assert taus[1] > taus[0], f"best-first trees do not beat the chain: tau {taus}"


# ---- the strategy ------------------------------------------------------------------------------------

SHAPES = {
    "chain coupled": dict(),
    "chain argmax": dict(rule="deterministic"),
    "chain stochastic": dict(rule="stochastic"),
    "tree 16": dict(max_nodes=16),
    "tree 5 depth 3": dict(max_nodes=5, depth=3),
}


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_greedy_output_is_the_targets_greedy_output(pair, shape, fused):
    target, draft, prompts = pair
    expected = SpeculativeDecoder(target, NoDraft()).generate(prompts, max_new_tokens=32).tokens
    for adaptive in (True, False):
        strategy = ParallelDraftStrategy(draft, fused=fused, **SHAPES[shape])
        result = SpeculativeDecoder(target, strategy, adaptive=adaptive, cache_layout="paged", block_size=4).generate(
            prompts, max_new_tokens=32
        )
        assert result.tokens == expected, f"adaptive={adaptive}"
        assert sum(s.drafted for s in result.stats) > 0


@pytest.mark.parametrize("shape", ["chain argmax", "tree 16"])
def test_the_draft_cache_keeps_committed_text_only(pair, shape):
    """After every draft forward the mask rows are gone: each running slot's cache holds its history exactly."""
    target, draft, prompts = pair
    strategy = ParallelDraftStrategy(draft, **SHAPES[shape])
    seen = []
    propose = strategy.propose

    def checked(step):
        proposal = propose(step)
        if max(step.max_nodes) > 1 and max(step.max_depth) > 0:  # a step that drafted
            lengths = strategy.cache.seq_lens.tolist()
            seen.append([lengths[b] == len(h) for b, h in zip(step.running, step.histories)])
        return proposal

    strategy.propose = checked
    SpeculativeDecoder(target, strategy, adaptive=False).generate(prompts, max_new_tokens=24)
    assert len(seen) > 3 and all(all(s) for s in seen)


def test_per_request_limits_shape_each_tree(pair):
    """Requests near their end get shallower limits: each tree has the nodes its depth's share allows."""
    target, draft, prompts = pair
    strategy = ParallelDraftStrategy(draft, max_nodes=12, depth=4)
    assert [strategy.draft_nodes(d) for d in (0, 1, 2, 3, 4, 9)] == [1, 4, 7, 10, 12, 12]  # 11 drafted at depth 4
    seen, propose = [], strategy.propose

    def recorded(step):
        proposal = propose(step)
        seen.append((proposal.counts, proposal.depths, list(step.max_depth), list(step.max_nodes)))
        return proposal

    strategy.propose = recorded
    engine = SpeculativeDecoder(target, strategy, adaptive=False).engine(max_batch=3, max_len=128)
    for p, new in zip(prompts, (9, 14, 20)):
        engine.add_request(p, max_new_tokens=new)
    while engine.has_unfinished():
        engine.step()
    for counts, depths, limits, nodes in seen:
        for count, depth, limit, most in zip(counts, depths, limits, nodes):
            assert count == min(most, strategy.draft_nodes(limit)) and depth <= max(limit, 0)
    assert any(len(set(counts)) > 1 for counts, *_ in seen), "no ragged step"
    chain = ParallelDraftStrategy(draft, depth=4)
    assert [chain.draft_nodes(d) for d in (0, 1, 4, 7)] == [1, 2, 5, 5]
    assert (chain.max_nodes, chain.max_depth, strategy.max_nodes, strategy.max_depth) == (5, 4, 12, 4)


@pytest.mark.parametrize("shape", ["chain stochastic", "chain coupled", "tree 5 depth 3"])
def test_first_tokens_follow_the_exact_model_joint(shape):
    # The first token comes from the prefill; the next three from a drafted chain or tree of depth 2 and after it.
    vocab, steps, draws, temperature = 4, 4, 20000, 1.0
    target = random_model(tiny_config(vocab_size=vocab, num_layers=1), seed=5, scale=1.5)
    draft = ParallelDraft(noisy_copy(target, 6, 0.5), mask_token=3, block_size=3, vocab_size=vocab)
    options = {**SHAPES[shape], "depth": 2}
    prompt = [1, 2, 0]
    result = SpeculativeDecoder(target, ParallelDraftStrategy(draft, **options), adaptive=False).generate(
        [prompt] * draws, max_new_tokens=steps, temperature=temperature, seed=1000, eos_token_id=None
    )
    assert_sequences_follow(result.tokens, model_joint(target, prompt, steps, temperature, 0, 1.0), vocab)
    hotter = model_joint(target, prompt, steps, temperature * 1.3, 0, 1.0)
    with pytest.raises(AssertionError):  # the check can tell T=1 from T=1.3
        assert_sequences_follow(result.tokens, hotter, vocab)
    assert sum(s.accepted for s in result.stats) > 0 and sum(s.drafted for s in result.stats) >= 2 * draws


def test_bad_arguments_are_refused_by_name(pair):
    target, draft, _ = pair
    with pytest.raises(TypeError, match="draft must be a ParallelDraft"):
        ParallelDraftStrategy(target)
    with pytest.raises(ValueError, match=r"depth must be an int in \[1, 6\]"):
        ParallelDraftStrategy(draft, depth=7)
    with pytest.raises(ValueError, match="max_nodes must be None"):
        ParallelDraftStrategy(draft, max_nodes=1)
    wide = ParallelDraftStrategy(draft, max_nodes=9000, depth=3)
    assert [wide.draft_nodes(d) for d in (0, 1, 2, 3)] == [1, 3001, 6001, 9000]
    assert ParallelDraftStrategy(draft, max_nodes=9000, depth=1).draft_nodes(1) == 4097  # a level holds the vocabulary
    with pytest.raises(ValueError, match="deterministic rule"):
        ParallelDraftStrategy(draft, max_nodes=8, rule="stochastic")
    with pytest.raises(ValueError, match="rule must be one of"):
        ParallelDraftStrategy(draft, rule="greedy")
    with pytest.raises(ValueError, match="confidence_temperature must be a positive number"):
        ParallelDraftStrategy(draft, max_nodes=8, confidence_temperature=0.0)
    with pytest.raises(ValueError, match="pard_block_size must be an int >= 2"):
        ParallelDraft(draft.model, mask_token=5, block_size=1, vocab_size=4096)
    small = random_model(tiny_config(vocab_size=300), seed=0)
    with pytest.raises(ValueError, match="vocabulary of 4096 tokens, the target has 300"):
        SpeculativeDecoder(small, ParallelDraftStrategy(draft))
