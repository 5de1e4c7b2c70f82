"""Compile matrix: every configuration the Triton launchers can choose, compiled for sm_90 and sm_80.

Each case (``compile_cases.py``) runs a kernel's own launcher on CPU tensors of a shape that matters (LLaMA-3-8B,
70B with GQA 8, TinyLlama's head dim 64, a padded head dim 80, the widest head 256, the
embedded pair's 32; vocab 32000 and 128256; fp16, bf16 and fp32) under
``tuning.capture_launches()``, which records what the launcher would launch on a GPU:
its default configuration and its tuning space. Every distinct launch is then compiled
with the installed Triton for each architecture (``specdec.kernels.compile_target``):
with its default configuration at every case, and with every candidate of its tuning
space at the primary cases (LLaMA-3-8B and vocab 128256, bf16). A compile that fails,
spills registers, needs more shared memory than a block may have or more registers than its
kernel declares (``REGISTER_BOUND``), a paged decode launch whose loop does not double
buffer K and V (``DECODE_BUFFERS``), a default launch of a kernel that streams vocabulary rows
without a vector load (``ROW_STREAMS``), or a launch of a kernel whose last program acts on the others'
work without an ordered arrival (``ARRIVALS``: a CTA barrier, then an acq_rel atomic add at GPU scope),
fails the run (exit 1).

    python bench/compile_matrix.py --out OUT                 # everything (CI, per Triton version)
    python bench/compile_matrix.py --primary --defaults-only # the test suite's check

Writes ``compile_matrix_triton<version>.md`` (a summary per kernel, then one row per compiled
configuration) and ``.json`` to ``--out``; prints the summary.
"""

from __future__ import annotations

import os

if __name__ == "__main__":  # imported (tests/test_tuning.py), the module only lists the cases and their launches
    os.environ.pop("TRITON_INTERPRET", None)  # compile the real kernels (set before specdec imports triton)
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, said explicitly (no warning)

import argparse  # noqa: E402
import concurrent.futures  # noqa: E402
import json  # noqa: E402
import multiprocessing  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from common import triton_kernels  # noqa: E402
from compile_cases import ARCH, ATTENTION_SHAPES, all_cases, is_primary  # noqa: E402

from specdec.kernels import tuning  # noqa: E402
from specdec.kernels.compile_target import SHARED_LIMIT, compile_launch, toolchain  # noqa: E402

# ---------------------------------------------------------------------------------------------- jobs


class ArgSpec:
    """What the JIT reads of a tensor argument to specialise a kernel: its dtype and address."""

    def __init__(self, t: torch.Tensor):
        self.dtype, self._ptr = t.dtype, t.data_ptr()

    def data_ptr(self) -> int:
        return self._ptr


@dataclass
class Job:
    module: str
    kernel: str
    args: tuple
    meta: dict  # meta-parameters and the configuration
    config: dict
    defaults: list  # (architecture, case) where it is the launcher's own choice (else a tuning candidate)
    cases: list
    archs: list  # the architectures whose launchers choose it

    @property
    def default(self) -> bool:
        return bool(self.defaults)


def specialization(kernel, args, meta) -> tuple:
    """The JIT's cache key for this launch (types, alignment, constexprs), target-independent parts."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    binder = create_function_from_signature(kernel.signature, kernel.params, make_backend(GPUTarget("cuda", 90, 32)))
    return tuple(binder(*args, **meta)[1])


def collect_jobs(cases: dict, archs: list[int], defaults_only: bool) -> list[Job]:
    """Distinct launches (by the JIT's specialisation and meta-parameters) that each architecture's launchers
    choose: every case's defaults, and at the primary cases every candidate of the launch's tuning space."""
    jobs: dict[tuple, Job] = {}
    for arch in archs:
        ARCH[0] = arch
        for case, thunk in cases.items():
            with tuning.capture_launches() as launches:
                thunk()
            if not launches:
                raise RuntimeError(f"case {case!r} launched nothing")
            for launch in launches:
                args = tuple(ArgSpec(a) if isinstance(a, torch.Tensor) else a for a in launch.args)
                candidates = [] if defaults_only or not is_primary(case) else list(launch.space.configs)
                for i, config in enumerate([launch.config] + candidates):
                    meta = {**launch.meta, **config}
                    key = (launch.name, specialization(launch.kernel, args, meta), tuple(sorted(meta.items())))
                    job = jobs.get(key)
                    if job is None:
                        module = launch.kernel.fn.__module__
                        job = jobs[key] = Job(module, launch.name, args, meta, config, [], [], [])
                    if i == 0 and (arch, case) not in job.defaults:
                        job.defaults.append((arch, case))
                    if case not in job.cases:
                        job.cases.append(case)
                    if arch not in job.archs:
                        job.archs.append(arch)
    return list(jobs.values())


# ---------------------------------------------------------------------------------------------- checks

# Registers per thread each kernel may use: the most its configurations compile to (sm_80 and sm_90, Triton
# 3.6 and 3.9) with a little headroom, so that a change that makes a kernel much hungrier fails here; tree
# attention by tile rows (BLOCK_M). A kernel not listed is not checked for registers.
REGISTER_BOUND = {
    "tree_attention_kernel": {16: 200, 32: 224, 64: 255, 128: 255},
    "merge_splits_kernel": 40,
}
WIDE_HEAD_BOUND = 248  # tree attention with heads wider than 128 (BLOCK_D 256), whatever its rows
# Loads the paged decode loop (one query per request, causal, 16-bit: the bandwidth-bound path) must
# buffer at least this deep at the launcher's default stages: then the next K/V tile's copy overlaps this
# tile's math instead of every tile paying a full DRAM round trip. The names are the kernel's variables
# the loads assign. (fp32 tiles run their dots on FMA units and are not checked.)
DECODE_BUFFERS = {"k": 2, "v": 2}
# Kernels that stream vocabulary rows (logits, draft or probability rows) a block at a time. Every case's rows are
# whole 16-byte multiples, so at the launchers' default configurations their loads must compile to vector loads: a
# clamped address is read a value at a time, and 16-bit logits then move 2 bytes a load. (The greedy walk reads no
# row.)
ROW_STREAMS = {"_threshold_kernel", "_row_stats_kernel", "_probs_kernel", "_race_tile_kernel", "_tree_walk_kernel"}
# Kernels whose last program of a group acts on what the others did (kv_compact: the last program of a request
# advances its length, after every program of the request has read the old one). Each program must count itself
# done after a barrier of its CTA, with an acq_rel atomic add at GPU scope: else the count can pass its accesses.
ARRIVALS = {"kv_compact_kernel"}


def register_bound(job: Job) -> int | None:
    bound = REGISTER_BOUND.get(job.kernel)
    if not isinstance(bound, dict):
        return bound
    return WIDE_HEAD_BOUND if job.meta.get("BLOCK_D", 0) > 128 else bound.get(job.meta.get("BLOCK_M"))


def buffer_check(job: Job, arch: int) -> tuple[dict, str]:
    """({load: fewest buffers}, the case that asks): ``DECODE_BUFFERS`` where the launch is the default
    of a 16-bit paged decode case on ``arch``, else nothing."""
    if job.kernel == "tree_attention_kernel" and job.meta["PAGED"] and not job.meta["TREE"]:
        for where, case in job.defaults:
            _, _, shape, dtype, _ = case.split()
            if where == arch and ATTENTION_SHAPES[shape][0] == 1 and dtype != "fp32":
                return DECODE_BUFFERS, case
    return {}, ""


def streams_rows(job: Job, arch: int) -> bool:
    """Whether ``ROW_STREAMS`` asks this launch for vector loads: a row-streaming kernel, the default on ``arch``."""
    reads_rows = job.kernel in ROW_STREAMS and job.meta.get("RULE") != "greedy"
    return reads_rows and any(where == arch for where, _ in job.defaults)


def compile_job(job: Job, arch: int) -> dict:
    kernel = getattr(sys.modules[job.module], job.kernel)
    try:
        r = compile_launch(kernel, job.args, job.meta, arch)
    except Exception as exc:  # reported per row; the run fails at the end
        return dict(error=f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:200] if str(exc) else ''}")
    needed, case = buffer_check(job, arch)
    rows, arrives = streams_rows(job, arch), job.kernel in ARRIVALS
    problems = r.problems(arch, register_bound(job), needed, rows, arrives)
    return dict(registers=r.registers, spill=r.spill_bytes, stack=r.stack_bytes, shared=r.shared_bytes,
                seconds=r.compile_s, buffers=[[b.name, b.count, b.shape] for b in r.buffers],
                waits=list(r.loop_waits), vector_loads=r.vector_loads, checked=case, rows_checked=rows,
                arrivals_checked=arrives, ordered_arrivals=r.ordered_arrivals, problems=problems)  # fmt: skip


def _worker(payload):
    job, arch = payload
    return compile_job(job, arch)


# ---------------------------------------------------------------------------------------------- report


USAGE = "regs / spill / stack / shared KB"


def usage(r: dict) -> str:
    return f"{r['registers']} / {r['spill']} / {r['stack']} / {r['shared'] / 1024:.1f}"


def rings(r: dict) -> str:
    """The loop's buffer rings by load (several loops: several counts), the in-loop waits' ``num`` and the vector
    loads."""
    counts: dict[str, list] = {}
    for name, count, _ in r["buffers"]:
        counts.setdefault(name, []).append(str(count))
    text = ", ".join(f"{name} {'/'.join(c)}" for name, c in counts.items()) or "none"
    text += f"; wait {'/'.join(map(str, r['waits']))}" if r["waits"] else ""
    return text + f"; {r['vector_loads']} vector loads"


def bound_text(kernel: str) -> str:
    bound = REGISTER_BOUND.get(kernel)
    if isinstance(bound, dict):
        return ", ".join(f"{rows} rows {b}" for rows, b in bound.items()) + f", heads > 128 {WIDE_HEAD_BOUND}"
    return "none" if bound is None else str(bound)


def short_spec(job: Job) -> str:
    """The launch's meta-parameters that are not the configuration, and its pointer dtypes."""
    fixed = {k: v for k, v in job.meta.items() if k not in job.config}
    dtypes = sorted({str(a.dtype).replace("torch.", "") for a in job.args if isinstance(a, ArgSpec)})
    return " ".join([f"{k}={v}" for k, v in fixed.items()] + ["/".join(dtypes)])


def report(jobs: list[Job], results: dict, archs: list[int], version: str, elapsed: float) -> tuple[str, dict, int]:
    failures = []
    kernels: dict[str, dict] = {}
    rows = []
    for j, job in enumerate(jobs):
        summary = kernels.setdefault(job.kernel, dict(configs=0, defaults=0, cases=set(), arch={}, seconds=0.0))
        summary["configs"] += 1
        summary["defaults"] += job.default
        summary["cases"].update(job.cases)
        cells = []
        for arch in archs:
            worst = summary["arch"].setdefault(arch, dict(registers=0, spill=0, stack=0, shared=0, failed=0,
                                                          buffer_checks=0, buffers={}, row_checks=0, vector_loads=None,
                                                          arrival_checks=0, ordered_arrivals=None))
            if (j, arch) not in results:  # this architecture's launchers never choose it
                cells += ["-", "-"]
                continue
            r = results[j, arch]
            if "error" in r or r["problems"]:
                why = r.get("error") or "; ".join(r["problems"])
                failures.append(f"{job.kernel} [{tuning.describe(job.config)}] sm_{arch} Triton {version}: {why} "
                                f"({r.get('checked') or job.cases[0]})")  # fmt: skip
                worst["failed"] += 1
            if "error" in r:
                cells += ["FAILED", "-"]
                continue
            for field in ("registers", "spill", "stack", "shared"):
                worst[field] = max(worst[field], r[field])
            for asked, checks, field in (("rows_checked", "row_checks", "vector_loads"),
                                         ("arrivals_checked", "arrival_checks", "ordered_arrivals")):  # fmt: skip
                if r[asked]:  # the fewest vector loads / ordered arrivals over the launches checked for them
                    worst[checks] += 1
                    worst[field] = r[field] if worst[field] is None else min(worst[field], r[field])
            if r["checked"]:  # the fewest buffers of each checked load over the checked launches
                worst["buffer_checks"] += 1
                for name in DECODE_BUFFERS:
                    count = min((c for n, c, _ in r["buffers"] if n == name), default=0)
                    worst["buffers"][name] = min(worst["buffers"].get(name, count), count)
            summary["seconds"] += r["seconds"]
            cells += [usage(r), rings(r)]
        origin = "default" if job.default else "candidate"
        more = f" (+{len(job.cases) - 1})" if len(job.cases) > 1 else ""
        bound = register_bound(job)
        rows.append(f"| {job.kernel} | {tuning.describe(job.config)} | {origin} | {short_spec(job)} | "
                    f"{job.cases[0]}{more} | {'none' if bound is None else bound} | {' | '.join(cells)} |")  # fmt: skip
    lines = [
        f"## Compile matrix, Triton {version}: {len(jobs)} configurations, {len(results)} compiles for "
        f"sm_{', sm_'.join(map(str, archs))} ({elapsed:.0f} s)",
        "",
        "Per kernel: configurations compiled (the launchers' defaults among them), cases, the worst registers "
        "per thread / spill-store bytes / stack-frame bytes / shared KB over them, per architecture (from ptxas "
        "-v), the declared register bound, and at the 16-bit paged decode launches the fewest shared-memory buffers "
        "of the loop's K and V loads (from the TritonGPU IR; launches checked in brackets).",
        "",
        "| kernel | configs (defaults) | cases | " + " | ".join(f"sm_{a} {USAGE}" for a in archs)
        + " | register bound | " + " | ".join(f"sm_{a} decode buffers" for a in archs) + " | failed | compile s |",
        "|---|---|---|" + "---|" * (2 * len(archs) + 3),
    ]
    for name, s in sorted(kernels.items()):
        worst = [s["arch"][a] for a in archs]
        cells = [usage(w) for w in worst] + [bound_text(name)]
        cells += [", ".join(f"{k} {c}" for k, c in w["buffers"].items()) + f" ({w['buffer_checks']})"
                  if w["buffer_checks"] else "-" for w in worst]  # fmt: skip
        lines.append(f"| {name} | {s['configs']} ({s['defaults']}) | {len(s['cases'])} | " + " | ".join(cells)
                     + f" | {sum(w['failed'] for w in worst)} | {s['seconds']:.0f} |")  # fmt: skip
    # kernels (or tiles of a kernel bounded by rows) without a declared bound
    tile = lambda job: f" BLOCK_M={job.meta['BLOCK_M']}" if job.kernel in REGISTER_BOUND else ""  # noqa: E731
    unbounded = sorted({job.kernel + tile(job) for job in jobs if register_bound(job) is None})
    lines += [
        "",
        "Limits: no spill stores; shared memory per block <= "
        + ", ".join(f"{SHARED_LIMIT[a] // 1024} KB (sm_{a})" for a in archs)
        + "; registers per thread <= the kernel's declared bound ("
        + (f"not checked for {', '.join(unbounded)}: no bound declared" if unbounded else "every kernel declares one")
        + "); in the loop of a 16-bit paged decode launch at the launcher's default configuration, at least "
        + ", ".join(f"{n} buffers for {name!r}" for name, n in DECODE_BUFFERS.items())
        + "; vector loads in the default launches of the kernels that stream vocabulary rows ("
        + ", ".join(sorted(ROW_STREAMS)) + "); in every launch of " + ", ".join(sorted(ARRIVALS))
        + ", a CTA barrier then an acq_rel GPU-scope atomic add (the arrival its last program waits for).",
        "",
    ]
    if failures:
        lines += ["Failures:", ""] + [f"- {f}" for f in failures] + [""]
    lines += [
        "| kernel | config | origin | fixed meta-parameters, dtypes | case | register bound | "
        + " | ".join(f"sm_{a} {USAGE} | sm_{a} buffers by load; loop waits; vector loads" for a in archs) + " |",
        "|---|---|---|---|---|---|" + "---|" * (2 * len(archs)),
        *rows,
    ]
    summary = {
        "triton": version,
        "archs": archs,
        "configurations": len(jobs),
        "failures": failures,
        "unbounded": unbounded,  # not checked for registers
        "kernels": {k: {"configs": s["configs"], "defaults": s["defaults"], "cases": len(s["cases"]),
                        "compile_s": round(s["seconds"], 1), "register_bound": REGISTER_BOUND.get(k),
                        "worst": {str(a): s["arch"][a] for a in archs}}
                    for k, s in kernels.items()},  # fmt: skip
    }
    return "\n".join(lines) + "\n", summary, len(failures)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, nargs="+", default=[90, 80], choices=sorted(SHARED_LIMIT))
    parser.add_argument("--defaults-only", action="store_true", help="the launchers' own choices, no candidates")
    parser.add_argument("--cases", default="", help="only cases whose name contains this text")
    parser.add_argument("--primary", action="store_true", help="only the primary cases (LLaMA-3-8B, bf16)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel compiles")
    parser.add_argument("--out", type=Path, default=None, help="folder for the .md table and the .json summary")
    parser.add_argument("--verbose", action="store_true", help="print every compile as it finishes")
    args = parser.parse_args()
    ok, why = toolchain()
    if not ok:
        print(f"compile matrix: cannot compile for NVIDIA targets here: {why}")
        return 2
    import triton

    started = time.perf_counter()
    cases = {name: thunk for name, thunk in all_cases().items()
             if args.cases in name and (is_primary(name) or not args.primary)}  # fmt: skip
    jobs = collect_jobs(cases, args.arch, args.defaults_only)
    missing = sorted(triton_kernels() - {job.kernel for job in jobs})
    if missing and not args.cases:  # a new kernel needs a case here (the primary cases launch every kernel)
        print(f"compile matrix: no case launches {', '.join(missing)}")
        return 1
    work = [(job, arch) for job in jobs for arch in args.arch if arch in job.archs]
    print(f"Triton {triton.__version__}: {len(cases)} cases -> {len(jobs)} distinct configurations, {len(work)} "
          f"compiles for sm_{', sm_'.join(map(str, args.arch))}, {args.jobs} in parallel", flush=True)  # fmt: skip
    outcome = []
    with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("fork")) as pool:
        for (job, arch), r in zip(work, pool.map(_worker, work)):  # results in order, as they come
            outcome.append(r)
            bad = r.get("error") or "; ".join(r.get("problems", []))
            if args.verbose or bad:
                used = "" if "error" in r else f"{USAGE} {usage(r)}"
                print(f"  sm_{arch} {job.kernel} [{tuning.describe(job.config)}] {used} {bad} ({job.cases[0]})",
                      flush=True)  # fmt: skip
            if len(outcome) % max(1, len(work) // 10) == 0:
                print(f"  {len(outcome)}/{len(work)} compiled, {time.perf_counter() - started:.0f} s", flush=True)
    index = {id(job): j for j, job in enumerate(jobs)}
    results = {(index[id(job)], arch): r for (job, arch), r in zip(work, outcome)}
    text, summary, failed = report(jobs, results, args.arch, triton.__version__, time.perf_counter() - started)
    print(text.split("\n| kernel | config |")[0])
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        stem = f"compile_matrix_triton{triton.__version__}"
        (args.out / f"{stem}.md").write_text(text)
        (args.out / f"{stem}.json").write_text(json.dumps(summary, indent=1, default=sorted))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
