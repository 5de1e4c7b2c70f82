"""Greedy speculative decoding in vLLM, with the plugin and without: the target's own tokens."""

import pytest
from engines import HELD_OUT, engine, runner_sampler, spec_counts, token_ids
from vllm import SamplingParams
from vllm.v1.sample.rejection_sampler import RejectionSampler

from specdec.integrations import vllm as plugin
from specdec.integrations._vllm_samplers import SpecdecRejectionSampler

GREEDY = SamplingParams(temperature=0.0, max_tokens=48)


@pytest.fixture(scope="module")
def reference():
    """Every held-out prompt decoded greedily by the target alone (no speculation)."""
    return token_ids(engine("none", with_plugin=False).generate(HELD_OUT, GREEDY))


@pytest.mark.parametrize("spec", ["ngram", "draft"])
@pytest.mark.parametrize("with_plugin", [True, False], ids=["plugin", "stock"])
def test_greedy_speculation_equals_plain_decoding(reference, spec, with_plugin, specdec_calls):
    llm = engine(spec, with_plugin)
    assert type(runner_sampler(llm)) is (SpecdecRejectionSampler if with_plugin else RejectionSampler)
    drafted_before, _ = spec_counts(llm)
    outputs = token_ids(llm.generate(HELD_OUT, GREEDY))
    drafted = spec_counts(llm)[0] - drafted_before
    assert drafted > 100, "speculation must actually run"
    for prompt, got, want in zip(HELD_OUT, outputs, reference):
        assert got == want, f"{spec} diverged on {prompt[-40:]!r}"
    stats = plugin.stats()
    if with_plugin:  # every batch is greedy: vLLM's host flag sends each one to the argmax-only op
        assert [label for label, _ in specdec_calls] == ["greedy"] * stats["verify_calls"]
        assert stats["verify_calls"] > 0
        assert stats["draft_tokens"] == drafted
        assert stats.get("fallback_calls", 0) == 0
    else:
        assert specdec_calls == [] and "verify_calls" not in stats


def test_greedy_logprobs_equal_stock():
    """Log-probabilities of the emitted and top tokens are vLLM's own, computed from the same logits."""
    params = SamplingParams(temperature=0.0, max_tokens=24, logprobs=3)
    runs = [engine("ngram", with_plugin).generate(HELD_OUT[:4], params) for with_plugin in (True, False)]
    assert plugin.stats()["verify_calls"] > 0
    for mine, stock in zip(*runs):
        assert mine.outputs[0].token_ids == stock.outputs[0].token_ids
        assert len(mine.outputs[0].logprobs) == len(mine.outputs[0].token_ids)
        for step_mine, step_stock in zip(mine.outputs[0].logprobs, stock.outputs[0].logprobs):
            assert step_mine.keys() == step_stock.keys()
            for token, entry in step_mine.items():
                assert entry.rank == step_stock[token].rank
                assert entry.logprob == pytest.approx(step_stock[token].logprob, abs=1e-5)


def test_unsupported_request_goes_to_vllm_and_is_counted():
    """A repetition penalty is vLLM's to apply: the batch takes vLLM's path, output equal to stock."""
    params = SamplingParams(temperature=0.0, max_tokens=32, repetition_penalty=1.3)
    mine = token_ids(engine("ngram", True).generate(HELD_OUT[:3], params))
    stats = plugin.stats()
    stock = token_ids(engine("ngram", False).generate(HELD_OUT[:3], params))
    assert mine == stock
    assert stats["fallback: penalties"] == stats["fallback_calls"] > 0
    assert "verify_calls" not in stats
