"""The vLLM plugin reads a V1 step's rows through vLLM's index tensors, and keys seeded requests on
(seed, position): pure torch, fake vLLM metadata (the engine tests are tests_vllm/, `make test-vllm`)."""

import pytest
import torch

from specdec.integrations import _vllm_verify as verification
from specdec.kernels import SamplingParams, sample

pytestmark = pytest.mark.interpreter  # CPU tensors on the Triton path

V = 29  # a vocabulary that is no tile size


@pytest.fixture(autouse=True)
def _fresh_stats(backend):
    verification.reset_stats()
    yield


def engine_layout(counts):
    """vLLM's V1 runner layout (``_calc_spec_decode_metadata``): each request's draft rows, then its bonus row.
    Returns (target_logits_indices, bonus_logits_indices, cu_num_draft_tokens)."""
    cu_sampled = torch.tensor(counts).add(1).cumsum(0)
    bonus = cu_sampled - 1
    target = torch.cat([torch.arange(int(b) - k, int(b)) for b, k in zip(bonus, counts)]).long()
    return target, bonus, torch.tensor(counts).cumsum(0).to(torch.int32)


def scramble(logits, target, bonus, logits_indices, extra, generator):
    """The same step in another layout the contract allows: rows permuted, with ``extra`` rows that belong
    to no request mixed in (NaN: a request that read one would come back invalid). Returns (logits,
    target_logits_indices, bonus_logits_indices, logits_indices) of the new layout."""
    rows = logits.shape[0]
    order = torch.randperm(rows + extra, generator=generator)  # new row i holds old row order[i] (>= rows: junk)
    where = torch.empty(rows + extra, dtype=torch.long)
    where[order] = torch.arange(rows + extra)  # old row r now sits at where[r]
    junk = torch.full((extra, logits.shape[1]), float("nan"))
    new_logits = torch.cat([logits, junk])[order]
    new_indices = torch.cat([logits_indices, torch.full((extra,), -1)])[order]
    return new_logits, where[target], where[bonus], new_indices


def make_step(counts, seed):
    generator = torch.Generator().manual_seed(seed)
    total = sum(counts)
    logits = torch.randn(total + len(counts), V, generator=generator) * 2
    drafts = torch.randint(V, (total,), generator=generator, dtype=torch.int32)
    return logits, drafts, generator


def verify(logits, drafts, cu, target, bonus, logits_indices, positions, *, temperature, generators=None,
           draft_probs=None, all_greedy=False, top_k=None, top_p=None):  # fmt: skip
    return verification.verify_v1_batch(
        logits, drafts, cu, int(cu.diff(prepend=torch.zeros(1, dtype=cu.dtype)).max()), draft_probs,
        target_logits_indices=target, bonus_logits_indices=bonus, logits_indices=logits_indices,
        token_positions=positions, temperature=temperature, top_k=top_k, top_p=top_p, generators=generators or {},
        all_greedy=all_greedy,
    )  # fmt: skip


def test_engine_layout_is_verify_chains_own():
    """vLLM's own example (``_calc_spec_decode_metadata``): the engine's rows are already verify_chain's order."""
    target, bonus, cu = engine_layout([3, 0, 2, 0, 1])
    assert target.tolist() == [0, 1, 2, 5, 6, 9] and bonus.tolist() == [3, 4, 7, 8, 10]
    layout = verification.chain_layout(target, bonus, cu)
    assert torch.equal(layout.source_rows, torch.arange(11))
    assert torch.equal(layout.target_rows, target) and torch.equal(layout.bonus_rows, bonus)


def test_chain_layout_reads_any_layout():
    # request 0: drafts at rows 7, 2, bonus at row 0; request 1: no drafts, bonus at 5; request 2: draft 4, bonus 4
    target, bonus = torch.tensor([7, 2, 4], dtype=torch.int32), torch.tensor([0, 5, 4], dtype=torch.int32)
    layout = verification.chain_layout(target, bonus, torch.tensor([2, 2, 3], dtype=torch.int32))
    assert layout.source_rows.tolist() == [7, 2, 0, 5, 4, 4]
    assert layout.target_rows.tolist() == [0, 1, 4] and layout.bonus_rows.tolist() == [2, 3, 5]


@pytest.mark.parametrize("mode", ["greedy", "seeded", "stochastic", "unseeded top-k 1"])
def test_any_layout_verifies_as_the_engine_layout(mode):
    """Rows permuted and mixed with NaN rows that belong to no request: the same tokens, counts and rows as the
    engine's layout, every request with its own drafts (ragged, one without any)."""
    counts = [3, 0, 4, 2]
    logits, drafts, generator = make_step(counts, seed=3)
    drafts[3] = int(logits[5].argmax())  # request 2 (rows 5..9) accepts its first draft when greedy
    target, bonus, cu = engine_layout(counts)
    logits_indices = torch.arange(logits.shape[0]) + 50  # the step's input tokens, at positions 100 + 2 * index
    positions = torch.arange(200) * 2 + 100
    draft_probs = torch.softmax(torch.randn(sum(counts), V, generator=generator), -1) if mode == "stochastic" else None
    top_k = torch.ones(4, dtype=torch.int32) if "top-k" in mode else None
    args = dict(temperature=torch.tensor([0.0, 0.9, 1.3, 0.7]), draft_probs=draft_probs, all_greedy=mode == "greedy",
                top_k=top_k)  # fmt: skip

    def seeded():  # every sampled request seeded (an unseeded one draws a fresh seed every call), or top-1
        return {} if mode.startswith("unseeded") else {b: torch.Generator().manual_seed(8 + b) for b in (1, 2, 3)}

    plain = verify(logits, drafts, cu, target, bonus, logits_indices, positions, generators=seeded(), **args)
    assert plain.logits is logits, "on the CPU the engine's layout is passed without a copy"
    for extra in (0, 5):
        moved = scramble(logits, target, bonus, logits_indices, extra, generator)
        got = verify(*moved[:1], drafts, cu, *moved[1:], positions, generators=seeded(), **args)
        assert torch.equal(got.output_token_ids, plain.output_token_ids)
        assert torch.equal(got.num_accepted, plain.num_accepted)
        assert torch.equal(got.logits, logits) and torch.equal(got.layout.target_rows, target)
    assert verification.stats()["invalid_requests"] == 0, "no junk row was read"
    if mode == "greedy":
        assert int(plain.num_accepted[2]) >= 1


def test_a_step_without_drafts():
    """Every request at K = 0 (prefills, or no drafter found anything): each bonus row, wherever it is, is sampled."""
    logits = torch.randn(7, V)
    bonus, cu = torch.tensor([5, 1, 3]), torch.zeros(3, dtype=torch.int32)
    layout = verification.chain_layout(torch.zeros(0, dtype=torch.int32), bonus, cu)
    assert layout.source_rows.tolist() == [5, 1, 3] and layout.target_rows.numel() == 0
    got = verify(logits, torch.zeros(0, dtype=torch.int32), cu, torch.zeros(0, dtype=torch.int32), bonus,
                 torch.arange(7), torch.arange(7) + 10, temperature=torch.tensor([0.0, 1.0, 0.5]),
                 generators={1: torch.Generator().manual_seed(3)})  # fmt: skip
    assert got.output_token_ids[0, 0] == logits[5].argmax() and got.num_accepted.tolist() == [0, 0, 0]
    drawn = sample(logits[[1]], SamplingParams.make(1, temperature=1.0, seed=3, offset=12)).tokens
    assert got.output_token_ids[1, 0] == drawn[0], "request 1 decides position 12 (its row's input sits at 11)"


def test_repeated_rows_read_as_copies():
    """Index tensors may name one row twice (vLLM's warm-up batch names row 0 for every row)."""
    counts = [1, 1]
    logits, drafts, _ = make_step(counts, seed=5)
    target, bonus, cu = torch.tensor([0, 0]), torch.tensor([0, 0]), torch.tensor([1, 2], dtype=torch.int32)
    copies = logits[0].expand(4, V).contiguous()
    zeros = torch.zeros(4, dtype=torch.long)
    for greedy in (True, False):
        args = dict(temperature=torch.tensor([0.0, 0.8]), all_greedy=greedy, generators={1: torch.Generator()})
        got = verify(logits, drafts, cu, target, bonus, zeros, zeros, **args)
        want = verify(copies, drafts, cu, *engine_layout(counts)[:2], zeros, zeros, **args)
        assert torch.equal(got.output_token_ids, want.output_token_ids)


def test_first_positions_are_the_decided_tokens():
    """vLLM's example step: requests with 3, 0, 2, 0, 1 drafts, scheduled 4, 100, 3, 100, 2 tokens after 10, 0,
    20, 0, 30 computed ones; a request's rows decide the tokens after its last scheduled one's K_b + 1 inputs."""
    counts, scheduled, computed = [3, 0, 2, 0, 1], [4, 100, 3, 100, 2], [10, 0, 20, 0, 30]
    positions = torch.cat([torch.arange(c, c + n) for c, n in zip(computed, scheduled)])  # the runner's positions
    cu_scheduled = torch.tensor(scheduled).cumsum(0)
    logits_indices = torch.cat([torch.arange(int(end) - k - 1, int(end)) for end, k in zip(cu_scheduled, counts)])
    assert logits_indices.tolist() == [0, 1, 2, 3, 103, 104, 105, 106, 206, 207, 208]  # vLLM's own example
    target, bonus, cu = engine_layout(counts)
    want = [c + n - k for c, n, k in zip(computed, scheduled, counts)]
    assert want == [11, 100, 21, 100, 31]  # request 0: 10 computed + its last accepted token, then its drafts
    layout = verification.chain_layout(target, bonus, cu)
    assert verification.first_positions(layout, logits_indices, positions, cu).tolist() == want
    logits = torch.randn(11, V)
    _, moved_target, moved_bonus, moved_indices = scramble(logits, target, bonus, logits_indices, 3, torch.Generator())
    layout = verification.chain_layout(moved_target, moved_bonus, cu)
    assert verification.first_positions(layout, moved_indices, positions, cu).tolist() == want


class OffsetGenerator:
    """A stand-in for a CUDA generator (Philox: an offset that vLLM's rewind of a discarded step moves back)."""

    device = torch.device("cuda")

    def __init__(self, seed):
        self.seed, self.offset = seed, 0

    def initial_seed(self):
        return self.seed

    def get_offset(self):
        return self.offset

    def set_offset(self, offset):
        assert offset >= 0, "a CUDA generator refuses a negative offset"
        self.offset = offset


def test_request_seeds_are_the_requests_own():
    big = 2**64 - 3  # torch seeds are unsigned 64-bit: the int64 with the same bits
    cpu = torch.Generator().manual_seed(big)
    state = cpu.get_state()
    philox = OffsetGenerator(12)
    first = verification.request_seeds(4, {1: cpu, 3: philox, 7: torch.Generator()}, torch.device("cpu"))
    second = verification.request_seeds(4, {1: cpu, 3: philox}, torch.device("cpu"))
    assert first[1] == second[1] == -3 and first[3] == second[3] == 12
    assert first[0] != second[0] and first[2] != second[2], "unseeded requests: a fresh seed every step"
    assert torch.equal(cpu.get_state(), state), "nothing drawn from a CPU generator"
    assert philox.offset == 8, "an offset-keeping generator moves by one draw per step: vLLM's rewind stays >= 0"
    philox.set_offset(philox.get_offset() - 4)  # what vLLM does after a step whose token it discards


def test_seeded_deterministic_drafts_emit_plain_samplings_tokens():
    """With offset = the position of the first decided token, a seeded request's tokens are ``sample``'s draws
    at those positions with its seed (the deterministic rule: sample, then compare), whatever it drafted."""
    counts = [4, 3]
    logits, drafts, _ = make_step(counts, seed=6)
    target, bonus, cu = engine_layout(counts)
    positions = torch.tensor([20, 21, 22, 23, 24, 60, 61, 62, 63])  # request 0 decides 21.., request 1 decides 61..
    temperature = torch.tensor([1.0, 0.8])
    row_seed = torch.tensor([41] * 5 + [42] * 4)
    drawn = sample(logits, SamplingParams.make(9, temperature=temperature.repeat_interleave(torch.tensor([5, 4])),
                                               seed=row_seed, offset=positions + 1)).tokens  # fmt: skip
    drafts[:2] = drawn[:2]  # request 0 drafts sample's first two tokens, then (most likely) a wrong one
    generators = {0: torch.Generator().manual_seed(41), 1: torch.Generator().manual_seed(42)}
    got = verify(logits, drafts, cu, target, bonus, torch.arange(9), positions, temperature=temperature,
                 generators=generators)  # fmt: skip
    assert int(got.num_accepted[0]) >= 2
    for b, first in enumerate((0, 5)):
        emitted = int(got.num_accepted[b]) + 1
        assert got.output_token_ids[b, :emitted].tolist() == drawn[first : first + emitted].tolist()


def test_v2_offset_is_the_first_decided_position():
    """Model Runner V2: ``pos`` is each row's input position; the request's tokens are ``sample``'s at pos + 1."""
    logits, _, _ = make_step([2], seed=7)
    pos = torch.tensor([30, 31, 32])
    drawn = sample(logits, SamplingParams.make(3, temperature=1.0, seed=5, offset=pos + 1)).tokens
    sampled = torch.cat([torch.tensor([0]), drawn[:2].long()])  # row 0's input is the last token, then the drafts
    tokens, num_sampled = verification.verify_v2_batch(
        logits, sampled, torch.tensor([0, 3], dtype=torch.int32), pos, torch.tensor([0]), temperature=torch.ones(1),
        seeds=torch.tensor([5]), draft_logits=None, num_speculative_steps=2, all_greedy=False,
    )  # fmt: skip
    assert num_sampled.tolist() == [3] and tokens[0].tolist() == drawn.tolist()


def test_sampled_batch_needs_positions():
    counts = [1]
    logits, drafts, _ = make_step(counts, seed=1)
    target, bonus, cu = engine_layout(counts)
    greedy = verify(logits, drafts, cu, target, bonus, torch.arange(2), None, temperature=None, all_greedy=True)
    assert greedy.output_token_ids.shape == (1, 2)
    with pytest.raises(ValueError, match="token_positions"):
        verify(logits, drafts, cu, target, bonus, torch.arange(2), None, temperature=torch.ones(1))
