"""A bounded paged target cache shared on demand: plans, pausing and resuming, 'cache' endings, nothing lost."""

import pytest
from helpers import noisy_copy, random_eagle_head, random_heads, random_model, tiny_config

from specdec import use_backend
from specdec.decoding import (
    FINISH_REASONS,
    DraftModelStrategy,
    EagleStrategy,
    MedusaStrategy,
    NgramStrategy,
    NoDraft,
    ParallelEagleStrategy,
    SpeculativeDecoder,
)
from specdec.decoding.schedule import plan_step
from specdec.model import PagedBlocks

pytestmark = pytest.mark.usefixtures("torch_backend")


def pool(num_blocks: int, holding: list[int], block_size: int = 4) -> PagedBlocks:
    """A pool whose request b holds the blocks for ``holding[b]`` tokens."""
    pages = PagedBlocks(batch_size=len(holding), max_len=64, block_size=block_size, num_blocks=num_blocks, device="cpu")
    pages.grow(holding)
    return pages


# ---- the plan (host arithmetic only) -------------------------------------------------------------


def test_plan_gives_full_trees_when_the_pool_has_room():
    pages = pool(10, [5, 3])  # 2 + 1 blocks held, 7 free
    plan = plan_step(pages, [5, 3], [0, 1], [], max_nodes=6)
    assert plan.running == [0, 1] and plan.max_nodes == [6, 6]
    assert plan.pause == plan.resume == plan.out_of_cache == []


def test_plan_shrinks_trees_in_slot_order_to_the_blocks_left():
    pages = pool(4, [6, 3])  # request 0: 2 blocks (room for 2 more tokens), request 1: 1 block (room for 1); 1 free
    plan = plan_step(pages, [6, 3], [0, 1], [], max_nodes=9)
    # Request 1 keeps its own free slot for its root; the free block goes to request 0 first: 2 + 4 slots.
    assert plan.max_nodes == [6, 1] and plan.pause == []
    plan = plan_step(pages, [6, 3], [0, 1], [], max_nodes=2)
    assert plan.max_nodes == [2, 2]  # request 0's 2 nodes fit its own blocks; request 1's second takes the free one
    assert pages.num_free == 1 and [len(b) for b in pages.blocks] == [2, 1], "a plan allocates nothing"


def test_plan_pauses_the_highest_slot_when_the_roots_do_not_fit():
    pages = pool(3, [4, 4, 4])  # every request's block is full, nothing free: each root needs a new block
    plan = plan_step(pages, [4, 4, 4], [0, 1, 2], [], max_nodes=20)
    # Pausing request 2 frees its block, which request 0 takes; request 1 still needs one: pause it too.
    assert plan.pause == [2, 1] and plan.running == [0] and plan.out_of_cache == []
    assert plan.max_nodes == [8]  # the two freed blocks


def test_plan_ends_a_request_the_whole_pool_cannot_hold():
    pages = pool(2, [8, 0])
    plan = plan_step(pages, [8, 3], [0], [1], max_nodes=2)  # request 1 is paused (and holds nothing)
    assert plan.out_of_cache == [0] and plan.pause == []
    # With request 0 gone the pool is free again: the paused request resumes in the same plan.
    assert plan.resume == [1] and plan.running == [1] and plan.max_nodes == [2]


def test_plan_resumes_in_slot_order_and_never_overtakes():
    pages = pool(6, [4, 0, 0, 0])  # request 0 holds 1 full block; 5 free
    lengths = [4, 10, 3, 2]  # paused requests 1..3 would recompute 10, 3 and 2 tokens
    plan = plan_step(pages, lengths, [0], [1, 2, 3], max_nodes=2)
    # Request 0 needs 1 block; request 1 needs ceil(11 / 4) = 3; request 2 needs 1, leaving 0 for request 3.
    assert plan.resume == [1, 2] and plan.running == [0, 1, 2]
    assert plan.max_nodes == [2, 2, 1]  # 2 nodes fit request 1's 12 slots; request 2's second would need a block
    pages = pool(4, [4, 0, 0, 0])
    plan = plan_step(pages, lengths, [0], [1, 2, 3], max_nodes=2)
    assert plan.resume == [] and plan.running == [0], "request 2 must not overtake request 1"


def test_plan_resumes_nothing_in_a_step_that_had_to_pause():
    pages = pool(3, [4, 4, 0])
    plan = plan_step(pages, [4, 4, 0], [0, 1], [2], max_nodes=2)
    assert plan.pause == [1] and plan.resume == [] and plan.running == [0]


def test_plan_ends_a_paused_request_larger_than_the_pool():
    pages = pool(2, [1, 0])
    plan = plan_step(pages, [1, 8], [0], [1], max_nodes=2)  # 8 cached + a root need 3 blocks of a 2-block pool
    assert plan.out_of_cache == [1] and plan.running == [0]


# ---- the engine ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pair():
    target = random_model(tiny_config(), seed=0)
    return target, noisy_copy(target, 1, 0.3)


# each strategy from (target, draft); the heads are random (far from the target) but fixed by their seeds
STRATEGIES = {
    "autoregressive": lambda target, draft: NoDraft(),
    "chain": lambda target, draft: DraftModelStrategy(draft, (1,) * 4),
    "tree": lambda target, draft: DraftModelStrategy(draft, (3, 2, 1), rule="deterministic"),
    "ngram": lambda target, draft: NgramStrategy(num_draft=4, max_ngram=3),
    "medusa": lambda target, draft: MedusaStrategy(random_heads(target, 5), [[0], [1], [0, 0], [0, 0, 0]]),
    "eagle2": lambda target, draft: EagleStrategy(random_eagle_head(target, 6), tree_budget=8, depth=3, top_k=2),
    "eagle1": lambda target, draft: EagleStrategy(
        random_eagle_head(target, 6), static_tree=[[0], [1], [0, 0], [0, 0, 0]], depth=3, top_k=2
    ),
    "parallel-eagle-chain": lambda target, draft: ParallelEagleStrategy(random_eagle_head(target, 6, block_size=3)),
    "parallel-eagle-tree": lambda target, draft: ParallelEagleStrategy(
        random_eagle_head(target, 6, block_size=4), max_nodes=7
    ),
}
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16], [3] * 10]


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_paused_requests_resume_and_match_an_unbounded_run(pair, strategy):
    target, draft = pair
    sampling = dict(max_new_tokens=30, eos_token_id=None)
    expected = SpeculativeDecoder(target, STRATEGIES[strategy](target, draft)).generate(PROMPTS, **sampling)
    decoder = SpeculativeDecoder(
        target, STRATEGIES[strategy](target, draft), cache_layout="paged", block_size=4, num_blocks=14
    )
    result = decoder.generate(PROMPTS, **sampling)
    assert sum(s.preemptions for s in result.stats) >= 2, "14 blocks cannot hold 4 requests of up to 40 tokens"
    assert result.tokens == expected.tokens  # greedy: the same tokens, every one of them
    assert [s.finish_reason for s in result.stats] == ["length"] * 4


@pytest.mark.parametrize("strategy", ["medusa", "eagle2", "eagle1", "parallel-eagle-tree"])
def test_sampled_head_drafting_resumes_after_pausing(pair, strategy):
    """A head drafter's per-request state (Medusa's candidates, EAGLE's pending features) outlives a pause."""
    target, draft = pair
    sampling = dict(max_new_tokens=30, eos_token_id=None, temperature=1.0, seed=5)
    decoder = SpeculativeDecoder(
        target, STRATEGIES[strategy](target, draft), adaptive=False, cache_layout="paged", block_size=4,
        num_blocks=14,
    )  # fmt: skip
    result = decoder.generate(PROMPTS, **sampling)
    assert sum(s.preemptions for s in result.stats) >= 2
    assert [len(t) for t in result.tokens] == [30] * 4
    assert [s.finish_reason for s in result.stats] == ["length"] * 4


def test_sampled_tokens_do_not_depend_on_pausing(pair):
    """Random numbers follow tokens generated, not steps: a paused request draws what it would have drawn."""
    target, _ = pair
    sampling = dict(max_new_tokens=30, eos_token_id=None, temperature=1.0, top_p=0.9, seed=11)
    expected = SpeculativeDecoder(target).generate(PROMPTS, **sampling)
    result = SpeculativeDecoder(target, cache_layout="paged", block_size=4, num_blocks=13).generate(PROMPTS, **sampling)
    assert sum(s.preemptions for s in result.stats) > 0
    assert result.tokens == expected.tokens


@pytest.mark.parametrize("strategy", ["autoregressive", "chain"])
def test_a_request_the_pool_cannot_hold_ends_cache_and_keeps_its_tokens(pair, strategy):
    target, draft = pair
    prompts, sampling = PROMPTS[:2], dict(max_new_tokens=[40, 6], eos_token_id=None)
    expected = SpeculativeDecoder(target, STRATEGIES[strategy](target, draft)).generate(prompts, **sampling).tokens
    decoder = SpeculativeDecoder(
        target, STRATEGIES[strategy](target, draft), cache_layout="paged", block_size=4, num_blocks=6
    )
    steps = list(decoder.stream(prompts, **sampling))
    streamed = [[], []]
    for step in steps:
        for b, tokens in zip(step.requests, step.tokens):
            streamed[b].extend(tokens)
    assert [s.finish_reason for s in decoder.stats] == ["cache", "length"]
    assert streamed[1] == expected[1], "the other request carries on"
    # Request 0 used every slot of the pool (24 tokens: 5 prompt + its tokens but the last, uncached).
    assert 0 < len(streamed[0]) == decoder.stats[0].generated <= 24 + 1 - len(prompts[0])
    if strategy == "autoregressive":
        assert len(streamed[0]) == 24 + 1 - len(prompts[0])
    assert streamed[0] == expected[0][: len(streamed[0])], "every token produced is returned, unchanged"
    assert steps[-1].finished.get(0) == "cache" and "cache" in FINISH_REASONS
    result = SpeculativeDecoder(target, cache_layout="paged", block_size=4, num_blocks=6).generate(
        prompts, **sampling
    )  # generate() returns the same tokens as the stream
    if strategy == "autoregressive":
        assert result.tokens == streamed


def test_bad_pool_arguments_are_refused_by_name(pair):
    target, _ = pair
    with pytest.raises(ValueError, match=r"num_blocks bounds a paged cache; pass cache_layout='paged'"):
        SpeculativeDecoder(target, num_blocks=8)
    with pytest.raises(ValueError, match=r"num_blocks must be an int >= 1, got 0"):
        SpeculativeDecoder(target, cache_layout="paged", num_blocks=0)
    with pytest.raises(TypeError, match="num_blocks must be an int"):
        SpeculativeDecoder(target, cache_layout="paged", num_blocks=2.5)
    decoder = SpeculativeDecoder(target, cache_layout="paged", block_size=4, num_blocks=3)
    with pytest.raises(ValueError, match=r"num_blocks \(3\) is too small: every prompt .*, 4 blocks of 4 tokens in"):
        decoder.validate([[1] * 8, [2] * 3], max_new_tokens=4)  # 8 + 1 tokens: 3 blocks, 3 + 1: 1 block
    decoder.validate([[1] * 7, [2] * 3], max_new_tokens=4)  # 2 + 1 blocks fit


@pytest.mark.interpreter
def test_pausing_on_the_triton_path(pair):
    """The interpreted Triton kernels over the same plan: paged writes and recomputed prefixes."""
    target, _ = pair
    prompts, sampling = PROMPTS[:2], dict(max_new_tokens=10, eos_token_id=None)
    expected = SpeculativeDecoder(target).generate(prompts, **sampling)
    decoder = SpeculativeDecoder(target, cache_layout="paged", block_size=4, num_blocks=4)
    with use_backend("triton"):
        result = decoder.generate(prompts, **sampling)
    assert sum(s.preemptions for s in result.stats) > 0
    assert result.tokens == expected.tokens
