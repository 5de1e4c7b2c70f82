"""The speculative decoding engine end to end, on small random checkpoints (PyTorch path)."""

import math

import pytest
import torch
from helpers import noisy_copy, random_model, run_bench, tiny_config
from sampling_helpers import assert_sequences_follow, model_joint

from specdec.decoding import (
    AdaptiveSpeculation,
    DraftModelStrategy,
    NgramStrategy,
    SpeculativeDecoder,
    check_same_vocabulary,
)
from specdec.decoding.autoregressive import generate as autoregressive_generate
from specdec.decoding.draft_cache import FOLD_MISSING

pytestmark = pytest.mark.usefixtures("torch_backend")


@pytest.fixture(scope="module")
def pair():
    target = random_model(tiny_config(), seed=0)
    return target, noisy_copy(target, 1, 0.3)


STRATEGIES = {
    "chain": lambda draft: DraftModelStrategy(draft, (1,) * 4),
    "tree-deterministic": lambda draft: DraftModelStrategy(draft, (3, 2, 1), rule="deterministic"),
    "tree-stochastic": lambda draft: DraftModelStrategy(draft, (2, 2, 1), rule="stochastic"),
    "ngram": lambda draft: NgramStrategy(num_draft=4, max_ngram=3),
}


def prompts_of(batch: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(batch)
    lengths = torch.randint(1, 12, (batch,), generator=gen).tolist()
    return [torch.randint(0, 64, (n,), generator=gen).tolist() for n in lengths]


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_greedy_speculation_equals_target_greedy(pair, strategy, batch):
    """Fixed sizes (tests/test_adaptive.py repeats it with the adaptive controller's choices)."""
    target, draft = pair
    prompts = prompts_of(batch)
    expected = autoregressive_generate(target, prompts, max_new_tokens=128, eos_token_id=None)
    decoder = SpeculativeDecoder(target, STRATEGIES[strategy](draft), adaptive=False)
    result = decoder.generate(prompts, max_new_tokens=128, eos_token_id=None)
    for b in range(batch):
        assert result.tokens[b] == expected[b], f"request {b} diverged"
        assert result.stats[b].generated == 128
    if strategy != "ngram":
        assert sum(s.accepted for s in result.stats) > 0, "a similar draft should get some tokens accepted"


def test_autoregressive_engine_equals_reference_loop_with_paged_cache(pair):
    target, _ = pair
    prompts = prompts_of(5)
    expected = autoregressive_generate(target, prompts, max_new_tokens=40, eos_token_id=None)
    result = SpeculativeDecoder(target, None, cache_layout="paged", block_size=4).generate(
        prompts, max_new_tokens=40, eos_token_id=None
    )
    assert result.tokens == expected
    assert all(s.tau == 1.0 and s.target_forwards == 40 for s in result.stats)


def test_a_draft_tree_feeds_each_level_once(pair):
    """Level 0 feeds the tokens the draft cache missed (the last accepted path but its last node: a tree's levels
    are cut after drafting), the last committed token and the root, the same number for every request; each later
    level only its own nodes, as tree queries over the levels already in the draft cache (tree_start), never the
    tree so far again, and no catch-up forward of its own."""
    target, draft = pair
    calls, forward = [], draft.forward

    def recording(tokens, positions, metadata, cache, logits_rows=None):
        calls.append((tokens.numel(), metadata.tree_start is not None))
        return forward(tokens, positions, metadata, cache, logits_rows)

    draft.forward = recording
    try:
        prompts = prompts_of(3)
        steps = SpeculativeDecoder(
            target, DraftModelStrategy(draft, (3, 2, 1), rule="deterministic"), adaptive=False
        ).stream(prompts, max_new_tokens=30, eos_token_id=None)
        next(steps)
        assert max(map(len, prompts)) - 1 > FOLD_MISSING  # the first step feeds the prompts as their own forward
        calls.clear()
        emitted = next(steps).tokens
        assert calls == [(sum(len(p) - 1 for p in prompts), False), (2 * 3, False), (3 * 3, True), (6 * 3, True)]
        for _ in range(4):
            calls.clear()
            missed = max(max(len(t) - 2, 0) for t in emitted)  # a + 1 tokens emitted: a - 1 of them missed
            emitted = next(steps).tokens
            assert calls == [((missed + 2) * 3, False), (3 * 3, True), (6 * 3, True)], calls
    finally:
        del draft.forward


class DraftsEveryOtherStep(AdaptiveSpeculation):
    """Chooses a chain of 2 and plain decoding in turn (an adaptive controller's switch, made deterministic)."""

    def start(self):
        super().start()
        self.steps = 0

    def choose(self, running, limits, contexts):
        self._started, self.steps = self.clock(), self.steps + 1
        return [min(limit, 2 * (self.steps % 2)) for limit in limits]

    def observe(self, running, nodes, depths, accepted, contexts):
        pass


def test_a_chain_after_a_plain_step_feeds_the_missed_token_in_its_first_forward(pair):
    """The prompts reach the draft at the first step that drafts, as a forward of their own (none at the prefill). A
    step that drafted nothing left the draft cache one token short; the next chain's first forward feeds it with
    the last committed token and the root (3 rows per request), not as a forward of its own. The greedy text stays
    the target's."""
    target, draft = pair
    prompts = prompts_of(3)
    calls, forward = [], draft.forward

    def recording(tokens, positions, metadata, cache, logits_rows=None):
        calls.append(tokens.numel())
        return forward(tokens, positions, metadata, cache, logits_rows)

    draft.forward = recording
    try:
        decoder = SpeculativeDecoder(target, DraftModelStrategy(draft, (1, 1)), adaptive=DraftsEveryOtherStep())
        steps = decoder.stream(prompts, max_new_tokens=30, eos_token_id=None)
        next(steps)
        assert calls == [] and max(map(len, prompts)) - 1 > FOLD_MISSING  # the prefill: no draft forward
        next(steps)
        assert calls == [sum(len(p) - 1 for p in prompts), 2 * 3, 3]
        for step in range(6):
            calls.clear()
            next(steps)
            assert calls == ([] if step % 2 == 0 else [3 * 3, 3]), (step, calls)
    finally:
        del draft.forward
    expected = autoregressive_generate(target, prompts, max_new_tokens=30, eos_token_id=None)
    assert decoder.generate(prompts, max_new_tokens=30, eos_token_id=None).tokens == expected


def test_draft_equal_to_target_accepts_every_draft(pair):
    target, _ = pair
    k = 4
    decoder = SpeculativeDecoder(target, DraftModelStrategy(target, (1,) * k), adaptive=False)
    steps = list(decoder.stream(prompts_of(3), max_new_tokens=31, eos_token_id=None))
    for step in steps[1:]:  # after the prefill, every forward emits K + 1 tokens (fewer only at the end)
        for tokens in step.tokens:
            assert len(tokens) == k + 1 or step.finished
    for stats in decoder.stats:
        assert stats.accepted == stats.drafted > 0
        assert stats.acceptance_by_position() == [1.0] * k
        assert stats.target_forwards == 1 + math.ceil(30 / (k + 1))


def test_mixed_batch_and_requests_finishing_at_different_steps(pair):
    target, draft = pair
    prompts = prompts_of(4)
    limits = [5, 17, 1, 30]
    expected = autoregressive_generate(target, prompts, max_new_tokens=limits, eos_token_id=None)
    result = SpeculativeDecoder(target, DraftModelStrategy(draft, (1,) * 3)).generate(
        prompts, max_new_tokens=limits, eos_token_id=None
    )
    assert result.tokens == expected
    assert [len(t) for t in result.tokens] == limits


def test_eos_stops_a_request_and_max_new_tokens_zero_returns_nothing(pair):
    target, draft = pair
    prompts = prompts_of(3)
    free = SpeculativeDecoder(target, None).generate(prompts, max_new_tokens=20, eos_token_id=None)
    eos = free.tokens[0][6]
    result = SpeculativeDecoder(target, DraftModelStrategy(draft, (1,) * 3)).generate(
        prompts, max_new_tokens=[20, 0, 20], eos_token_id=eos
    )
    assert result.tokens[0] == free.tokens[0][: free.tokens[0].index(eos) + 1]
    assert result.stats[0].finish_reason == "eos"
    assert result.tokens[1] == [] and result.stats[1].finish_reason == "length"


@pytest.mark.parametrize("strategy", ["chain", "tree-stochastic", "tree-deterministic"])
def test_seeded_sampling_is_reproducible_alone_and_in_any_batch(pair, strategy):
    """With fixed sizes: sampled tokens depend on the draft depths, which the adaptive controller chooses
    from measured times (its samples are exact in distribution, not reproducible token for token)."""
    target, draft = pair
    prompts = prompts_of(4)
    options = dict(max_new_tokens=12, temperature=0.9, top_k=20, top_p=0.9, eos_token_id=None)
    seeds = [11, 22, 33, 44]

    def fixed():
        return SpeculativeDecoder(target, STRATEGIES[strategy](draft), adaptive=False)

    batch = fixed().generate(prompts, seed=seeds, **options)
    again = fixed().generate(prompts, seed=seeds, **options)
    assert batch.tokens == again.tokens
    order = [2, 0, 3, 1]
    shuffled = fixed().generate([prompts[i] for i in order], seed=[seeds[i] for i in order], **options)
    assert [shuffled.tokens[order.index(b)] for b in range(4)] == batch.tokens
    alone = fixed().generate([prompts[1]], seed=[seeds[1]], **options)
    assert alone.tokens[0] == batch.tokens[1]


# ---- exactness: the emitted distribution is the target's ------------------------------------------


@pytest.mark.parametrize(
    "strategy,temperature,top_k,top_p",
    [
        ("chain", 0.7, 0, 1.0),
        ("chain-stochastic", 0.7, 0, 1.0),
        ("tree", 1.0, 0, 1.0),
        ("tree-stochastic", 1.3, 0, 0.8),
        ("tree-deterministic", 0.8, 3, 1.0),
    ],
)
def test_first_tokens_follow_the_exact_target_joint(strategy, temperature, top_k, top_p):
    vocab, steps, draws = 4, 3, 20000
    config = tiny_config(vocab_size=vocab, num_layers=1)
    target = random_model(config, seed=5, scale=1.5)
    draft = random_model(config, seed=6, scale=1.5)  # independent: far from the target
    make = {
        "chain": lambda: DraftModelStrategy(draft, (1, 1)),  # the coupled rule
        "chain-stochastic": lambda: DraftModelStrategy(draft, (1, 1), rule="stochastic"),
        "tree": lambda: DraftModelStrategy(draft, (2, 2)),
        "tree-stochastic": lambda: DraftModelStrategy(draft, (2, 2), rule="stochastic"),
        "tree-deterministic": lambda: DraftModelStrategy(draft, (2, 2), rule="deterministic"),
    }[strategy]
    prompt = [1, 2, 3]
    result = SpeculativeDecoder(target, make(), adaptive=False).generate(
        [prompt] * draws, max_new_tokens=steps, temperature=temperature, top_k=top_k, top_p=top_p,
        seed=1000, eos_token_id=None,
    )  # fmt: skip
    assert_sequences_follow(result.tokens, model_joint(target, prompt, steps, temperature, top_k, top_p), vocab)
    assert sum(s.accepted for s in result.stats) > 0


# ---- input handling ---------------------------------------------------------------------------------


def test_vocabulary_mismatch_is_refused(pair):
    target, _ = pair
    other = random_model(tiny_config(vocab_size=32), seed=3)
    with pytest.raises(ValueError, match="share a vocabulary: target has 64 tokens, draft has 32"):
        SpeculativeDecoder(target, DraftModelStrategy(other, (1, 1)))
    with pytest.raises(ValueError, match="share a vocabulary"):
        check_same_vocabulary(target, other)


class FakeTokenizer:
    def __init__(self, vocab):
        self.vocab = vocab

    def get_vocab(self):
        return self.vocab


def test_tokenizer_mismatch_is_refused(pair):
    target, draft = pair
    with pytest.raises(ValueError, match="tokenizers differ"):
        check_same_vocabulary(target, draft, FakeTokenizer({"a": 0}), FakeTokenizer({"b": 0}))
    check_same_vocabulary(target, draft, FakeTokenizer({"a": 0}), FakeTokenizer({"a": 0}))


def test_bad_requests_are_refused(pair):
    target, draft = pair
    decoder = SpeculativeDecoder(target, DraftModelStrategy(draft, (1, 1)))
    with pytest.raises(ValueError, match=r"prompts\[1\] is empty"):
        decoder.generate([[1], []])
    with pytest.raises(ValueError, match="prompts must hold at least one prompt"):
        decoder.generate([])
    with pytest.raises(ValueError, match=r"prompts\[0\]\[1\] must be an int in \[0, 63\] \(a token id\), got 64"):
        decoder.generate([[1, 64]])
    with pytest.raises(ValueError, match=r"prompts\[0\] is text: pass tokenizer="):
        decoder.generate(["hello"])
    with pytest.raises(ValueError, match=r"top_p must be a finite number in \(0.0, 1.0\], got 0.0"):
        decoder.generate([[1]], top_p=0.0)
    with pytest.raises(ValueError, match="branching must be a non-empty sequence"):
        DraftModelStrategy(draft, ())
    with pytest.raises(ValueError, match="num_draft must be a positive int"):
        NgramStrategy(num_draft=0)
    with pytest.raises(ValueError, match="rule must be one of"):
        DraftModelStrategy(draft, (2, 2), rule="greedy")


def test_a_sampled_step_of_roots_alone_is_sampling(pair, monkeypatch):
    """A sampled step that drafts nothing (plain decoding; the prefill) takes the ``sample`` op, whose draws are
    verify_tree's without drafts: the tokens equal those of the general path, greedy rows and filters included."""
    from bench_sampled_paths import through_verify_tree  # the general path on the same roots

    from specdec.decoding import NoDraft, verification

    target, _ = pair
    prompts = prompts_of(6)
    sampling = dict(max_new_tokens=12, eos_token_id=None, temperature=[1.0, 0.0, 0.7, 1.3, 1.0, 0.5],
                    top_k=[0, 0, 5, 0, 20, 0], top_p=[1.0, 1.0, 1.0, 0.8, 0.9, 1.0], seed=4)  # fmt: skip
    calls, original = [], verification.sample

    def counted(logits, params, **kwargs):
        calls.append(logits.shape[0])
        return original(logits, params, **kwargs)

    monkeypatch.setattr(verification, "sample", counted)
    fast = SpeculativeDecoder(target, NoDraft()).generate(prompts, **sampling).tokens
    assert calls and all(rows >= 1 for rows in calls), "the sampled roots did not take the sample op"

    monkeypatch.setattr(verification, "sample", through_verify_tree)
    assert SpeculativeDecoder(target, NoDraft()).generate(prompts, **sampling).tokens == fast


def test_the_sampled_paths_benchmark_runs(tmp_path):
    """``bench/bench_sampled_paths.py --dry-run``: each pair of paths decodes, their tokens equal, the table
    written."""
    done = run_bench("bench_sampled_paths.py", "--dry-run", "--out", str(tmp_path), cpu_path=True)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line for line in (tmp_path / "sampled_paths.md").read_text().splitlines() if " vs " in line]
    assert len(rows) == 2 and all(row.rstrip(" |").endswith("yes") for row in rows)
