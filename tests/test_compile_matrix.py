"""The Triton kernels compile for an H100/H200 (sm_90) and an A100 (sm_80) without a GPU.

The interpreter accepts code the compiler rejects, and only a compile shows register spills.
``bench/compile_matrix.py`` runs every kernel's own launcher at the shapes that matter, records the
launches and compiles them with the installed Triton (``specdec.kernels.compile_target``). Here:
the launchers' defaults at the primary shapes (LLaMA-3-8B, bf16); CI runs the whole matrix, tuning
candidates included, with this Triton and with Triton 3.6.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from specdec.kernels import tuning
from specdec.kernels.compile_target import SHARED_LIMIT, toolchain

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    out = tmp_path_factory.mktemp("matrix")
    cmd = [sys.executable, "bench/compile_matrix.py", "--primary", "--defaults-only", "--out", str(out)]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    (summary,) = out.glob("compile_matrix_triton*.json")
    return run, json.loads(summary.read_text())


@pytest.mark.skipif(not toolchain()[0], reason=f"no NVIDIA toolchain: {toolchain()[1]}")
def test_every_kernel_compiles_for_sm90_and_sm80_without_spills(matrix):
    run, summary = matrix
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert summary["failures"] == []
    assert set(summary["kernels"]) == tuning.triton_kernels()  # no kernel left out of the matrix
    for kernel, entry in summary["kernels"].items():
        for arch in ("90", "80"):
            worst = entry["worst"][arch]
            assert worst["spill"] == 0, f"{kernel} sm_{arch}: {worst['spill']} bytes of register spills"
            assert worst["shared"] <= SHARED_LIMIT[int(arch)], f"{kernel} sm_{arch}: {worst['shared']} bytes shared"
            assert worst["failed"] == 0


def test_kernel_discovery_finds_the_known_kernels():
    # the coverage check above is only as good as this list
    kernels = tuning.triton_kernels()
    assert {"tree_attention_kernel", "merge_splits_kernel", "kv_append_kernel", "kv_compact_kernel",
            "_threshold_kernel", "_tree_walk_kernel", "_rms_norm_kernel"} <= kernels  # fmt: skip
    assert len(kernels) == 17
