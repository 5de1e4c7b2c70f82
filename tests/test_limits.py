"""The engine's argument layer: integers stay integers, ranges are named, positions and memory are bounded.

Everything here is refused (or accepted) before anything runs: the messages name the argument
and the allowed range, or the numbers that do not fit.
"""

import numpy as np
import pytest
import torch
from helpers import random_model, tiny_config

from specdec import validation
from specdec.decoding import DraftModelStrategy, NgramStrategy, SpeculativeDecoder
from specdec.decoding.autoregressive import generate as autoregressive_generate
from specdec.model import LlamaModel
from specdec.model.kv_cache import KVCache
from specdec.validation import MIN_TEMPERATURE, InsufficientMemoryError

pytestmark = pytest.mark.usefixtures("torch_backend")
VOCAB, POSITIONS = 64, 32


@pytest.fixture(scope="module")
def target():
    return random_model(tiny_config(max_position_embeddings=POSITIONS), seed=0)


@pytest.fixture(scope="module")
def draft():
    return random_model(tiny_config(max_position_embeddings=POSITIONS), seed=1)


def generate(model, prompts, strategy=None, **options):
    return SpeculativeDecoder(model, strategy).generate(prompts, **options)


# ---- integers stay integers ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "options, match",
    [
        ({"max_new_tokens": 2.5}, r"^max_new_tokens must be an int, got 2.5 \(float\)$"),
        ({"max_new_tokens": 3.0}, r"^max_new_tokens must be an int, got 3.0 \(float\)$"),
        ({"max_new_tokens": True}, r"^max_new_tokens must be an int, got True \(bool\)$"),
        ({"max_new_tokens": [2, 2.5]}, r"^max_new_tokens\[1\] must be an int, got 2.5 \(float\)$"),
        ({"top_k": 1.5}, r"^top_k must be an int, got 1.5 \(float\)$"),
        ({"seed": 1.5}, r"^seed must be an int, got 1.5 \(float\)$"),
        ({"seed": [1, 1.5]}, r"^seed\[1\] must be an int, got 1.5 \(float\)$"),
        ({"eos_token_id": 2.0}, r"^eos_token_id must be an int, got 2.0 \(float\)$"),
        ({"temperature": "0.5"}, r"^temperature must be a number, got '0.5' \(str\)$"),
        ({"top_p": True}, r"^top_p must be a number, got True \(bool\)$"),
        ({"allow_beyond_max_positions": 1}, r"^allow_beyond_max_positions must be a bool, got 1$"),
    ],
)
def test_floats_and_bools_are_refused_not_truncated(target, options, match):
    with pytest.raises(TypeError, match=match):
        generate(target, [[1, 2], [3]], **options)


def test_numpy_integers_and_arrays_are_accepted(target):
    expected = generate(target, [[1, 2, 3], [4, 5]], max_new_tokens=[5, 3], temperature=0.7, top_k=9, seed=[3, 4])
    as_numpy = generate(
        target,
        [np.array([1, 2, 3], dtype=np.int64), [np.int64(4), np.int32(5)]],  # np.int64 token ids
        max_new_tokens=np.array([5, 3]),
        temperature=np.float32(0.7),
        top_k=np.int64(9),
        seed=np.array([3, 4], dtype=np.uint64),
        eos_token_id=np.array([], dtype=np.int64),
    )
    torch_prompts = generate(
        target, [torch.tensor([1, 2, 3]), torch.tensor([4, 5], dtype=torch.int32)],
        max_new_tokens=torch.tensor([5, 3]), temperature=0.7, top_k=torch.tensor(9), seed=torch.tensor([3, 4]),
    )  # fmt: skip
    assert as_numpy.tokens == expected.tokens == torch_prompts.tokens
    assert [len(t) for t in expected.tokens] == [5, 3]


@pytest.mark.parametrize(
    "prompts, error, match",
    [
        ("hello", TypeError, r"^prompts must be a list of prompts"),
        (5, TypeError, r"^prompts must be a list of prompts"),
        ([5], TypeError, r"^prompts\[0\] must be a sequence of token ids, got int$"),
        ([[1, np.int64(VOCAB)]], ValueError, r"^prompts\[0\]\[1\] must be an int in \[0, 63\] \(a token id\), got 64$"),
        ([[1, -1]], ValueError, r"^prompts\[0\]\[1\] must be an int in \[0, 63\] \(a token id\), got -1$"),
        ([[1, 2.0]], TypeError, r"^prompts\[0\]\[1\] must be an int, got 2.0 \(float\)$"),
        ([np.ones((2, 2), dtype=np.int64)], ValueError, r"^prompts\[0\] must be 1-D, got shape \(2, 2\)$"),
    ],
)
def test_bad_prompts_are_named(target, prompts, error, match):
    with pytest.raises(error, match=match):
        SpeculativeDecoder(target).validate(prompts)


# ---- ranges ------------------------------------------------------------------------------------


def test_top_k_is_bounded_by_the_vocabulary(target):
    with pytest.raises(ValueError, match=rf"^top_k must be an int in \[0, {VOCAB}\] \(0 = off\), got 10000000000$"):
        generate(target, [[1]], top_k=10_000_000_000)
    with pytest.raises(ValueError, match=r"^top_k\[1\] must be an int in \[0, 64\] \(0 = off\), got 65$"):
        generate(target, [[1], [2]], top_k=[0, VOCAB + 1])
    # top_k = vocab keeps every token: the same draws as top_k off.
    options = dict(max_new_tokens=8, temperature=1.0, seed=11)
    assert generate(target, [[1, 2]], top_k=VOCAB, **options).tokens == generate(target, [[1, 2]], **options).tokens


def test_seeds_must_fit_in_64_bits(target):
    top = 2**63 - 1
    with pytest.raises(ValueError, match=r"^seed must be an int in \[-9223372036854775808, 9223372036854775807\] "
                       r"\(a 64-bit int\), got 1180591620717411303424$"):  # fmt: skip
        generate(target, [[1]], seed=2**70)
    with pytest.raises(ValueError, match=r"^seed\[0\] must be an int in \[-9223372036854775808, 9223372036854775807\]"):
        generate(target, [[1]], seed=[2**63])
    # An int seed gives request b seed + b: the last request's seed must fit too.
    with pytest.raises(ValueError, match=rf"^seed must be an int in \[-9223372036854775808, {top - 1}\] "
                       r"\(request b uses seed \+ b, a 64-bit int\), got 9223372036854775807$"):  # fmt: skip
        generate(target, [[1], [2]], seed=top)
    extremes = generate(target, [[1], [2]], max_new_tokens=3, temperature=1.0, seed=[top, -(2**63)])
    pairs = (([1], top), ([2], -(2**63)))
    alone = [generate(target, [p], max_new_tokens=3, temperature=1.0, seed=s).tokens[0] for p, s in pairs]
    assert extremes.tokens == alone


def test_temperature_below_the_float32_floor_is_refused_and_the_floor_samples_like_greedy(target):
    for bad in (1e-40, 1e-35, -0.5, float("inf"), float("nan")):
        with pytest.raises(ValueError, match=r"^temperature must be 0 \(greedy\) or a finite float >= 1e-30"):
            generate(target, [[1, 2, 3]], temperature=bad)
    with pytest.raises(ValueError, match=r"^temperature\[1\] must be 0 \(greedy\)"):
        generate(target, [[1], [2]], temperature=[0.5, 1e-40])
    # At the floor the scaled logits stay finite: no 'invalid' request, and sampling is the argmax.
    options = dict(max_new_tokens=12, eos_token_id=None)
    greedy = generate(target, [[1, 2, 3], [4]], temperature=0.0, **options)
    coldest = generate(target, [[1, 2, 3], [4]], temperature=MIN_TEMPERATURE, seed=5, **options)
    assert coldest.tokens == greedy.tokens
    assert [s.finish_reason for s in coldest.stats] == ["length", "length"]


def test_eos_ids_must_be_token_ids(target):
    with pytest.raises(ValueError, match=r"^eos_token_id must be an int in \[0, 63\] \(a token id\), got -1$"):
        generate(target, [[1]], eos_token_id=-1)
    with pytest.raises(ValueError, match=r"^eos_token_id\[1\] must be an int in \[0, 63\] \(a token id\), got 64$"):
        generate(target, [[1]], eos_token_id=[3, VOCAB])


# ---- positions ------------------------------------------------------------------------------------


def test_positions_beyond_the_model_are_refused_unless_asked_for(target, draft):
    prompts = [[1] * 5, [2] * 20]
    refusal = (
        r"^prompts\[1\] \(20 tokens\) \+ max_new_tokens \(13\) = 33 tokens, beyond the model's "
        r"max_position_embeddings \(32\); .* pass allow_beyond_max_positions=True to run past"
    )
    with pytest.raises(ValueError, match=refusal):
        generate(target, prompts, max_new_tokens=13)
    with pytest.raises(ValueError, match=r"^prompts\[0\] \(40 tokens\) \+ max_new_tokens \(0\) = 40 tokens, beyond"):
        generate(target, [[1] * 40], max_new_tokens=0)
    fits = generate(target, prompts, DraftModelStrategy(draft, (1, 1)), max_new_tokens=[27, 12], eos_token_id=None)
    assert [len(t) for t in fits.tokens] == [27, 12]
    # Opting in runs past max_position_embeddings (here through the autoregressive wrapper too).
    beyond = generate(target, prompts, max_new_tokens=30, eos_token_id=None, allow_beyond_max_positions=True)
    assert [len(t) for t in beyond.tokens] == [30, 30]
    plain = autoregressive_generate(
        target, prompts, max_new_tokens=30, eos_token_id=None, allow_beyond_max_positions=True
    )
    assert plain == beyond.tokens


def test_a_700_token_prompt_on_a_512_position_model_is_refused_before_anything_runs():
    model = LlamaModel(tiny_config(max_position_embeddings=512)).requires_grad_(False)
    decoder = SpeculativeDecoder(model)
    with pytest.raises(ValueError, match=r"prompts\[0\] \(700 tokens\) \+ max_new_tokens \(64\) = 764 tokens, "
                       r"beyond the model's max_position_embeddings \(512\)"):  # fmt: skip
        next(iter(decoder.stream([[1] * 700])))
    assert decoder.stats == []  # nothing ran


# ---- memory ---------------------------------------------------------------------------------------


def test_caches_beyond_the_memory_available_are_refused_naming_max_new_tokens(target, draft, monkeypatch):
    # tiny_config: 2 layers x K/V x 1 KV head x 16 x fp32 = 256 bytes per cached token.
    monkeypatch.setattr(validation, "available_memory", lambda device: 2**20)  # 1 MiB
    with pytest.raises(InsufficientMemoryError, match=r"^KV cache \(2, 2, 2, 2000006, 1, 16\) needs 976.6 MiB, more "
                       r"than 90% of the 1.0 MiB available on cpu; lower max_new_tokens \(2000000; caches hold prompt "
                       r"\+ max_new_tokens\) or the batch \(2\)$"):  # fmt: skip
        generate(target, [[1, 2, 3], [4]], NgramStrategy(num_draft=4), max_new_tokens=2_000_000,
                 allow_beyond_max_positions=True)  # fmt: skip
    assert len(generate(target, [[1, 2, 3], [4]], max_new_tokens=16, eos_token_id=None).tokens[1]) == 16

    # The draft's cache is checked (and blamed on max_new_tokens) too: here only the target's fits.
    answers = iter([2**30, 2**10])
    monkeypatch.setattr(validation, "available_memory", lambda device: next(answers))
    with pytest.raises(InsufficientMemoryError, match=r"lower max_new_tokens \(20; caches hold"):
        generate(target, [[1, 2, 3]], DraftModelStrategy(draft, (1, 1)), max_new_tokens=20)


def test_nine_terabytes_of_cache_are_refused_on_any_machine():
    # The embedded target's geometry: 9 layers x 4 KV heads x 32, fp32 = 9 KiB per token.
    config = tiny_config(num_layers=9, num_heads=4, num_kv_heads=4, head_dim=32, max_position_embeddings=512)
    model = LlamaModel(config).requires_grad_(False)
    with pytest.raises(InsufficientMemoryError, match=r"^KV cache \(9, 2, 1, 1000000002, 4, 32\) needs 8.4 TiB, more "
                       r"than 90% of the .* available on cpu; lower max_new_tokens \(1000000000"):  # fmt: skip
        generate(model, [[1, 2, 3]], max_new_tokens=10**9, allow_beyond_max_positions=True)


def test_kv_cache_checks_memory_before_allocating(monkeypatch):
    monkeypatch.setattr(validation, "available_memory", lambda device: 2**20)
    shape = dict(dtype=torch.float32, device="cpu")
    with pytest.raises(InsufficientMemoryError, match=r"^KV cache \(2, 2, 4, 4096, 1, 16\) needs 4.0 MiB, .* lower "
                       r"max_len or batch_size$"):  # fmt: skip
        KVCache(2, 4, 1, 16, max_len=4096, **shape)
    with pytest.raises(InsufficientMemoryError, match=r"^paged KV cache \(2, 2, 1024, 16, 1, 16\) needs 4.0 MiB, .* "
                       r"lower num_blocks$"):  # fmt: skip
        KVCache(2, 4, 1, 16, max_len=4096, layout="paged", **shape)
    assert KVCache(2, 4, 1, 16, max_len=64, **shape).data.shape == (2, 2, 4, 64, 1, 16)
    assert KVCache(2, 4, 1, 16, max_len=4096, layout="paged", num_blocks=8, **shape).data.shape[2] == 8
