"""The Triton kernels compile for an H100/H200 (sm_90) and an A100 (sm_80) without a GPU.

The interpreter accepts code the compiler rejects, and only a compile shows register spills and how
a loop was pipelined. ``bench/compile_matrix.py`` runs every kernel's own launcher at the shapes that
matter, records the launches and compiles them with the installed Triton
(``specdec.kernels.compile_target``). Here: the launchers' defaults at the primary shapes (LLaMA-3-8B,
bf16), with every check the matrix makes (spills, shared memory, declared register bounds, K/V buffers
in the paged decode loop); CI runs the whole matrix, tuning candidates included, with this Triton and
with Triton 3.6.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from common import triton_kernels
from compile_matrix import ARRIVALS, ROW_STREAMS

from specdec.kernels.compile_target import (
    SHARED_LIMIT,
    Buffer,
    Resources,
    ordered_arrivals,
    pipeline,
    toolchain,
    vector_loads,
)

ROOT = Path(__file__).resolve().parent.parent
needs_toolchain = pytest.mark.skipif(not toolchain()[0], reason=f"no NVIDIA toolchain: {toolchain()[1]}")
# a process that compiles: Triton's jit helpers imported with the interpreter on stay interpreted
COMPILE_ENV = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"TRITON_DEFAULT_FP_FUSION": "1"}


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    out = tmp_path_factory.mktemp("matrix")
    cmd = [sys.executable, "bench/compile_matrix.py", "--primary", "--defaults-only", "--out", str(out)]
    run = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    (summary,) = out.glob("compile_matrix_triton*.json")
    return run, json.loads(summary.read_text())


@needs_toolchain
def test_every_kernel_compiles_for_sm90_and_sm80_within_its_limits(matrix):
    run, summary = matrix
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert summary["failures"] == []
    assert set(summary["kernels"]) == triton_kernels()  # no kernel left out of the matrix
    for kernel, entry in summary["kernels"].items():
        for arch in ("90", "80"):
            worst = entry["worst"][arch]
            assert worst["spill"] == 0, f"{kernel} sm_{arch}: {worst['spill']} bytes of register spills"
            assert worst["shared"] <= SHARED_LIMIT[int(arch)], f"{kernel} sm_{arch}: {worst['shared']} bytes shared"
            assert worst["failed"] == 0
    # the structural checks ran: attention declares its register bounds, and the paged bf16 decode launches
    # (one split and eight) were checked for their K/V buffers on each architecture
    attention = summary["kernels"]["tree_attention_kernel"]
    assert attention["register_bound"] and not [u for u in summary["unbounded"] if u.startswith("tree_attention")]
    for arch in ("90", "80"):
        worst = attention["worst"][arch]
        assert worst["buffer_checks"] >= 2, worst
        assert worst["buffers"]["k"] >= 2 and worst["buffers"]["v"] >= 2, f"sm_{arch}: {worst['buffers']}"
    # every launch of the kernels whose last program acts on the others' work counts its arrival after a barrier
    for kernel in ARRIVALS:
        for arch in ("90", "80"):
            worst = summary["kernels"][kernel]["worst"][arch]
            assert worst["arrival_checks"] >= 1 and worst["ordered_arrivals"] >= 1, f"{kernel} sm_{arch}: {worst}"
    # the kernels that stream vocabulary rows were checked for vector loads at their default launches
    for kernel in ROW_STREAMS:
        for arch in ("90", "80"):
            worst = summary["kernels"][kernel]["worst"][arch]
            assert worst["row_checks"] >= 1 and worst["vector_loads"] >= 1, f"{kernel} sm_{arch}: {worst}"


# A launch compiled without a software pipeline (num_stages=1: no shared-memory ring for any load), run
# through the matrix's own check and report.
UNPIPELINED = """
import json, sys
import compile_matrix as cm, triton
case = "attention llama3-8b decode-b8 bf16 paged"
(job,) = cm.collect_jobs({case: cm.all_cases()[case]}, [90], defaults_only=True)
job.meta["num_stages"] = job.config["num_stages"] = 1
r = cm.compile_job(job, 90)
failures = cm.report([job], {(0, 90): r}, [90], triton.__version__, 0.0)[1]["failures"]
print(json.dumps(dict(result=r, failures=failures, version=triton.__version__)))
"""


@needs_toolchain
def test_the_decode_buffer_check_fails_a_loop_that_is_not_double_buffered():
    env = COMPILE_ENV | {"PYTHONPATH": str(ROOT / "bench")}  # the script imports the matrix as a module
    run = subprocess.run([sys.executable, "-c", UNPIPELINED], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    found = json.loads(run.stdout.splitlines()[-1])
    result, (failure,) = found["result"], found["failures"]
    assert result["checked"] == "attention llama3-8b decode-b8 bf16 paged"
    assert min((c for name, c, _ in result["buffers"] if name in ("k", "v")), default=0) < 2, result["buffers"]
    for load in ("k", "v"):
        assert any(f"buffers for {load!r} in the loop < 2" in p for p in result["problems"]), result["problems"]
    # the message names the kernel, architecture, Triton version, the fact and the case
    assert failure.startswith(f"tree_attention_kernel [BLOCK_N=64 w4 s1] sm_90 Triton {found['version']}: "), failure
    assert "buffers for 'k' in the loop < 2" in failure
    assert failure.endswith("(attention llama3-8b decode-b8 bf16 paged)")


# --------------------------------------------------------------------------- reading the compiled IR

# Real TritonGPU IR of the paged decode loop (sm_90), shortened: most lines are left out and "..." stands
# for the rest of a long line. Triton 3.6, one buffer per load (every wait in the loop drains all copies):
TTGIR_36 = """
    %q_100 = ttg.local_alloc %q_99 : (tensor<16x128xbf16, #blocked>) -> !ttg.memdesc<16x128xbf16, #shared, ...
    %block_135 = ttg.local_alloc : () -> !ttg.memdesc<1x64xi32, #shared1, #smem, mutable> loc(#loc278)
    %block_136 = ttg.local_alloc : () -> !ttg.memdesc<1x64xi32, #shared1, #smem, mutable> loc(#loc278)
    %k_137 = ttg.local_alloc : () -> !ttg.memdesc<1x128x64xbf16, #shared2, #smem, mutable> loc(#loc279)
    %v_138 = ttg.local_alloc : () -> !ttg.memdesc<1x64x128xbf16, #shared, #smem, mutable> loc(#loc280)
    %block_150 = ttg.memdesc_index %block_135[%c0_i32] : !ttg.memdesc<1x64xi32, #shared1, #smem, mutable> ...
    %block_155 = ttg.memdesc_index %block_136[%c0_i32] : !ttg.memdesc<1x64xi32, #shared1, #smem, mutable> ...
    %block_162 = ttg.async_wait %block_154, %block_159 {num = 0 : i32} loc(#loc278)
    %k_185 = ttg.memdesc_index %k_137[%c0_i32] : !ttg.memdesc<1x128x64xbf16, #shared2, #smem, mutable> ...
    %v_198 = ttg.memdesc_index %v_138[%c0_i32] : !ttg.memdesc<1x64x128xbf16, #shared, #smem, mutable> ...
    %acc_223:11 = scf.for %acc_228 = %kv_lo to %kv_hi_108 step %c64_i32 iter_args(... : i32 {
      %k_245 = ttg.async_wait %k_229, %v_230, %block_231, %block_232 {num = 0 : i32} loc(#loc279)
      %m_new = "tt.reduce"(%s_261) <{axis = 1 : i32}> ({
        tt.reduce.return %m_new_339 : f32 loc(#loc322)
      }) : (tensor<16x64xf32, #mma>) -> tensor<16xf32, #ttg.slice<{dim = 1, parent = #mma}>> loc(#loc322)
      %acc_274 = ttg.local_alloc %acc_273 : (tensor<16x64xbf16, #mma>) -> !ttg.memdesc<16x64xbf16, #shared, ...
    } loc(#loc326)
    %acc_224 = ttg.async_wait {num = 0 : i32} loc(#loc326)
    ttg.local_dealloc %v_138 : !ttg.memdesc<1x64x128xbf16, #shared, #smem, mutable> loc(#loc326)
"""
# Triton 3.9, the block ids prefetched one tile ahead: two buffers per load, two copy groups in flight
TTGIR_39 = """
    %k_149 = ttg.local_alloc : () -> !ttg.memdesc<2x128x64xbf16, #shared1, #smem, mutable> loc(#loc330)
    %v_150 = ttg.local_alloc : () -> !ttg.memdesc<2x64x128xbf16, #shared, #smem, mutable> loc(#loc331)
    %k_168 = ttg.memdesc_index %k_149[%c0_i32] : !ttg.memdesc<2x128x64xbf16, #shared1, #smem, mutable> ...
    %v_180 = ttg.memdesc_index %v_150[%c0_i32] : !ttg.memdesc<2x64x128xbf16, #shared, #smem, mutable> ...
    %blocks_242:11 = scf.for %blocks_380 = %kv_lo to %pre_hi step %c64_i32 iter_args(... : i32 {
      %k_399 = ttg.async_wait %k_383, %v_385 {num = 2 : i32} loc(#loc330)
      %k_400 = ttg.memdesc_index %k_149[%blocks_395] : !ttg.memdesc<2x128x64xbf16, #shared1, #smem, mutable> ...
      %m_new = "tt.reduce"(%s_406) <{axis = 1 : i32}> ({
        tt.reduce.return %m_new_485 : f32 loc(#loc391)
      }) : (tensor<16x64xf32, #mma>) -> tensor<16xf32, #ttg.slice<{dim = 1, parent = #mma}>> loc(#loc391)
    } loc(#loc400)
    %blocks_243 = ttg.async_wait {num = 0 : i32} loc(#loc400)
"""


def test_pipeline_reads_the_buffer_rings_and_loop_waits_of_triton_36_and_39():
    buffers, waits = pipeline(TTGIR_36)
    assert buffers == (Buffer("block", 1, "64xi32"), Buffer("block", 1, "64xi32"), Buffer("k", 1, "128x64xbf16"),
                       Buffer("v", 1, "64x128xbf16"))  # fmt: skip
    assert waits == (0,)  # the waits before and after the loop are not the loop's
    assert pipeline(TTGIR_39) == ((Buffer("k", 2, "128x64xbf16"), Buffer("v", 2, "64x128xbf16")), (2,))
    # an allocation the loop does not index by stage is no ring
    assert pipeline(TTGIR_39.replace("ttg.memdesc_index %v_150[", "ttg.memdesc_index %v_999[")) == (
        (Buffer("k", 2, "128x64xbf16"),),
        (2,),
    )


def test_resources_problems_name_each_broken_limit():
    one, two = pipeline(TTGIR_36)[0], pipeline(TTGIR_39)[0]
    fits = Resources(128, 0, 0, 70 * 1024, 1.0, two, (2,))
    assert fits.buffer_count("k") == 2 and fits.buffer_count("block") == 0
    assert fits.problems(90, max_registers=128, min_buffers={"k": 2, "v": 2}) == []
    assert fits.problems(90) == []  # nothing declared: nothing checked beyond spills and shared memory
    single = Resources(160, 0, 0, 38 * 1024, 1.0, one, (0,))
    assert single.problems(80, max_registers=150, min_buffers={"k": 2, "v": 2}) == [
        "160 registers per thread > the declared bound 150",
        "1 shared-memory buffers for 'k' in the loop < 2",
        "1 shared-memory buffers for 'v' in the loop < 2",
    ]
    unpipelined = Resources(100, 8, 16, 200 * 1024, 1.0)
    assert unpipelined.problems(80, min_buffers={"k": 2}, vectorised=True) == [
        "8 bytes of register spill stores",
        f"{200 * 1024} bytes of shared memory > the {163 * 1024} a block may use",
        "0 shared-memory buffers for 'k' in the loop < 2",
        "no vector load: its rows are read a value at a time",
    ]
    assert Resources(40, 0, 0, 0, 1.0, vector_loads=1).problems(90, vectorised=True) == []
    assert Resources(70, 0, 0, 0, 1.0).problems(90, arrives=True) == [
        "no barrier then acq_rel GPU-scope atomic add: its arrival may pass its own accesses"
    ]
    assert Resources(70, 0, 0, 0, 1.0, ordered_arrivals=1).problems(90, arrives=True) == []


def test_ordered_arrivals_are_counted_from_the_ptx():
    # a program's arrival as Triton 3.9 compiles it for sm_90 (a barrier, then one thread's acq_rel add at GPU
    # scope past line markers and moves); without the barrier, or with a global store after it, it does not count
    arrival = """
\tbar.sync \t0;
\t.loc\t1 110 12                        // kv_compact.py:110:12
\t// begin inline asm
\tmov.u32 %r1483, 0x0;
\t@%p245 atom.global.gpu.acq_rel.add.u32 %r1483, [ %rd659 + 0 ], %r1484;
"""
    assert ordered_arrivals(arrival) == 1
    assert ordered_arrivals(arrival.replace("gpu.acq_rel", "acq_rel.gpu")) == 1  # the other order PTX allows
    assert ordered_arrivals(arrival.replace("bar.sync", "// bar.sync")) == 0
    assert ordered_arrivals(arrival.replace("mov.u32", "st.global.b32 [ %rd1 + 0 ], %r9; mov.u32")) == 0
    assert ordered_arrivals(arrival.replace("gpu.acq_rel", "gpu.relaxed")) == 0
    assert ordered_arrivals(arrival.replace("gpu.acq_rel", "cta.acq_rel")) == 0
    assert ordered_arrivals(arrival.replace(".add.u32", ".exch.b32")) == 0


def test_vector_loads_are_counted_from_the_ptx():
    # real PTX lines (sm_90): a 16-byte load of eight bf16 logits, an 8-byte one, a read-only one, scalar loads
    ptx = """
\t@%p1 ld.global.v4.b32 { %r1, %r2, %r3, %r4 }, [ %rd1 + 0 ];
\t@%p2 ld.global.v2.b32 { %r5, %r6 }, [ %rd2 + 0 ];
\tld.global.nc.v4.b32 { %r7, %r8, %r9, %r10 }, [ %rd3 + 0 ];
\tld.global.b16 %rs1, [ %rd4 + 0 ];
\t@%p3 ld.global.b32 { %r11 }, [ %rd5 + 0 ];
\tst.global.v4.b32 [ %rd6 + 0 ], { %r1, %r2, %r3, %r4 };
"""
    assert vector_loads(ptx) == 3


def test_kernel_discovery_finds_the_known_kernels():
    # the coverage check above is only as good as this list
    kernels = triton_kernels()
    assert {"tree_attention_kernel", "merge_splits_kernel", "kv_append_kernel", "kv_compact_kernel",
            "_threshold_kernel", "_tree_walk_kernel", "_rms_norm_kernel"} <= kernels  # fmt: skip
    assert len(kernels) == 14
