"""Seeded sampling that speculation cannot change (the contract in the README's "Seeds" section).

On the embedded pair (CPU, float32): the same seed, prompt and sampling parameters give the same tokens
across runs, alone or in any batch, in any thread, adaptive on or off, with a bounded pool that pauses and
resumes; and every strategy whose drafts are verified by "sample, then compare" (n-gram, deterministic and
coupled draft trees and chains, argmax chains, Medusa, EAGLE-1/2) emits plain seeded sampling's tokens, the
coupled drafts accepted about as often as the optimal rule's.
"""

import threading

import pytest

from specdec import use_backend
from specdec.cli.demo import eagle_row, medusa_row
from specdec.decoding import (
    DraftModelStrategy,
    NgramStrategy,
    NoDraft,
    ParallelDraftStrategy,
    ParallelEagleStrategy,
    SpeculativeDecoder,
)
from specdec.model import ParallelDraft, ParallelEagleHead
from specdec.testing import ASSETS, heldout_token_ids, load_pair

pytestmark = pytest.mark.usefixtures("torch_backend")

NEW_TOKENS = 40
SEEDS = [11, 2**40 + 3, 7]
SAMPLING = [dict(temperature=1.0), dict(temperature=0.7, top_p=0.9, top_k=40)]


@pytest.fixture(scope="module")
def pair():
    target, draft, tokenizer = load_pair()
    return target, draft, heldout_token_ids(tokenizer)[:3]


def eagle_parallel(target) -> ParallelEagleHead:
    return ParallelEagleHead.from_pretrained(ASSETS.parent / "parallel_eagle", target)


def strategies(target, draft) -> dict:
    """Every strategy whose emitted tokens must equal plain sampling's (fresh instances per call)."""
    parallel = ParallelDraft(draft, mask_token=5, block_size=6, vocab_size=target.config.vocab_size)  # a stand-in
    return {
        "chain coupled": lambda: DraftModelStrategy(draft, (1,) * 4),
        "chain argmax": lambda: DraftModelStrategy(draft, (1,) * 4, rule="deterministic"),
        "tree coupled": lambda: DraftModelStrategy(draft, (2, 2, 1)),
        "tree top-k": lambda: DraftModelStrategy(draft, (2, 2, 1), rule="deterministic"),
        "n-gram": lambda: NgramStrategy(num_draft=4, max_ngram=3),
        "parallel chain coupled": lambda: ParallelDraftStrategy(parallel, depth=4),
        "parallel tree": lambda: ParallelDraftStrategy(parallel, depth=4, max_nodes=12),
        "parallel EAGLE chain coupled": lambda: ParallelEagleStrategy(eagle_parallel(target), depth=4),
        "parallel EAGLE tree": lambda: ParallelEagleStrategy(eagle_parallel(target), max_nodes=12),
        "Medusa": lambda: medusa_row(target)[1],
        "EAGLE-2": lambda: eagle_row(target)[1],
        "EAGLE-1": lambda: eagle_row(target, static_tree="default")[1],
    }


def generate(target, strategy, prompts, seeds, *, adaptive=True, num_blocks=None, stats=None, **sampling):
    decoder = SpeculativeDecoder(target, strategy, adaptive=adaptive, cache_layout="paged", block_size=4,
                                 num_blocks=num_blocks)  # fmt: skip
    result = decoder.generate(prompts, max_new_tokens=NEW_TOKENS, seed=seeds, eos_token_id=None, **sampling)
    if stats is not None:
        stats.extend(result.stats)
    return result.tokens


@pytest.mark.parametrize("sampling", SAMPLING, ids=["T1", "T0.7-top-p"])
def test_every_deterministic_draft_emits_plain_samplings_tokens(pair, sampling):
    target, draft, prompts = pair
    plain = generate(target, NoDraft(), prompts, SEEDS, **sampling)
    for name, make in strategies(target, draft).items():
        assert generate(target, make(), prompts, SEEDS, **sampling) == plain, name


def test_the_same_seed_twice_alone_and_in_mixed_batches(pair):
    target, draft, prompts = pair
    decoder = SpeculativeDecoder(target, DraftModelStrategy(draft, (1,) * 4))  # adaptive on: the default

    def run(prompts, seeds, **sampling):
        return decoder.generate(prompts, max_new_tokens=NEW_TOKENS, seed=seeds, eos_token_id=None, **sampling).tokens

    first = run(prompts, SEEDS, temperature=1.0)
    assert run(prompts, SEEDS, temperature=1.0) == first
    assert [run([p], [s], temperature=1.0)[0] for p, s in zip(prompts, SEEDS)] == first
    mixed = run(prompts[::-1], SEEDS[::-1], temperature=[1.0, 0.0, 1.0])  # another order, one greedy request
    assert mixed[0] == first[2] and mixed[2] == first[0]


def test_threads_with_their_own_decoders_agree_with_sequential_runs(pair):
    target, draft, prompts = pair
    expected = generate(target, DraftModelStrategy(draft, (1,) * 4), prompts, SEEDS, temperature=1.0)
    results = {}

    def work(i):
        # (the models are shared read-only; each thread has its own strategy, decoder and caches; the forced
        # backend is per thread)
        with use_backend("torch"):
            results[i] = generate(target, DraftModelStrategy(draft, (1,) * 4), prompts, SEEDS, temperature=1.0)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {0: expected, 1: expected}


def test_adaptive_off_and_a_pausing_pool_give_the_same_tokens(pair):
    target, draft, prompts = pair
    plain = generate(target, NoDraft(), prompts, SEEDS, temperature=1.0)
    fixed = generate(target, DraftModelStrategy(draft, (1,) * 4), prompts, SEEDS, adaptive=False, temperature=1.0)
    # a pool just above what the prompts need: requests pause and resume
    need, stats = sum(-(-(len(p) + 1) // 4) for p in prompts), []
    bounded = generate(target, DraftModelStrategy(draft, (1,) * 4), prompts, SEEDS, num_blocks=need + 3,
                       stats=stats, temperature=1.0)  # fmt: skip
    assert sum(s.preemptions for s in stats) > 0
    assert fixed == plain and bounded == plain


def test_the_stochastic_rule_is_reproducible_with_fixed_depths(pair):
    target, draft, prompts = pair
    runs = [generate(target, DraftModelStrategy(draft, (1,) * 4, rule="stochastic"), prompts, SEEDS, adaptive=False,
                     temperature=1.0) for _ in range(2)]  # fmt: skip
    assert runs[0] == runs[1]


def test_coupled_drafts_are_accepted_about_as_often_as_the_optimal_rules(pair):
    """The coupled rule keeps plain sampling's tokens whatever the drafts, so only acceptance shows that the draft
    draws with the target's own race clocks: its first drafts are accepted at about the Gumbel-max coupling's
    rate, close to the optimal rule's 1 - TV (0.74 against 0.79 on this pair at T=1, bench/RESULTS.md), where
    drafts drawn with other clocks (or by the inverse CDF before) are accepted about as often as argmax drafts."""
    target, draft, prompts = pair
    first = {}
    for rule in ("coupled", "stochastic", "deterministic"):
        stats = []
        generate(target, DraftModelStrategy(draft, (1,) * 4, rule=rule), prompts, SEEDS, adaptive=False, stats=stats,
                 temperature=1.0)  # fmt: skip
        first[rule] = sum(s.accepted_at[0] for s in stats) / sum(s.drafted_at[0] for s in stats)
    assert first["coupled"] > 0.55 and first["coupled"] > first["stochastic"] - 0.2, first
    assert first["coupled"] > first["deterministic"] + 0.3, first
