"""An EAGLE head's greedy chain in one C++ call (``head_chain_greedy_cpu``, taken by ``EagleStrategy`` at ``top_k`` 1)
against the level-by-level path it replaces (one head forward per level, then the dynamic tree's rerank): the same
drafts, so the same accepted tokens, greedy and seeded at temperature 1, for EAGLE-1/2 heads (with and without an fc
bias, one and two layers) and EAGLE-3 heads (with and without the norm before the residual, a reduced vocabulary),
batch 1 and a ragged batch of 3, contiguous and paged caches, fixed and adaptive depths; the K/V rows it writes; the
PyTorch path where the op cannot run; the op's argument checks by name; ``torch.library.opcheck``."""

import pytest
import torch
from helpers import random_prompts, rel_err
from test_head_forward_cpu import cpu_path, filled_cache, random_head  # noqa: F401 (cpu_path: an autouse fixture)

import specdec.decoding.eagle as eagle_strategy
from specdec import _backend
from specdec.decoding import AdaptiveSpeculation, SpeculativeDecoder
from specdec.decoding.autoregressive import generate as autoregressive_generate
from specdec.decoding.eagle import EagleStrategy
from specdec.model import AttentionMetadata, Eagle3Head, EagleHead
from specdec.model.draft_forward_cpu import _has_head_chain_op, _head_arguments
from specdec.testing import ASSETS, heldout_token_ids, load_pair

pytestmark = pytest.mark.skipif(
    not _has_head_chain_op(), reason=f"specdec._C without head_chain_greedy_cpu: {_backend.extension_status()[1]}"
)

HEADS = ["eagle-bias", "eagle-nobias-2layers", "eagle3", "eagle3-norm-first"]


@pytest.fixture
def proposals(monkeypatch):
    """Each step's proposal as (tokens, nodes per tree, parents), whichever path drafted it."""
    seen = []
    real = eagle_strategy.EagleStrategy.propose

    def spy(self, step):
        proposal = real(self, step)
        parents = proposal.parents if proposal.on_host else proposal.parents.parents.tolist()
        seen.append((proposal.tokens.tolist(), proposal.counts, sum(parents, []) if proposal.on_host else parents))
        return proposal

    monkeypatch.setattr(eagle_strategy.EagleStrategy, "propose", spy)
    return seen


@pytest.fixture
def chain_calls(monkeypatch):
    """The draft count of every chain the strategy drafts in one call."""
    calls = []
    real = eagle_strategy.EagleStrategy._draft_chain

    def spy(self, step, *args):
        proposal = real(self, step, *args)
        calls.append(max(len(p) for p in proposal.parents) - 1)
        return proposal

    monkeypatch.setattr(eagle_strategy.EagleStrategy, "_draft_chain", spy)
    return calls


def head_of(kind: str):
    head = random_head(kind.removesuffix("-norm-first"))
    head.norm_before_residual = kind.endswith("norm-first")
    return head


def level_by_level(monkeypatch):
    """The strategy's path without the op: a head forward per level, then the rerank."""
    monkeypatch.setattr(eagle_strategy, "head_chain_available", lambda head, cache: False)


@pytest.mark.parametrize("ragged", [False, True], ids=["fixed", "ragged"])
@pytest.mark.parametrize("layout", ["contiguous", "paged"])
@pytest.mark.parametrize("kind", HEADS)
def test_greedy_chains_emit_the_targets_tokens_with_the_level_by_level_drafts(kind, layout, ragged, chain_calls,
                                                                              proposals, monkeypatch):  # fmt: skip
    """Fixed depths, or ragged ones (each request's own, as an adaptive controller sets them, forced here: a timed
    choice would differ between the two runs)."""
    head = head_of(kind)
    prompts = random_prompts([7, 3, 5], head.target.config.vocab_size, seed=6)
    options = dict(max_new_tokens=[16, 6, 11], eos_token_id=None)

    def run():
        strategy = EagleStrategy(head, tree_budget=5, depth=4, top_k=1)
        depths = AdaptiveSpeculation(forced=lambda k, running, limits: [(k + r) % 5 for r in range(len(running))])
        adaptive = depths if ragged else False
        decoder = SpeculativeDecoder(head.target, strategy, cache_layout=layout, block_size=4, adaptive=adaptive)
        return decoder.generate(prompts, **options)

    fused = run()
    assert chain_calls and max(chain_calls) == 4, "the chains were drafted in one call, 4 drafts deep"
    fused_proposals = list(proposals)
    proposals.clear()
    level_by_level(monkeypatch)
    reference = run()
    assert fused.tokens == autoregressive_generate(head.target, prompts, **options)
    assert fused.tokens == reference.tokens
    assert fused_proposals == proposals, "the same trees, step by step"
    assert sum(s.drafted for s in fused.stats) > 0


@pytest.mark.parametrize("eagle3", [False, True], ids=["eagle", "eagle3"])
def test_the_shipped_heads_on_heldout_prompts(eagle3, chain_calls, proposals, monkeypatch):
    """The embedded target's own heads, a batch of 4: greedy equals the target's, the trees equal the level-by-level
    path's step by step."""
    target, _, tokenizer = load_pair()
    head = (Eagle3Head if eagle3 else EagleHead).from_pretrained(
        ASSETS.parent / ("eagle3" if eagle3 else "eagle"), target
    )
    prompts = heldout_token_ids(tokenizer)[:4]
    options = dict(max_new_tokens=[40, 31, 22, 35], eos_token_id=None)

    def run():
        strategy = EagleStrategy(head, tree_budget=6, depth=5, top_k=1)
        return SpeculativeDecoder(target, strategy, adaptive=False).generate(prompts, **options)

    fused = run()
    assert chain_calls, "the chains were drafted in one call"
    fused_proposals = list(proposals)
    proposals.clear()
    level_by_level(monkeypatch)
    reference = run()
    assert fused.tokens == autoregressive_generate(target, prompts, **options)
    assert fused.tokens == reference.tokens and fused_proposals == proposals
    generated, forwards = (sum(getattr(s, key) for s in fused.stats) for key in ("generated", "target_forwards"))
    assert generated / forwards > 2.5, f"tau {generated / forwards:.2f}: the shipped heads draft well"


@pytest.mark.parametrize("kind", ["eagle-bias", "eagle3"])
def test_seeded_sampling_through_it_equals_the_level_by_level_path(kind, chain_calls, monkeypatch):
    """Temperature 1, seeded: the drafts are the same, and the deterministic rule's draws follow the seeds, so the
    tokens are the same (exactness of the rule itself: tests/test_eagle_strategy.py's TVD tests)."""
    head = head_of(kind)
    prompts = random_prompts([6, 4], head.target.config.vocab_size, seed=3)
    options = dict(max_new_tokens=12, eos_token_id=None, temperature=1.0, seed=11)

    def run():
        decoder = SpeculativeDecoder(head.target, EagleStrategy(head, tree_budget=4, depth=3, top_k=1), adaptive=False)
        return decoder.generate(prompts, **options).tokens

    fused = run()
    assert chain_calls
    level_by_level(monkeypatch)
    assert fused == run()


def chain_call(kind: str, num_drafts: int = 3, **change):
    """A well-formed ``head_chain_greedy_cpu`` call for two running requests (slots 0 and 2 of a contiguous cache
    with 6, 11 and 9 rows), with ``change`` replacing arguments by name."""
    head = head_of(kind)
    cache = filled_cache(head, "contiguous")
    hidden, gen = head.config.hidden_size, torch.Generator().manual_seed(8)
    eagle3 = kind.startswith("eagle3")
    layer = head.midlayer if eagle3 else None
    args = dict(
        features=torch.randn(2, hidden, generator=gen), logits=torch.randn(2, head.draft_vocab_size, generator=gen),
        slots=torch.tensor([0, 2]), num_drafts=num_drafts, embed=head.embedding_weight,
        fc_weight=None if eagle3 else head.fc.weight, fc_bias=None if eagle3 else head.fc.bias,
        input_norm=layer.input_layernorm.weight if eagle3 else None, hidden_norm=layer.hidden_norm.weight if eagle3
        else None, norm_before_residual=head.norm_before_residual if eagle3 else False,
        draft_to_target=head.draft_to_target if eagle3 else None,
    )  # fmt: skip
    args.update({k: v for k, v in change.items() if k in args})
    final_norm, lm_head = (head.norm.weight, head.lm_head.weight) if eagle3 else (None, head.lm_head_weight)
    drafts = change.get("drafts", torch.empty(2, num_drafts, dtype=torch.int64))
    return head, cache, (*args.values(), *_head_arguments(head, cache, final_norm, lm_head), drafts)


@pytest.mark.parametrize("kind", HEADS)
def test_the_op_against_the_heads_forwards(kind):
    """The op's drafts and K/V rows against the head's own forwards (PyTorch path), level by level."""
    head, cache, args = chain_call(kind, num_drafts=4)
    features, logits, drafts = args[0], args[1], args[-1]
    torch.ops.specdec.head_chain_greedy_cpu(*args)
    reference_cache = filled_cache(head, "contiguous")
    one_row = AttentionMetadata(torch.tensor([0, 1, 1, 2], dtype=torch.int32))  # slots 0 and 2
    expected, feature, step_logits = [], features, logits
    with _backend.use_backend("torch"):
        for j in range(4):
            expected.append(head.target_ids(step_logits.argmax(-1)))
            if j < 3:  # draft j at seq_lens + j, as the op writes it (committed here, level by level)
                reference_cache.reserve([1, 0, 1])
                positions = reference_cache.seq_lens[[0, 2]].long()
                feature, step_logits = head(feature, expected[-1], positions, one_row, reference_cache)
                reference_cache.advance([1, 0, 1])
    assert torch.equal(drafts, torch.stack(expected, dim=1))
    assert rel_err(cache.data, reference_cache.data) <= 1e-5, "the K/V rows of the levels"


BAD_ARGUMENTS = {  # name: (head kind, changed arguments, error, message)
    "num-drafts": ("eagle-bias", dict(num_drafts=0), ValueError, "num_drafts must be >= 1"),
    "both-inputs": ("eagle3", dict(fc_weight=torch.zeros(32, 64)), ValueError, "give fc_weight"),
    "no-input": ("eagle-bias", dict(fc_weight=None, fc_bias=None), ValueError, "give fc_weight"),
    "fc-shape": ("eagle-bias", dict(fc_weight=torch.zeros(32, 63)), ValueError, "fc_weight must be"),
    "fc-bias-alone": ("eagle3", dict(fc_bias=torch.zeros(32)), ValueError, "fc_bias needs fc_weight"),
    "norm-shape": ("eagle3", dict(hidden_norm=torch.ones(31)), ValueError, "hidden_norm must be"),
    "features-width": ("eagle-bias", dict(features=torch.zeros(2, 31)), ValueError, "embed must be"),
    "features-rows": ("eagle-bias", dict(features=torch.zeros(3, 32)), ValueError, "features must be"),
    "logits": ("eagle-bias", dict(logits=torch.zeros(2, 63)), ValueError, "logits must be"),
    "d2t-range": ("eagle3", dict(draft_to_target=torch.full((20,), 64)), ValueError, "draft_to_target holds ids"),
    "d2t-size": ("eagle3", dict(draft_to_target=torch.zeros(19, dtype=torch.int64)), ValueError, "draft_to_target"),
    "drafts": ("eagle-bias", dict(drafts=torch.empty(2, 2, dtype=torch.int64)), ValueError, "drafts must be"),
    "slot": ("eagle-bias", dict(slots=torch.tensor([0, 3])), ValueError, r"slots\[1\] = 3 is not a request slot"),
}


@pytest.mark.parametrize("kind, change, error, match", BAD_ARGUMENTS.values(), ids=BAD_ARGUMENTS)
def test_arguments_are_checked_by_name(kind, change, error, match):
    torch.ops.specdec.head_chain_greedy_cpu(*chain_call(kind)[2])  # well-formed
    with pytest.raises(error, match=match):
        torch.ops.specdec.head_chain_greedy_cpu(*chain_call(kind, **change)[2])


@pytest.mark.parametrize("kind", ["eagle-bias", "eagle3"])
def test_opcheck(kind):
    torch.library.opcheck(torch.ops.specdec.head_chain_greedy_cpu.default, chain_call(kind)[2])
