"""vLLM engines on the embedded pair, with and without the specdec plugin, and statistics helpers.

Small engines share this machine's cores: one thread, no core binding, in-process engine
core, 1 GiB of KV cache, float32, eager mode (no compilation). At most two engines are
alive at once; tests that share one sit next to each other.
"""

import gc
import json
import math
import os
from collections import OrderedDict
from pathlib import Path

for _name, _value in dict(VLLM_CPU_OMP_THREADS_BIND="nobind", VLLM_ENABLE_V1_MULTIPROCESSING="0",
                          VLLM_CPU_KVCACHE_SPACE="1", NUMBA_NUM_THREADS="1", OMP_NUM_THREADS="1").items():  # fmt: skip
    os.environ.setdefault(_name, _value)

import torch  # noqa: E402
from vllm import LLM  # noqa: E402
from vllm.platforms.cpu import CpuPlatform  # noqa: E402
from vllm.plugins import load_general_plugins  # noqa: E402

from specdec.integrations import vllm as plugin  # noqa: E402

PAIR = Path(__file__).resolve().parents[1] / "specdec" / "assets" / "pair"
TARGET, DRAFT = str(PAIR / "target"), str(PAIR / "draft")
HELD_OUT = [p["text"] for p in json.loads((PAIR / "eval" / "prompts.json").read_text())]

SPECS = {
    "none": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
    "draft": {"method": "draft_model", "model": DRAFT, "num_speculative_tokens": 3},
    # drafts drawn from the draft's distribution (not its argmax): the stochastic rule, draft_probs passed
    "draft_sampled": {"method": "draft_model", "model": DRAFT, "num_speculative_tokens": 3,
                      "draft_sample_method": "probabilistic"},  # fmt: skip
    "self_sampled": {"method": "draft_model", "model": TARGET, "num_speculative_tokens": 3,
                     "draft_sample_method": "probabilistic"},  # fmt: skip
}

# Entry points load once per process, on the first engine; load them now so that each
# engine below gets exactly the runner classes the test asks for (register / unregister).
load_general_plugins()


def _register_kernel_overrides_once(register=CpuPlatform.register_triton_kernel_overrides):
    """vLLM 0.32's CPU workers re-scan every loaded module for Triton kernels to override each time a
    worker starts, and the scan raises once numba (n-gram drafting) has loaded llvmlite (whose
    ``_lib_fn_wrapper`` has no instance dict). Overrides rebind module attributes, so one scan per
    process does it all; this lets one test process build several engines."""
    if not getattr(CpuPlatform, "_specdec_tests_overridden", False):
        register()
        CpuPlatform._specdec_tests_overridden = True


CpuPlatform.register_triton_kernel_overrides = classmethod(lambda cls: _register_kernel_overrides_once())
_engines: OrderedDict = OrderedDict()


def engine(spec: str, with_plugin: bool, max_num_seqs: int = 16) -> LLM:
    """The engine for (spec, with_plugin), built once; the least recently used goes when a third is needed."""
    key = (spec, with_plugin, max_num_seqs)
    if key not in _engines:
        while len(_engines) >= 2:
            _engines.popitem(last=False)
            gc.collect()
        (plugin.register if with_plugin else plugin.unregister)()
        _engines[key] = LLM(
            model=TARGET, dtype="float32", enforce_eager=True, max_model_len=512, seed=0, max_num_seqs=max_num_seqs,
            speculative_config=SPECS[spec], disable_log_stats=False,
        )  # fmt: skip
        plugin.unregister()
    _engines.move_to_end(key)
    return _engines[key]


def runner_sampler(llm: LLM):
    """The rejection sampler the engine's model runner built (in-process engine core)."""
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner.rejection_sampler


def spec_counts(llm: LLM) -> tuple[int, int]:
    """vLLM's own cumulative (draft tokens, accepted tokens) counters."""
    values = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}
    return int(values["vllm:spec_decode_num_draft_tokens"]), int(values["vllm:spec_decode_num_accepted_tokens"])


def token_ids(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


def chi_square_critical(dof: int, z: float = 3.719) -> float:
    """Upper quantile of chi-square(dof) at the normal quantile z (3.719: p = 1e-4), Wilson-Hilferty."""
    c = 2.0 / (9.0 * dof)
    return dof * (1.0 - c + z * math.sqrt(c)) ** 3


def chi_square(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> tuple[float, int]:
    """Pearson's statistic and degrees of freedom of ``counts`` against ``probs``.

    Categories expected fewer than ``min_expected`` times are pooled into one (the
    approximation needs about 5 per cell); the pool joins the smallest kept cell if it is
    itself too small.
    """
    n = counts.sum()
    expected = probs.double() * n
    keep = expected >= min_expected
    obs = torch.cat([counts[keep].double(), counts[~keep].double().sum().view(1)])
    exp = torch.cat([expected[keep], expected[~keep].sum().view(1)])
    if exp[-1] < min_expected:
        smallest = int(exp[:-1].argmin())
        obs[smallest] += obs[-1]
        exp[smallest] += exp[-1]
        obs, exp = obs[:-1], exp[:-1]
    return float(((obs - exp) ** 2 / exp).sum()), obs.numel() - 1
