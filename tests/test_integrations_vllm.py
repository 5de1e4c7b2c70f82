"""The vLLM plugin's conversions, without vLLM (the engine tests are tests_vllm/, `make test-vllm`)."""

import logging
import subprocess
import sys

import pytest
import torch

from specdec.integrations import _vllm_verify as verification
from specdec.integrations import vllm as plugin

pytestmark = pytest.mark.interpreter  # CPU tensors on the Triton path

V = 37  # a vocabulary that is no tile size


@pytest.fixture(autouse=True)
def _fresh_stats(backend):
    plugin.reset_stats()
    yield


def make_batch(drafts_per_request, seed=0):
    """Raw logits [T + B, V] (each request's draft rows, then its bonus row), drafts, cu_num_draft_tokens."""
    generator = torch.Generator().manual_seed(seed)
    total, batch = sum(drafts_per_request), len(drafts_per_request)
    logits = torch.randn(total + batch, V, generator=generator) * 3
    drafts = torch.randint(V, (total,), generator=generator, dtype=torch.int32)
    cu = torch.tensor(drafts_per_request, dtype=torch.int32).cumsum(0).to(torch.int32)
    return logits, drafts, cu


def greedy_expected(logits, drafts, counts, width):
    """Accept drafts while each equals its row's argmax, then emit the argmax; -1 padding."""
    out = torch.full((len(counts), width), -1, dtype=torch.int32)
    row = draft = 0
    for b, k in enumerate(counts):
        j = 0
        while j < k and int(drafts[draft + j]) == int(logits[row + j].argmax()):
            out[b, j] = drafts[draft + j]
            j += 1
        out[b, j] = logits[row + j].argmax()
        row, draft = row + k + 1, draft + k
    return out


def v1(logits, drafts, cu, draft_probs=None, *, temperature=None, top_k=None, top_p=None, generators=None,
       all_greedy=False, max_spec_len=None, positions=None):  # fmt: skip
    """verify_v1_batch on the engine's own row layout; logits row r's input token sits at ``positions[r]``
    (default r). Returns (tokens, num_accepted). The other layouts are tests/test_vllm_rows.py's."""
    counts = torch.diff(cu, prepend=torch.zeros(1, dtype=cu.dtype)).tolist()
    rows = logits.shape[0]
    bonus = cu.long() + torch.arange(len(counts))
    target = torch.tensor([r for r in range(rows) if r not in bonus.tolist()], dtype=torch.long)
    return plugin.verify_v1_batch(
        logits, drafts, cu, max(counts) if max_spec_len is None else max_spec_len, draft_probs,
        target_logits_indices=target, bonus_logits_indices=bonus, logits_indices=torch.arange(rows),
        token_positions=torch.arange(rows) if positions is None else positions,
        temperature=temperature, top_k=top_k, top_p=top_p, generators=generators or {}, all_greedy=all_greedy,
    )[:2]  # fmt: skip


def test_v1_greedy_rows_follow_the_argmax_and_the_output_is_vllms_layout():
    counts = [3, 0, 5, 2]
    logits, drafts, cu = make_batch(counts)
    drafts[:3] = logits[:3].argmax(-1).to(torch.int32)  # request 0: all accepted, bonus from its last row
    temperature = torch.tensor([0.0, 0.0, 0.0, 0.7])
    tokens, accepted = v1(logits, drafts, cu, temperature=temperature)
    assert tokens.dtype == torch.int32 and tokens.shape == (4, 6)
    expected = greedy_expected(logits, drafts, counts, 6)
    assert torch.equal(tokens[:3], expected[:3])
    assert int(accepted[0]) == 3
    emitted = (tokens != -1).sum(1)
    assert torch.equal(emitted, accepted + 1)
    # all greedy (temperature None): same tokens, and draft_probs (vLLM passes logits then) are ignored
    tokens_all, _ = v1(logits, drafts, cu, draft_probs=torch.randn(10, V), all_greedy=True)
    assert torch.equal(tokens_all[:3], expected[:3])


@pytest.fixture
def op_calls(monkeypatch):
    """Which specdec op each plugin call ran: "greedy" (verify_chain_greedy) or "general" (verify_chain)."""
    calls = []
    for name, label in (("verify_chain_greedy", "greedy"), ("verify_chain", "general")):
        real = getattr(verification, name)

        def spy(*args, real=real, label=label, **kwargs):
            calls.append(label)
            return real(*args, **kwargs)

        monkeypatch.setattr(verification, name, spy)
    return calls


def test_v1_all_greedy_runs_the_greedy_op_with_the_general_ops_tokens(op_calls):
    """vLLM's host flag all_greedy picks verify_chain_greedy; its tokens equal verify_chain's at temperature 0,
    ragged and empty chains, padded (-1) and out-of-range drafts, and an invalid request included."""
    counts = [4, 0, 3, 5, 1]
    logits, drafts, cu = make_batch(counts, seed=9)
    drafts[:4] = logits[:4].argmax(-1).to(torch.int32)  # request 0 accepts everything
    drafts[4] = logits[6].argmax()  # request 2 accepts its first draft, then meets a padded draft
    drafts[5] = -1
    drafts[12] = V + 3  # request 4: a draft outside the vocabulary, rejected
    logits[13, 2] = float("nan")  # request 3 (rows 10..15): invalid
    generator = torch.Generator().manual_seed(4)
    state = generator.get_state()
    greedy, greedy_accepted = v1(logits, drafts, cu, draft_probs=torch.randn(13, V), all_greedy=True,
                                 generators={2: generator})  # fmt: skip
    assert op_calls == ["greedy"]
    assert torch.equal(generator.get_state(), state), "the greedy path draws no random numbers"
    general, general_accepted = v1(logits, drafts, cu, temperature=torch.zeros(5))
    assert op_calls == ["greedy", "general"]
    assert torch.equal(greedy, general) and torch.equal(greedy_accepted, general_accepted)
    expected = greedy_expected(logits, drafts, counts, 6)
    expected[3] = torch.tensor([int(logits[10].argmax()), -1, -1, -1, -1, -1])  # the rescue: its first row's argmax
    assert torch.equal(greedy, expected)
    assert greedy_accepted.tolist() == [4, 0, 1, 0, 0]
    assert plugin.stats()["invalid_requests"] == 2


def test_v1_top_k_off_is_vllms_vocab_size():
    logits, drafts, cu = make_batch([2, 4])
    temperature = torch.tensor([0.9, 1.3])
    results = []
    for top_k in (None, torch.tensor([V, V], dtype=torch.int32), torch.tensor([0, -1], dtype=torch.int32)):
        generators = {0: torch.Generator().manual_seed(1), 1: torch.Generator().manual_seed(2)}
        results.append(v1(logits, drafts, cu, temperature=temperature, top_k=top_k, generators=generators))
    for tokens, accepted in results[1:]:
        assert torch.equal(tokens, results[0][0]) and torch.equal(accepted, results[0][1])


def test_v1_top_k_filters_the_target():
    logits, drafts, cu = make_batch([3, 3])
    tokens, _ = v1(logits, drafts, cu, temperature=torch.tensor([1.5, 1.5]), top_k=torch.tensor([1, 1]),
                   generators={0: torch.Generator().manual_seed(3)})  # fmt: skip
    assert torch.equal(tokens, greedy_expected(logits, drafts, [3, 3], 4))  # top-1 sampling is the argmax


def test_v1_seeded_request_is_batch_invariant_and_draws_nothing_from_its_generator():
    """A seeded request's uniforms are keyed on (its own seed, the positions of its tokens): the same alone as in a
    batch, whatever the global RNG and its generator's state; the generator is read, never drawn from."""
    logits, drafts, cu = make_batch([4, 2, 3])
    temperature = torch.tensor([1.0, 0.8, 1.2])
    positions = torch.tensor([7, 8, 9, 10, 11, 40, 41, 42, 3, 4, 5, 6])  # request 1 (rows 5..7) decides 41, 42, 43
    generator = torch.Generator().manual_seed(5)
    state = generator.get_state()
    torch.manual_seed(11)
    batched, _ = v1(logits, drafts, cu, temperature=temperature, generators={1: generator}, positions=positions)
    assert torch.equal(generator.get_state(), state), "the plugin draws nothing from a seeded request's generator"
    torch.randint(5, (3,), generator=generator)  # a generator in another state, the same seed
    torch.manual_seed(12)  # a different global RNG state: the seeded request must not depend on it
    alone, _ = v1(logits[5:8], drafts[4:6], torch.tensor([2], dtype=torch.int32), temperature=temperature[1:2],
                  generators={0: generator}, positions=torch.tensor([40, 41, 42]))  # fmt: skip
    assert torch.equal(batched[1, :3], alone[0])


def test_v1_draft_probs_select_the_stochastic_rule():
    """q = p accepts every draft (u * q < p for u < 1); the deterministic rule would accept with p(x) only."""
    counts = [5, 5]
    logits, drafts, cu = make_batch(counts)
    temperature = torch.tensor([0.8, 0.8])
    rows = torch.cat([torch.arange(0, 5), torch.arange(6, 11)])
    q = torch.softmax(logits[rows] / 0.8, -1)
    drafts = torch.multinomial(q, 1).squeeze(1).to(torch.int32)
    tokens, accepted = v1(logits, drafts, cu, q, temperature=temperature)
    assert accepted.tolist() == [5, 5]
    assert torch.equal(tokens[:, :5].flatten(), drafts)


def test_invalid_request_still_gets_one_token():
    """A NaN row makes the request invalid in verify_chain; vLLM's scheduler needs one token from it."""
    counts = [2, 3]
    logits, drafts, cu = make_batch(counts)
    logits[3, 5] = float("nan")  # request 1's first row
    tokens, accepted = v1(logits, drafts, cu, temperature=torch.tensor([0.0, 0.0]))
    rescue = int(torch.nan_to_num(logits[3], nan=float("-inf")).argmax())
    assert tokens[1].tolist() == [rescue, -1, -1, -1] and int(accepted[1]) == 0
    assert torch.equal(tokens[0], greedy_expected(logits, drafts, counts, 4)[0])
    assert plugin.stats()["invalid_requests"] == 1


def test_v1_bad_index_shapes_named():
    logits, drafts, cu = make_batch([2, 2])
    with pytest.raises(ValueError, match="target_logits_indices must hold one row per draft"):
        v1(logits, drafts[:-1], cu)


def v2_layout(logits, drafts, counts, last_tokens, positions):
    """MRV2's inputs for the same batch: each request's rows are its last token, then its drafts."""
    sampled, pos, start = [], [], 0
    for b, k in enumerate(counts):
        sampled += [last_tokens[b]] + drafts[start : start + k].tolist()
        pos += list(range(positions[b], positions[b] + k + 1))
        start += k
    cu = torch.tensor([0] + counts, dtype=torch.int32).cumsum(0) + torch.arange(len(counts) + 1, dtype=torch.int32)
    return torch.tensor(sampled), cu.to(torch.int32), torch.tensor(pos)


def test_v2_conversion_reads_mrv2_layout():
    counts = [3, 2, 4]
    logits, drafts, cu = make_batch(counts)
    sampled, cu_logits, pos = v2_layout(logits, drafts, counts, [1, 2, 3], [10, 20, 30])
    state_temperature = torch.tensor([0.0, 0.5, 0.0, 0.0, 0.0])  # request-state rows; batch maps onto 0, 2, 4
    seeds = torch.tensor([7, 8, 9, 10, 11])
    idx = torch.tensor([0, 2, 4])
    tokens, num_sampled = plugin.verify_v2_batch(logits, sampled, cu_logits, pos, idx, temperature=state_temperature,
                                                 seeds=seeds, draft_logits=None, num_speculative_steps=4,
                                                 all_greedy=False)  # fmt: skip
    assert tokens.dtype == torch.int64 and tokens.shape == (3, 5)
    assert torch.equal(tokens, greedy_expected(logits, drafts, counts, 5).long())
    assert torch.equal(num_sampled, (tokens != -1).sum(1).to(torch.int32))


def test_v2_all_greedy_runs_the_greedy_op(op_calls):
    counts = [3, 0, 4]
    logits, drafts, _ = make_batch(counts, seed=2)
    drafts[3:5] = logits[4:6].argmax(-1).to(torch.int32)
    sampled, cu_logits, pos = v2_layout(logits, drafts, counts, [1, 2, 3], [4, 8, 12])
    args = dict(temperature=torch.zeros(3), seeds=torch.tensor([1, 2, 3]), draft_logits=None, num_speculative_steps=4)
    greedy = plugin.verify_v2_batch(logits, sampled, cu_logits, pos, torch.arange(3), all_greedy=True, **args)
    general = plugin.verify_v2_batch(logits, sampled, cu_logits, pos, torch.arange(3), all_greedy=False, **args)
    assert op_calls == ["greedy", "general"]
    assert torch.equal(greedy[0], general[0]) and torch.equal(greedy[1], general[1])
    assert torch.equal(greedy[0], greedy_expected(logits, drafts, counts, 5).long())


def test_v2_draft_logits_are_pre_temperature_and_seeded_by_position():
    counts = [3, 3]
    logits, _, _ = make_batch(counts, seed=4)
    temperature = torch.tensor([0.6, 1.7])  # processed logits already carry it: softmax(logits) is p
    draft_logits = torch.zeros(2, 3, V)
    drafts = []
    for b, base in enumerate((0, 4)):
        draft_logits[b] = logits[base : base + 3] * temperature[b]  # so softmax(draft_logits / T) = p: q == p
        drafts += torch.multinomial(torch.softmax(logits[base : base + 3], -1), 1).squeeze(1).tolist()
    drafts = torch.tensor(drafts, dtype=torch.int32)
    sampled, cu_logits, pos = v2_layout(logits, drafts, counts, [0, 0], [5, 9])
    args = dict(temperature=temperature, seeds=torch.tensor([3, 4]), draft_logits=draft_logits, num_speculative_steps=3,
                all_greedy=False)  # fmt: skip
    tokens, num_sampled = plugin.verify_v2_batch(logits, sampled, cu_logits, pos, torch.tensor([0, 1]), **args)
    assert num_sampled.tolist() == [4, 4]
    assert torch.equal(tokens[:, :3].flatten(), drafts.long())
    again, _ = plugin.verify_v2_batch(logits, sampled, cu_logits, pos, torch.tensor([0, 1]), **args)
    assert torch.equal(tokens, again)  # the bonus tokens come from (seed, position): reproducible


@pytest.mark.parametrize(
    ("version", "refusal"),
    [("0.32.0", None), ("0.32.3+cpu", None), ("0.33.0", "outside the tested range"),
     ("0.31.9", "outside the tested range"), ("dev", "cannot read")],
)  # fmt: skip
def test_version_gate(version, refusal):
    reason = plugin.version_refusal(version)
    assert reason is None if refusal is None else refusal in reason


def test_counters_fold_without_losing_steps(monkeypatch):
    """Per-step counts are kept as tensors and summed every _PENDING_MAX steps and on reading (also when the
    steps ran under inference mode and the reading does not)."""
    monkeypatch.setattr(verification, "_PENDING_MAX", 3)
    accepted = drafted = 0
    for seed in range(7):
        logits, drafts, cu = make_batch([2, 3], seed=seed)
        drafts[0] = logits[0].argmax()
        with torch.inference_mode(seed < 5):  # vLLM's steps run in inference mode; stats() is read outside
            _, num_accepted = v1(logits, drafts, cu, all_greedy=seed % 2 == 0, temperature=torch.zeros(2))
        accepted += int(num_accepted.sum())
        drafted += 5
        if seed == 4:
            assert len(verification._pending) == 2  # folded after the third and the sixth step
    stats = plugin.stats()
    assert stats["accepted_tokens"] == accepted > 0
    assert stats["draft_tokens"] == drafted and stats["verify_calls"] == 7 and stats["invalid_requests"] == 0
    assert verification._pending == []


def test_fallbacks_counted_and_logged_once(caplog):
    with caplog.at_level(logging.WARNING, logger=plugin.logger.name):  # no vLLM here: "vllm.*" propagates to root
        for _ in range(3):
            plugin.note_fallback("penalties")
        plugin.note_fallback("bad words")
    stats = plugin.stats()
    assert stats["fallback_calls"] == 4 and stats["fallback: penalties"] == 3 and stats["fallback: bad words"] == 1
    assert caplog.text.count("penalties") == 1 and caplog.text.count("bad words") == 1


def test_importing_specdec_never_imports_vllm():
    code = "import sys, specdec.integrations.vllm, specdec.integrations.converters; print('vllm' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"
