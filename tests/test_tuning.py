"""Launch configurations (``specdec.kernels.tuning``): defaults, declared tuning spaces, pinned and recorded
configurations, captured launches, and the autotuner wiring.

Every candidate a space declares must compute what the default computes: on the CPU the interpreter
runs each candidate that changes a tile size against the op's reference (warps and pipelining depth
do not exist in the interpreter; ``bench/compile_matrix.py`` compiles every candidate for sm_90 and
sm_80 instead).
"""

import inspect
import sys

import pytest
import torch
from common import triton_kernels
from helpers import assert_close
from test_tree_attention import TOL as ATTENTION_TOL
from test_tree_attention import Batch, chain, random_tree

import specdec.kernels  # noqa: F401  (registers every kernel module)
from specdec import _backend
from specdec.kernels import SamplingParams, apply_rotary, counter_uniform, rms_norm, tuning, verify_chain
from specdec.kernels.rotary import apply_rotary_reference
from specdec.kernels.top_k_top_p import filter_thresholds_reference, filter_thresholds_triton, scaled_logits
from specdec.kernels.tree_attention_tiles import attention_space
from specdec.kernels.uniforms import counter_uniform_reference

pytestmark = pytest.mark.skipif(not _backend.triton_status()[0], reason="triton is not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
mod = lambda name: sys.modules[f"specdec.kernels.{name}"]  # noqa: E731  (names shadowed by the public functions)


def tile_candidates(space: tuning.TuningSpace) -> list[dict]:
    """The candidates that differ in a tile size (what the interpreter can tell apart), complete configs."""
    seen, picked = set(), []
    for config in space.configs:
        tiles = tuple((k, v) for k, v in config.items() if k not in tuning.PERF_KEYS)
        if tiles and tiles not in seen:
            seen.add(tiles)
            picked.append(config)
    return picked


def ids(configs):
    return [tuning.describe(c) for c in configs]


# ---------------------------------------------------------------- every tile candidate against the reference


ATTENTION = attention_space(16, 32, False)  # the 16-row fp16 tile of the test below (fp16: bf16 dots are wrong
# in Triton 3.9's interpreter)


@pytest.mark.parametrize("config", tile_candidates(ATTENTION), ids=ids(tile_candidates(ATTENTION)))
def test_attention_candidates(config):
    trees = [random_tree(9), chain(3)]
    batch = Batch([5, 70], trees, hq=4, hkv=2, d=32, dtype=torch.float16, device=DEVICE, paged=True)
    with _backend.use_backend("triton"), tuning.use_config("tree_attention_kernel", config):
        tuning.clear_chosen()
        out, lse = batch.run()
        assert tuning.chosen_configs()["tree_attention_kernel"] == config
    ref_out, ref_lse = batch.oracle()
    assert_close(out, ref_out, *ATTENTION_TOL[torch.float16], "out")
    assert_close(lse, ref_lse, *ATTENTION_TOL[torch.float16], "lse")


THRESHOLD = mod("top_k_top_p").THRESHOLD_SPACE


@pytest.mark.parametrize("config", tile_candidates(THRESHOLD), ids=ids(tile_candidates(THRESHOLD)))
def test_threshold_candidates(config):
    rows, vocab = 6, 1500  # several tiles of every candidate width
    logits = torch.randn(rows, vocab) * 3
    logits[0, :40] = logits[0, 40:80]  # ties at the threshold
    temp = torch.tensor([1.0, 0.5, 1.0, 0.0, 2.0, 0.9])
    top_k = torch.tensor([12, 300, 5, 3, 0, 1100], dtype=torch.int32)
    top_p = torch.tensor([1.0, 0.9, 0.5, 0.5, 0.3, 0.75])
    with tuning.use_config("_threshold_kernel", config):
        got, _ = filter_thresholds_triton(*(t.to(DEVICE) for t in (logits, temp, top_k, top_p)), block=64)
    expected = filter_thresholds_reference(scaled_logits(logits, temp), temp, top_k, top_p)
    assert torch.equal(got.cpu(), expected), f"{got}\n{expected}"


WALK = mod("tree_walk").TREE_WALK_SPACE


@pytest.mark.parametrize("config", tile_candidates(WALK), ids=ids(tile_candidates(WALK)))
def test_tree_walk_candidates(config):
    # the final draw's steps of TILES tiles, a partial last step included (V = 1500: 3 tiles of 512)
    vocab, k = 1500, 3
    i32 = dict(dtype=torch.int32, device=DEVICE)
    logits = (torch.randn(2 * (k + 1), vocab) * 2).to(DEVICE)
    drafts = torch.randint(0, vocab, (2 * k,), **i32)
    offsets = torch.tensor([0, k, 2 * k], **i32)
    q = torch.softmax(torch.randn(2 * k, vocab), -1).to(DEVICE)
    params = SamplingParams.make(2, temperature=[1.0, 0.7], top_p=[1.0, 0.9], seed=[5, 6], device=DEVICE)
    results = {}
    for backend in ("triton", "torch"):
        with _backend.use_backend(backend), tuning.use_config("_tree_walk_kernel", config):
            results[backend] = [
                verify_chain(logits, drafts, offsets, params, rule="stochastic", draft_probs=q, max_draft_len=k),
                verify_chain(logits, drafts, offsets, params, rule="deterministic", max_draft_len=k),
            ]
    for fast, ref in zip(results["triton"], results["torch"]):
        assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(fast, ref)), (fast, ref)


SILU = mod("silu_mul").SILU_MUL_SPACE  # warps only: no tile to tell apart in the interpreter


ROTARY = mod("rotary").ROTARY_SPACE


@pytest.mark.parametrize("config", tile_candidates(ROTARY), ids=ids(tile_candidates(ROTARY)))
def test_rotary_candidates(config):
    qkv = torch.randn(5, 11 + 2 * 3, 64).to(DEVICE)  # 11 query heads, 3 KV heads: partial head blocks
    q, k = qkv[:, :11], qkv[:, 11:14]
    positions = torch.randint(0, 4096, (5,)).to(DEVICE)
    freq = (1.0 / 10000.0 ** (torch.arange(0, 64, 2) / 64)).to(DEVICE)
    expected_q, expected_k = apply_rotary_reference(q, k, positions, freq)
    with _backend.use_backend("triton"), tuning.use_config("_rotary_kernel", config):
        apply_rotary(q, k, positions, freq)
    assert_close(q, expected_q, 2e-5, 2e-5, "q")
    assert_close(k, expected_k, 2e-5, 2e-5, "k")


UNIFORM = mod("uniforms").COUNTER_UNIFORM_SPACE


@pytest.mark.parametrize("config", tile_candidates(UNIFORM), ids=ids(tile_candidates(UNIFORM)))
def test_counter_uniform_candidates(config):
    n = 1300
    seed, offset = torch.randint(0, 2**62, (n,)), torch.randint(0, 2**40, (n,))
    counter = torch.randint(0, 100, (n,))
    with _backend.use_backend("triton"), tuning.use_config("_counter_uniform_kernel", config):
        got = counter_uniform(seed.to(DEVICE), offset.to(DEVICE), counter.to(DEVICE))
    assert torch.equal(got.cpu(), counter_uniform_reference(seed, offset, counter))


# ---------------------------------------------------------------- the machinery


def test_spaces_declare_complete_configurations():
    # every candidate sets what its launcher's default sets, so a pinned or tuned config replaces it whole
    spaces = {
        "_rms_norm_kernel": (mod("rms_norm").RMS_NORM_SPACE, {"num_warps"}),
        "_rotary_kernel": (ROTARY, {"HEAD_BLOCK", "num_warps"}),
        "_silu_mul_kernel": (SILU, {"num_warps"}),  # its tile follows the row (EVEN), not the tuner
        "_threshold_kernel": (THRESHOLD, {"BLOCK", "num_warps"}),
        "_counter_uniform_kernel": (UNIFORM, {"BLOCK", "num_warps"}),
        "tree_attention_kernel": (attention_space(64, 128, False), {"BLOCK_N", "num_warps"}),
    }
    for name, (space, needed) in spaces.items():
        assert space.configs, name
        for config in space.configs:
            assert needed <= set(config), f"{name}: {config} lacks {needed - set(config)}"


def test_capture_records_launches_without_running_them():
    x = torch.randn(3, 40).to(DEVICE)
    out = torch.full_like(x, float("nan"))
    with _backend.use_backend("triton"), tuning.capture_launches() as launches:
        mod("rms_norm").rms_norm_op.triton(x, torch.ones(40, device=DEVICE), 1e-5, out)
    assert torch.isnan(out).all()  # nothing ran
    (launch,) = launches
    assert launch.name == "_rms_norm_kernel" and launch.grid == (3,)
    assert launch.meta == {"ADD_RESIDUAL": False, "BLOCK": 64, "EVEN": False} and launch.config == {"num_warps": 4}
    assert launch.space is mod("rms_norm").RMS_NORM_SPACE


def test_chosen_configs_follow_pins_and_reset():
    x = torch.randn(2, 300).to(DEVICE)
    with _backend.use_backend("triton"):
        tuning.clear_chosen()
        rms_norm(x, torch.ones(300, device=DEVICE), 1e-5)
        assert tuning.chosen_configs() == {"_rms_norm_kernel": {"num_warps": 4}}
        with tuning.use_config("_rms_norm_kernel", {"num_warps": 16}):
            rms_norm(x, torch.ones(300, device=DEVICE), 1e-5)
            assert tuning.chosen_configs()["_rms_norm_kernel"] == {"num_warps": 16}
        rms_norm(x, torch.ones(300, device=DEVICE), 1e-5)  # the pin is gone after the block
        assert tuning.chosen_configs()["_rms_norm_kernel"] == {"num_warps": 4}
        tuning.clear_chosen()
        assert tuning.chosen_configs() == {}
    assert tuning.describe({"BLOCK_N": 64, "num_warps": 8, "num_stages": 2}) == "BLOCK_N=64 w8 s2"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's behaviour")
def test_autotuning_is_ignored_by_the_interpreter():
    x = torch.randn(2, 300)
    tuning.set_autotune(True)
    try:
        with _backend.use_backend("triton"):
            tuning.clear_chosen()
            rms_norm(x, torch.ones(300), 1e-5)
    finally:
        tuning.set_autotune(None)
    assert tuning.chosen_configs() == {"_rms_norm_kernel": {"num_warps": 4}}


def test_autotuner_wiring():
    # what a GPU run with SPECDEC_AUTOTUNE=1 builds: the default first, then the candidates, the space's key
    # and the arguments to restore between trials
    import triton

    space = mod("rotary").ROTARY_SPACE
    default = {"HEAD_BLOCK": 8, "num_warps": 4}
    tuned = tuning._autotuner(mod("rotary")._rotary_kernel, tuning._frozen((default, *space.configs)), space.key,
                              space.restore)  # fmt: skip
    assert isinstance(tuned, triton.runtime.Autotuner)
    assert (tuned.configs[0].kwargs, tuned.configs[0].num_warps) == ({"HEAD_BLOCK": 8}, 4)
    assert len(tuned.configs) == 1 + len(space.configs)  # the rotary space leaves its default out
    candidate = space.configs[0]  # a default that is also a candidate is tried once
    assert len(tuning._frozen((candidate, *space.configs))) == len(space.configs)
    assert tuned.keys == ["Hq", "Hkv", "HALF"] and tuned.restore_value == ["q_ptr", "k_ptr"]
    assert not mod("kv_compact").KV_COMPACT_SPACE.autotune  # in place and not idempotent: pinned, never trialled


# ---------------------------------------------------------------- SPECDEC_AUTOTUNE


@pytest.mark.parametrize("value, expected", [("1", True), ("0", False), ("", False), (" 1 ", True)])
def test_autotune_variable_values(value, expected):
    assert tuning.parse_autotune(value) is expected


@pytest.mark.parametrize("value", ["yes", "true", "off", "2", "-1", "1.0"])
def test_autotune_variable_refuses_other_values(value):
    with pytest.raises(ValueError, match=f"SPECDEC_AUTOTUNE must be 1 .* got '{value}'"):
        tuning.parse_autotune(value)


def test_autotune_variable_is_read_once_and_again_after_set_autotune(monkeypatch):
    x = torch.randn(2, 40).to(DEVICE)
    assert tuning._autotune is None  # no test left an override behind
    monkeypatch.setenv("SPECDEC_AUTOTUNE", "on")
    tuning.set_autotune(None)  # the variable changed in this process: read it at the next launch
    try:
        for _ in range(2):  # a refused value is never kept: every launch refuses it until it is fixed
            with _backend.use_backend("triton"), pytest.raises(ValueError, match="SPECDEC_AUTOTUNE must be 1"):
                rms_norm(x, torch.ones(40, device=DEVICE), 1e-5)  # refused at the launch, before anything runs
        monkeypatch.setenv("SPECDEC_AUTOTUNE", "1")
        assert tuning.autotune_enabled()
        monkeypatch.setenv("SPECDEC_AUTOTUNE", "0")
        assert tuning.autotune_enabled()  # kept until set_autotune
        tuning.set_autotune(False)
        assert not tuning.autotune_enabled()
        monkeypatch.setenv("SPECDEC_AUTOTUNE", "1")
        tuning.set_autotune(None)
        assert tuning.autotune_enabled()  # None follows the variable again, read anew
        monkeypatch.delenv("SPECDEC_AUTOTUNE")
        tuning.set_autotune(None)
        assert not tuning.autotune_enabled()
    finally:
        tuning.set_autotune(None)


# ---------------------------------------------------------------- every kernel's declared space


@pytest.fixture(scope="module")
def matrix_launches():
    """{kernel name: [Launch]} recorded from every case of the compile matrix (nothing runs)."""
    import compile_matrix

    launches = {}
    with _backend.use_backend("triton"):
        for thunk in compile_matrix.all_cases().values():
            with tuning.capture_launches() as recorded:
                thunk()
            for launch in recorded:
                launches.setdefault(launch.name, []).append(launch)
    return launches


def test_every_kernel_declares_a_valid_tuning_space(matrix_launches):
    assert set(matrix_launches) == triton_kernels()  # every Triton kernel is launched by some case
    for name, launches in matrix_launches.items():
        params = inspect.signature(launches[0].kernel.fn).parameters
        constexprs = {p for p, v in params.items() if "constexpr" in str(v.annotation)}
        for launch in launches:
            where = f"{name} {launch.meta}"
            space, config = launch.space, launch.config
            assert isinstance(space, tuning.TuningSpace) and space.configs, where
            # the launch names every argument once: positionally, as a meta-parameter or in the configuration
            named = list(params)[len(launch.args) :]
            assert sorted([*launch.meta, *(k for k in config if k not in tuning.PERF_KEYS)]) == sorted(named), where
            assert set(space.key) <= set(params), f"{where}: key {space.key} names no argument"
            for arg in space.restore:  # restored between trials: a tensor the kernel writes
                assert isinstance(launch.args[list(params).index(arg)], torch.Tensor), f"{where}: restore {arg}"
            if not space.autotune:
                assert space.restore == (), where
            assert len({tuple(sorted(c.items())) for c in space.configs}) == len(space.configs), f"{where}: duplicates"
            for candidate in (config, *space.configs):
                # a candidate replaces the default whole: the same keys, tiles among the constexprs, sane options
                assert set(candidate) == set(config), f"{where}: {candidate} vs the default {config}"
                assert {k for k in candidate if k not in tuning.PERF_KEYS} <= constexprs, where
                warps = candidate.get("num_warps", 4)
                assert warps in (1, 2, 4, 8, 16, 32), where
                assert candidate.get("num_stages", 1) >= 1, where
                assert 24 <= candidate.get("maxnreg", 255) <= 255, where  # registers per thread
