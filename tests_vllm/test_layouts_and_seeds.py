"""The plugin reads any row layout vLLM's RejectionSampler.forward allows, and seeds by (seed, position).

The first tests call the samplers directly with metadata built by hand (the engine only ever
produces its own layout); the last ones run the engine."""

import dataclasses

import pytest
import torch
from engines import HELD_OUT, engine, runner_sampler, token_ids
from vllm import SamplingParams
from vllm.inputs import TokensPrompt
from vllm.platforms.cpu import CpuPlatform
from vllm.v1.sample.logits_processor import LogitsProcessors
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.rejection_sampler import RejectionSampler
from vllm.v1.sample.sampler import Sampler
from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

from specdec.integrations import _vllm_verify as verification
from specdec.integrations import vllm as plugin
from specdec.integrations._vllm_samplers import SpecdecRejectionSampler

V = 53
COUNTS = [3, 0, 4, 2]  # drafts per request: ragged, one without any


@pytest.fixture(scope="module", autouse=True)
def _cpu_kernels():
    """vLLM's CPU ops in place of its Triton kernels, for stock's sampler (what a worker does when it starts)."""
    CpuPlatform.register_triton_kernel_overrides()


def engine_metadata(counts, drafts):
    """SpecDecodeMetadata in the engine's layout (``_calc_spec_decode_metadata``): each request's draft rows, then
    its bonus row; the step's input tokens are the logits rows, in order."""
    sampled = torch.tensor(counts).add(1).cumsum(0).to(torch.int32)
    bonus = sampled.long() - 1
    target = torch.cat([torch.arange(int(b) - k, int(b)) for b, k in zip(bonus, counts)])
    return SpecDecodeMetadata(
        draft_token_ids=drafts, num_draft_tokens=list(counts),
        cu_num_draft_tokens=torch.tensor(counts).cumsum(0).to(torch.int32), cu_num_sampled_tokens=sampled,
        target_logits_indices=target.to(torch.int32), bonus_logits_indices=bonus.to(torch.int32),
        logits_indices=torch.arange(int(sampled[-1]), dtype=torch.int32),
    )  # fmt: skip


def scrambled(metadata, logits, extra, seed):
    """The same step in another layout the contract allows: rows permuted, ``extra`` NaN rows that belong to no
    request mixed in. ``logits_indices`` moves with its rows, so each row keeps its input token's position."""
    rows = logits.shape[0]
    order = torch.randperm(rows + extra, generator=torch.Generator().manual_seed(seed))
    where = torch.empty(rows + extra, dtype=torch.long)
    where[order] = torch.arange(rows + extra)
    new_logits = torch.cat([logits, torch.full((extra, V), float("nan"))])[order]
    new_indices = torch.cat([metadata.logits_indices, torch.zeros(extra, dtype=torch.int32)])[order]
    moved = dataclasses.replace(
        metadata, target_logits_indices=where[metadata.target_logits_indices.long()].to(torch.int32),
        bonus_logits_indices=where[metadata.bonus_logits_indices.long()].to(torch.int32), logits_indices=new_indices,
    )  # fmt: skip
    return moved, new_logits


def sampling_metadata(temperature, seeds, logprobs):
    """SamplingMetadata with nothing but temperature (None: all greedy), per-row seeds and logprobs."""
    batch = len(COUNTS)
    greedy = temperature is None
    return SamplingMetadata(
        temperature=temperature, all_greedy=greedy, all_random=not greedy and bool((temperature > 0).all()),
        top_p=None, top_k=None, generators={row: torch.Generator().manual_seed(s) for row, s in seeds.items()},
        max_num_logprobs=logprobs, no_penalties=True, prompt_token_ids=None,
        frequency_penalties=torch.zeros(batch), presence_penalties=torch.zeros(batch),
        repetition_penalties=torch.ones(batch), output_token_ids=[], allowed_token_ids_mask=None,
        bad_words_token_ids={}, logitsprocs=LogitsProcessors(),
    )  # fmt: skip


def step(seed=0):
    generator = torch.Generator().manual_seed(seed)
    total = sum(COUNTS)
    logits = torch.randn(total + len(COUNTS), V, generator=generator) * 2
    drafts = torch.randint(V, (total,), generator=generator, dtype=torch.int32)
    drafts[3] = logits[5].argmax()  # request 2 (rows 5..9) accepts its first draft when greedy
    return engine_metadata(COUNTS, drafts), logits


def specdec_sampler(positions):
    sampler = SpecdecRejectionSampler(Sampler())
    sampler.token_positions = positions
    return sampler


def outputs(result):
    """(tokens, top logprobs, their ids, ranks) of a SamplerOutput, logprobs only where a token was emitted."""
    tokens = result.sampled_token_ids
    if result.logprobs_tensors is None:
        return (tokens,)
    emitted = (tokens != -1).flatten()
    lp = result.logprobs_tensors
    return tokens, lp.logprobs[emitted], lp.logprob_token_ids[emitted], lp.selected_token_ranks[emitted]


def assert_same(got, want):
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b), f"{a}\n!=\n{b}"


def test_greedy_any_layout_equals_the_engine_layout_and_stock():
    """Greedy with log-probabilities: on the engine's layout, stock's tokens and logprobs; on a permuted layout with
    junk rows, the same again (stock's sampler reads the tokens right there too, its logprobs assume its layout)."""
    metadata, logits = step()
    positions = torch.arange(100)
    stock = RejectionSampler(Sampler())
    want = outputs(stock(metadata, None, logits.clone(), sampling_metadata(None, {}, 2)))
    mine = specdec_sampler(positions)
    assert_same(outputs(mine(metadata, None, logits.clone(), sampling_metadata(None, {}, 2))), want)
    assert int((want[0][2] != -1).sum()) >= 2, "request 2 accepted a draft"
    for extra in (0, 4):
        moved, moved_logits = scrambled(metadata, logits, extra, seed=extra)
        assert_same(outputs(mine(moved, None, moved_logits.clone(), sampling_metadata(None, {}, 2))), want)
        stock_tokens = stock(moved, None, moved_logits.clone(), sampling_metadata(None, {}, None)).sampled_token_ids
        assert torch.equal(stock_tokens, want[0])
    assert plugin.stats()["invalid_requests"] == 0


@pytest.mark.parametrize("with_draft_probs", [False, True], ids=["deterministic", "stochastic"])
def test_seeded_any_layout_equals_the_engine_layout(with_draft_probs):
    """Seeded sampling with log-probabilities and a greedy request: any layout gives the engine layout's tokens and
    logprobs, every call (the same seeds and positions), and no generator is drawn from."""
    metadata, logits = step(seed=1)
    positions = torch.arange(100) + 17
    draft_probs = torch.softmax(torch.randn(sum(COUNTS), V), -1) if with_draft_probs else None
    temperature = torch.tensor([0.0, 0.7, 1.0, 1.3])
    seeds = {1: 5, 2: 6, 3: 2**64 - 1}
    mine = specdec_sampler(positions)
    want = outputs(mine(metadata, draft_probs, logits.clone(), sampling_metadata(temperature, seeds, 1)))
    for extra in (0, 0, 6):
        moved, moved_logits = scrambled(metadata, logits, extra, seed=extra + 1)
        sampling = sampling_metadata(temperature, seeds, 1)
        states = {row: g.get_state() for row, g in sampling.generators.items()}
        assert_same(outputs(mine(moved, draft_probs, moved_logits.clone(), sampling)), want)
        assert all(torch.equal(g.get_state(), states[row]) for row, g in sampling.generators.items())
    assert plugin.stats().get("fallback_calls", 0) == 0 and plugin.stats()["invalid_requests"] == 0


def test_another_sampler_is_vllms_to_run():
    """A sampler other than vLLM's own draws the bonus token its own way: the batch goes to vLLM's implementation."""

    class OtherSampler(Sampler):
        pass

    metadata, logits = step()
    mine = SpecdecRejectionSampler(OtherSampler())
    mine(metadata, None, logits, sampling_metadata(None, {}, None))
    assert plugin.stats()["fallback: sampler OtherSampler"] == 1 and "verify_calls" not in plugin.stats()


# ----------------------------------------------------------------------------- in the engine


@pytest.fixture
def offsets_seen(monkeypatch):
    """(offset, num_accepted) of every sampled batch's request 0, as the plugin passed them to verify_chain."""
    seen = []
    real = verification.verify_chain

    def spy(logits, drafts, draft_offsets, params, **kwargs):
        result = real(logits, drafts, draft_offsets, params, **kwargs)
        seen.append((int(params.offset[0]), int(result.num_accepted[0])))
        return result

    monkeypatch.setattr(verification, "verify_chain", spy)
    return seen


def test_offsets_are_the_positions_of_the_decided_tokens(offsets_seen):
    """One seeded request: its first step (the prefill) decides the token at position len(prompt); every later
    step decides from where the previous one stopped (accepted drafts + 1 further)."""
    llm = engine("ngram", with_plugin=True)
    assert runner_sampler(llm).token_positions is not None, "the runner bound its positions"
    prompt = llm.get_tokenizer().encode(HELD_OUT[2])
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=40, ignore_eos=True)
    out = token_ids(llm.generate([TokensPrompt(prompt_token_ids=prompt)], params))[0]
    assert offsets_seen[0][0] == len(prompt)
    for (offset, accepted), (following, _) in zip(offsets_seen, offsets_seen[1:]):
        assert following == offset + accepted + 1
    assert sum(accepted + 1 for _, accepted in offsets_seen) >= len(out) == 40
    assert any(accepted > 0 for _, accepted in offsets_seen), "n-gram drafts were accepted"


def test_seeded_request_alone_or_in_a_batch():
    """A seeded request's tokens depend on its seed and positions, not on the requests beside it (n-gram drafts:
    each request's drafts come from its own tokens)."""
    llm = engine("ngram", with_plugin=True)
    mine = SamplingParams(temperature=0.8, seed=21, max_tokens=32, ignore_eos=True)
    alone = token_ids(llm.generate([HELD_OUT[0]], mine))[0]
    others = [SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True), SamplingParams(temperature=0.0,
              max_tokens=40, ignore_eos=True), SamplingParams(temperature=0.6, seed=4, max_tokens=32)]  # fmt: skip
    batched = token_ids(llm.generate(HELD_OUT[3:6] + [HELD_OUT[0]], others + [mine]))[-1]
    assert batched == alone


def test_seeded_tokens_do_not_depend_on_the_drafter(specdec_calls):
    """Deterministic drafts verified by sampling the target's token with its position's noise, then comparing: a
    seeded request gets the same tokens from n-gram drafts (up to 4 a step) and from the draft model's argmax
    drafts (3 a step), whatever each accepted (up to the rounding of the target's logits in different forwards)."""
    params = [SamplingParams(temperature=t, top_p=p, seed=s, max_tokens=40, ignore_eos=True)
              for t, p, s in ((0.8, 1.0, 1), (1.0, 0.9, 2), (0.6, 1.0, 3), (1.2, 1.0, 4))]  # fmt: skip
    runs = {spec: token_ids(engine(spec, True).generate(HELD_OUT[:4], params)) for spec in ("ngram", "draft")}
    assert {label for label, _ in specdec_calls} == {"general"}
    widest = {max(counts) for _, counts in specdec_calls}
    assert {3, 4} <= widest, "both drafters drafted"
    assert runs["ngram"] == runs["draft"]
