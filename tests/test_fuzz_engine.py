"""Property-based tests (hypothesis) over ``SpeculativeDecoder.generate``'s argument space.

On a tiny random model, with every strategy (NoDraft, n-gram, a draft chain), any mix of
prompts, max_new_tokens, temperature, top_k, top_p, seed, eos ids and the positions opt-in:
each call either returns valid output (tokens in the vocabulary, at most max_new_tokens per
request, a documented finish reason consistent with the tokens; greedy rows equal plain greedy
decoding) or raises TypeError / ValueError -- the same one ``validate`` raises before anything
runs, whose message starts with the argument's name. Never another exception, an invalid
request or an out-of-range token.

Runs are derandomized (the same examples on every machine) and have no deadline: a loaded
2-core CI machine makes timings meaningless, and every call is bounded (at most 8 tokens).
"""

import math
import re

import numpy as np
import pytest
import torch
from helpers import random_model, tiny_config
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from specdec._backend import use_backend
from specdec.decoding import FINISH_REASONS, DraftModelStrategy, NgramStrategy, NoDraft, SpeculativeDecoder

VOCAB, POSITIONS, EOS = 64, 14, 3  # positions small enough that prompt + max_new_tokens often exceeds them
TARGET = random_model(tiny_config(max_position_embeddings=POSITIONS, eos_token_ids=(EOS,)), seed=0)
DRAFT = random_model(tiny_config(max_position_embeddings=POSITIONS, eos_token_ids=(EOS,)), seed=1)
ARGUMENTS = ("prompts", "max_new_tokens", "temperature", "top_k", "top_p", "seed", "eos_token_id",
             "allow_beyond_max_positions")  # fmt: skip
NAMED = re.compile(rf"^({'|'.join(ARGUMENTS)})(\[\d+\])* ")

FUZZ = settings(
    derandomize=True, database=None, deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)  # fmt: skip


def make_strategy(kind: str, k: int):
    if kind == "chain":
        return DraftModelStrategy(DRAFT, (1,) * k)
    return NgramStrategy(num_draft=k) if kind == "ngram" else NoDraft()


# ---- argument values: valid ones, and wrong ones of every kind --------------------------------------

token = st.integers(0, VOCAB - 1)
prompt = st.one_of(
    st.lists(token, min_size=1, max_size=10),
    st.lists(token, min_size=1, max_size=10).map(lambda p: np.array(p, dtype=np.int64)),
    st.lists(token, min_size=1, max_size=10).map(torch.tensor),
    st.lists(token, min_size=1, max_size=4).map(lambda p: [np.int64(t) for t in p]),
)
bad_prompt = st.sampled_from([[], [VOCAB], [-1], [1.0], [True], "text", 7, [[1, 2]], np.ones((2, 2), dtype=np.int64)])
VALID = {
    "max_new_tokens": st.integers(0, 8) | st.integers(0, 8).map(np.int64),
    "temperature": st.sampled_from([0.0, 0.0, 1e-30, 0.3, 1.0, 1.7]) | st.floats(0.05, 2.0) | st.just(np.float32(0.8)),
    "top_k": st.integers(0, VOCAB),
    "top_p": st.floats(0.05, 1.0) | st.just(1.0),
    "seed": st.none() | st.integers(-(2**63), 2**63 - 3),
    "eos_token_id": st.sampled_from([list(range(0, VOCAB, 3)), "config", None, EOS, [EOS, 5], np.int64(9)]),
    "allow_beyond_max_positions": st.booleans(),
}
INVALID = {
    "max_new_tokens": st.sampled_from([-1, 2.5, True, "4", 2**31, None]),
    "temperature": st.sampled_from([-0.5, math.nan, math.inf, 1e-40, 1e-31, "hot", True, None]),
    "top_k": st.sampled_from([-1, VOCAB + 1, 1.5, 10**10, None, True]),
    "top_p": st.sampled_from([0.0, 1.5, math.nan, -1.0, "0.9", None]),
    "seed": st.sampled_from([2**70, 1.5, -(2**63) - 1, "7", True]),
    "eos_token_id": st.sampled_from([VOCAB, -1, "eos", 2.0, [EOS, VOCAB], True]),
    "allow_beyond_max_positions": st.sampled_from([1, "yes", None, 0]),
}
PER_REQUEST = ("max_new_tokens", "temperature", "top_k", "top_p", "seed")
ONE_EACH = {"seed": st.integers(-(2**63), 2**63 - 1)}  # a request's own seed (None is for the whole batch only)


@st.composite
def arguments(draw, corrupt: bool):
    """(prompts, options, the argument made wrong or None); each argument is left out (its default) half the time."""
    batch = draw(st.integers(1, 3))
    prompts = draw(st.lists(prompt, min_size=batch, max_size=batch))
    options = {}
    for name, valid in VALID.items():
        # Left out, an argument takes its default: max_new_tokens 64 is beyond POSITIONS (refused unless the
        # opt-in is given), so the valid-only test always bounds the run.
        if name == "max_new_tokens" and not corrupt or draw(st.booleans()):
            one_each = name in PER_REQUEST and draw(st.booleans())
            each = st.lists(ONE_EACH.get(name, valid), min_size=batch, max_size=batch)
            options[name] = draw(each if one_each else valid)
    wrong = draw(st.sampled_from((*VALID, "prompts"))) if corrupt else None
    if wrong == "prompts":
        if draw(st.booleans()):
            prompts[draw(st.integers(0, batch - 1))] = draw(bad_prompt)
        else:
            prompts = draw(st.sampled_from(["text", 5, [], None]))
    elif wrong is not None:
        if wrong in PER_REQUEST and draw(st.booleans()):  # a list with one wrong value, or of the wrong length
            values = draw(st.lists(ONE_EACH.get(wrong, VALID[wrong]), min_size=batch, max_size=batch))
            if draw(st.booleans()):
                values[draw(st.integers(0, batch - 1))] = draw(INVALID[wrong])
            else:
                values.append(values[0])
            options[wrong] = values
        else:
            options[wrong] = draw(INVALID[wrong])
    return prompts, options, wrong


def check_run(kind: str, k: int, prompts, options, wrong) -> None:
    decoder = SpeculativeDecoder(TARGET, make_strategy(kind, k))
    try:
        req = decoder.validate(prompts, **options)
    except (TypeError, ValueError) as refusal:
        message = str(refusal)
        assert NAMED.match(message), f"the message does not start with an argument's name: {message}"
        # It names the wrong argument; without one, only prompt + max_new_tokens beyond the model is refused.
        assert wrong in message if wrong else "max_position_embeddings" in message, message
        with pytest.raises(type(refusal)) as again:
            decoder.generate(prompts, **options)
        assert str(again.value) == message  # the same refusal, raised before anything ran
        event(f"refused: {NAMED.match(message).group(1)} (wrong: {wrong})")
        return
    assert wrong is None, f"{wrong}={options.get(wrong, prompts)!r} was accepted"
    result = decoder.generate(prompts, **options)
    event(f"ran: {', '.join(sorted({s.finish_reason for s in result.stats}))}")
    assert len(result.tokens) == len(result.stats) == req.batch_size
    for b, (tokens, stats) in enumerate(zip(result.tokens, result.stats)):
        limit = req.max_new_tokens[b]
        assert all(isinstance(t, int) and 0 <= t < VOCAB for t in tokens), tokens
        assert len(tokens) == stats.generated <= limit
        assert stats.finish_reason in FINISH_REASONS and stats.finish_reason != "invalid"
        if stats.finish_reason == "length":
            assert len(tokens) == limit and not any(t in req.eos for t in tokens)
        else:
            assert tokens and tokens[-1] in req.eos and not any(t in req.eos for t in tokens[:-1])
    greedy = [b for b in range(req.batch_size) if req.temperature[b] == 0]
    if greedy and kind != "none":  # speculation never changes a greedy request's tokens
        plain = SpeculativeDecoder(TARGET, NoDraft()).generate(prompts, **options).tokens
        assert [result.tokens[b] for b in greedy] == [plain[b] for b in greedy]


kinds = st.sampled_from(["none", "ngram", "chain"])


@settings(FUZZ, max_examples=200)
@given(kind=kinds, k=st.integers(1, 3), args=arguments(corrupt=False))
def test_valid_arguments_give_valid_output(kind, k, args):
    with use_backend("torch"):
        check_run(kind, k, *args)


@settings(FUZZ, max_examples=200)
@given(kind=kinds, k=st.integers(1, 3), args=arguments(corrupt=True))
def test_a_wrong_argument_is_refused_by_name(kind, k, args):
    with use_backend("torch"):
        check_run(kind, k, *args)
