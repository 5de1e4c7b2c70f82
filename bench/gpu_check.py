"""The GPU check: build, first light, tests and benchmarks on a lent GPU, within a time budget.

``bash bench/gpu_check.sh OUT`` runs this. Stages, in order of value; the plan (each stage's expected seconds
on an H200, ``STAGES``) is printed first, and a stage starts only if its expected time still fits in the budget
(``SPECDEC_GPU_CHECK_BUDGET``, default 480 s, the 8 minutes of issues 18 and 34) -- the others are listed as
skipped. Each stage is cut at its own limit, and what it measured so far still lands in OUT.

1. first light   the extension builds in the background (``setup.py build_ext --inplace``, sm_90,
                 no download); meanwhile one call of every Triton kernel against its PyTorch
                 reference, a PASS/FAIL line per check appended to summary.md as it ends
2. extension     waits for the build, then checks the CUDA op; a failed build is reported and the
                 run goes on without the extension (pure Python, its tests skip)
3. tests         the KV-cache Triton cases that failed on the first H200 run, with long tracebacks;
                 the gpu-marked tests; every other kernel test's Triton path, compiled
4. benchmarks    decode and tree attention autotuned over the declared spaces (``SPECDEC_AUTOTUNE=1``),
                 verification, KV rollback, the model ops, the public ops' host time, the 8B-shaped
                 model step; each row names the kernel configurations it ran. End to end
                 (bench_e2e), decode throughput against transformers (bench_model), sampling
                 (bench_sampling) and the split partials' accuracy per dtype (bench_split_partials)
                 are optional: only with --stages

Then one table of issue 34's targets, each line PASS, FAIL or "not measured" (its stage did not run or measured no
row it applies to), computed from the benchmarks' JSON (``gpu_targets.py``).

OUT holds at most seven files (the device tool returns eight): summary.md (plan, first light, every stage's result
and tables, skipped stages, the targets, final status -- appended as stages finish), info.txt (versions, GPU),
build.log, tests.log, failures.log (each failed test's traceback, written as it fails, so a stage cut at its limit
keeps them), bench.log (every benchmark's whole output: FlexAttention's full error, if any, is there), results.json
(the targets and every benchmark's JSON).

``--dry-run`` runs the same stages, the optional one too, on the CPU: kernels through Triton's interpreter, tiny
shapes, no CUDA build, and a skipped or failed stage fails it (CI runs it, so the script itself is tested).
``--stages a,b`` runs only the named stages (e.g. a rerun of what was skipped). Exit status: 0 when every stage
that ran passed (and, in a dry run, none was skipped).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from gpu_targets import targets, targets_table

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
BUDGET_ENV = "SPECDEC_GPU_CHECK_BUDGET"
BUDGET, DRY_BUDGET = 480, 600  # seconds: a GPU run (8 minutes), a dry run


@dataclass
class Stage:
    name: str
    expected: float  # seconds on an H200 (the plan); a dry run uses dry_expected
    limit: float  # cut after this many seconds
    dry_expected: float
    what: str
    optional: bool = False  # on a GPU only when named with --stages (a dry run runs it)
    env: tuple[tuple[str, str], ...] = ()  # set for this stage only


# Expected seconds on an H200 as measured on 2026-12-04 (bench/RESULTS.md): tests-triton was cut at 120 s
# with 11 of its 287 tests left, bench_e2e at 100 s after its two batch-1 tables. tests-kv-cache and
# bench_host_time are estimates, bench_tree_attention's includes autotuning.
STAGES = [  # (name, expected s on an H200, limit s, expected s in a dry run on 2 free CPU cores, what)
    Stage("first-light", 30, 75, 25, "build in the background; one call of every kernel vs its reference"),
    Stage("extension", 20, 150, 5, "wait for the build, check the CUDA tree_metadata op"),
    Stage("tests-kv-cache", 20, 60, 5, "the six KV-cache Triton cases that failed on the H200, long tracebacks"),
    Stage("tests-gpu", 70, 100, 20, "pytest -m gpu (bf16, LLaMA shapes, large caches, the CUDA op)"),
    Stage("tests-triton", 110, 130, 30, "every other kernel test's Triton path, compiled (pytest -k triton)"),
    Stage("bench_tree_attention", 60, 120, 20, "decode, chains, trees vs SDPA+mask, FlexAttention, eager; autotuned",
          env=(("SPECDEC_AUTOTUNE", "1"),)),
    Stage("bench_verify", 40, 90, 15, "verify_chain / verify_tree vs eager PyTorch, in graphs"),
    Stage("bench_kv_rollback", 10, 60, 5, "KV compaction vs an eager per-layer loop"),
    Stage("bench_model_ops", 15, 60, 5, "RMSNorm, RoPE, SwiGLU vs eager composites"),
    Stage("bench_host_time", 15, 60, 5, "host time of the public ops and their run_* entries, batch 1"),
    Stage("bench_step", 40, 100, 10, "8B-shaped model step, CUDA graphs off/on"),  # the G-step and floor lines
    Stage("bench_model", 40, 90, 15, "decode throughput vs transformers", optional=True),
    Stage("bench_sampling", 20, 60, 5, "sample, filtered_probs, kv_append vs eager", optional=True),
    Stage("bench_e2e", 100, 150, 15, "speculative decoding end to end, embedded pair", optional=True),
    Stage("bench_split_partials", 45, 90, 12, "split partials per dtype vs float64 (decides bf16's)", optional=True),
]  # fmt: skip
MODEL_BENCHES = {"bench_step", "bench_model", "bench_e2e"}  # whole models: PyTorch path in a dry run
KV_CACHE_TESTS = "tests/test_kv_cache.py"


class Check:
    def __init__(self, out: Path, dry: bool, budget: float):
        self.out, self.dry, self.budget = out, dry, budget
        self.started = time.monotonic()
        self.summary = out / "summary.md"
        self.results: list[tuple[str, str, float]] = []  # (stage, status, seconds)
        self.test_results: dict[str, tuple[bool, str]] = {}  # test stage -> (passed, pytest's last line)
        self.build: subprocess.Popen | None = None
        self.build_seconds: float | None = None  # set when the build ends
        self.env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        self.env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])  # ninja
        if dry:
            self.env.update(TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
        self.scratch = Path(tempfile.mkdtemp(prefix="gpu_check_"))

    # ------------------------------------------------------------------ output

    def left(self) -> float:
        return self.budget - (time.monotonic() - self.started)

    def write(self, text: str) -> None:
        with open(self.summary, "a") as f:
            f.write(text)
        print(text, end="", flush=True)

    def run(self, cmd: list[str], log: str, limit: float, env: dict | None = None) -> tuple[int | None, str]:
        """Run ``cmd`` (its own process group), output appended to OUT/log; (exit code or None if cut, output)."""
        header = f"\n$ {' '.join(cmd)}   (limit {limit:.0f} s)\n"
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env or self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)  # fmt: skip
        try:
            output, _ = proc.communicate(timeout=max(1.0, limit))
            code = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
            code = None
        with open(self.out / log, "a") as f:
            f.write(header + output + ("" if code is not None else f"\n[cut at {limit:.0f} s]\n"))
        return code, output

    # ------------------------------------------------------------------ stages

    def start_build(self) -> None:
        env = dict(self.env)
        if self.dry:  # no CUDA build in a dry run: the command runs, the extension (already built) stays
            env["SPECDEC_SKIP_EXTENSION"] = "1"
        else:
            env.setdefault("SPECDEC_CUDA_ARCHS", "9.0")
            env.setdefault("MAX_JOBS", str(os.cpu_count() or 4))
        log = open(self.out / "build.log", "a")
        log.write(f"$ {sys.executable} setup.py build_ext --inplace\n")
        log.flush()
        started = time.monotonic()
        command = [sys.executable, "setup.py", "build_ext", "--inplace"]
        self.build = build = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                              start_new_session=True)  # fmt: skip

        def timed():
            build.wait()
            self.build_seconds = time.monotonic() - started

        threading.Thread(target=timed, daemon=True).start()

    def first_light(self, limit: float) -> bool:
        from first_light import CHECKS

        self.start_build()
        shards = 2 if self.dry else min(4, max(1, (os.cpu_count() or 4) // 4))
        self.write(f"\n### First light ({shards} processes)\n\n")
        self.write("| check | calls | result | detail | seconds | configs |\n|---|---|---|---|---|---|\n")
        checks = ",".join(c for c in CHECKS if c != "extension")
        procs = [
            subprocess.Popen([sys.executable, "bench/first_light.py", "--out", str(self.summary), "--shard",
                              f"{i}/{shards}", "--only", checks], cwd=ROOT, env=self.env, start_new_session=True,
                             stdout=open(self.out / "tests.log", "a"), stderr=subprocess.STDOUT)
            for i in range(shards)
        ]  # fmt: skip
        deadline = time.monotonic() + limit
        ok = True
        for p in procs:
            try:
                ok &= p.wait(timeout=max(1.0, deadline - time.monotonic())) == 0
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                ok = False
        text = self.summary.read_text()
        rows = [r for name in checks.split(",") for r in re.findall(rf"^\| {re.escape(name)} \|.*$", text, re.M)]
        if len(rows) < len(checks.split(",")):
            self.write(f"\n{len(checks.split(',')) - len(rows)} checks did not finish within {limit:.0f} s\n")
            return False
        missed = sorted(all_kernels() - launched_kernels(rows))
        if missed:
            self.write(f"\nNo first-light check launched {', '.join(missed)}.\n")
        return ok and not missed

    def extension(self, limit: float) -> bool:
        assert self.build is not None
        try:
            code = self.build.wait(timeout=max(1.0, limit))
        except subprocess.TimeoutExpired:
            os.killpg(self.build.pid, signal.SIGKILL)
            code = None
        if code != 0:
            why = f"did not finish within {limit:.0f} s more" if code is None else f"failed (exit {code})"
            self.write(f"\nThe extension build {why} (build.log): the run goes on without it (pure Python; its "
                       "checks and tests skip).\n")  # fmt: skip
            self.env["SPECDEC_DISABLE_EXTENSION"] = "1"
            return False
        time.sleep(0.1)  # let the timing thread see the exit
        took = f"{self.build_seconds:.0f} s" if self.build_seconds is not None else "?"
        self.write(f"\nExtension built in {took}{' (a dry run builds nothing)' if self.dry else ''}.\n\n")
        code, _ = self.run([sys.executable, "bench/first_light.py", "--out", str(self.summary), "--only", "extension",
                            "--header"], "tests.log", limit)  # fmt: skip
        return code == 0

    def tests(self, limit: float, which: str) -> bool:
        """``which``: "kv-cache" (the six cases, one process, long tracebacks), "gpu" or "triton"."""
        tracebacks: list[str] = []
        if which == "kv-cache":
            # a dry run tests the stage with the three quick cases (CI runs them all in the suite)
            quick = "triton and (partial_acceptance or loose_bounds)"
            selection = [KV_CACHE_TESTS, "-k", quick if self.dry else "triton"]
            tracebacks = ["--tb=long"]
        elif which == "gpu":
            selection = ["tests", "-m", "gpu"]
        elif self.dry:  # a small sample of the Triton paths: the dry run tests the stage, not the kernels
            selection = ["tests/test_tuning.py", "tests/test_kv_ops.py", "-k", "candidates or (triton and not bounds)"]
        else:  # the KV-cache cases ran in their own stage
            selection = ["tests", "-k", "triton", "-m", "not gpu", f"--ignore={KV_CACHE_TESTS}"]
        workers = ["-n", str(min(8, max(1, (os.cpu_count() or 2) // 2)))]
        if self.dry or which == "kv-cache":  # few tests: one process collects faster than workers start
            workers = ["-n", "2" if self.dry and which == "triton" else "0"]
        cmd = [sys.executable, "-m", "pytest", *selection, "-v", "-rfE", *tracebacks, "-p", "no:cacheprovider",
               *workers]  # fmt: skip
        env = dict(self.env, SPECDEC_FAILURES_LOG=str(self.out / "failures.log"))
        code, output = self.run(cmd, "tests.log", limit, env)
        final = [line for line in output.splitlines() if re.search(r"\d+ (passed|failed|skipped|error)", line)]
        if code is None or not final:
            counts = {w: len(re.findall(rf"\b{w.upper()}\b", output)) for w in ("passed", "failed", "skipped", "error")}
            result = f"cut at {limit:.0f} s; so far " + ", ".join(f"{n} {w}" for w, n in counts.items())
        else:
            result = final[-1].strip("= ")
        failures = [line for line in output.splitlines() if line.startswith(("FAILED", "ERROR"))]
        self.write(f"\n`pytest {' '.join(selection)}`: {result}\n")
        for line in failures[:30]:
            self.write(f"- {line}\n")
        if failures and which == "kv-cache":
            self.write("\nTheir tracebacks (--tb=long) are in failures.log and tests.log.\n")
        ok = code in (0, 5) and not failures  # 5: nothing collected (e.g. no gpu-marked test left)
        self.test_results[f"tests-{which}"] = (ok, result)
        return ok

    def bench(self, stage: Stage, limit: float) -> bool:
        name = stage.name
        script = BENCH / f"{name}.py"
        tables = self.scratch / name
        cmd = [sys.executable, str(script.relative_to(ROOT)), "--out", str(tables)]
        env = dict(self.env, **dict(stage.env))
        if self.dry:
            cmd += ["--device", "cpu", "--dry-run" if "bench_args(" in script.read_text() else "--quick"]
            if name in MODEL_BENCHES:
                env.pop("TRITON_INTERPRET", None)
        code, output = self.run(cmd, "bench.log", limit, env)
        rows = [line for line in output.splitlines() if line.startswith(("## ", "|"))]
        status = "done" if code == 0 else (f"cut at {limit:.0f} s" if code is None else f"failed (exit {code})")
        self.write(f"\n### {name}: {status}\n\n" + "\n".join(rows) + "\n")
        if code not in (0, None):
            self.write("```\n" + "\n".join(output.splitlines()[-15:]) + "\n```\n")
        return code == 0

    def info(self) -> None:
        code, output = self.run([sys.executable, "-m", "specdec", "info"], "info.txt", 60)
        gpu = ""
        if shutil.which("nvidia-smi") and not self.dry:
            gpu = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                                  "--format=csv"], capture_output=True, text=True).stdout  # fmt: skip
            (self.out / "info.txt").open("a").write(gpu)
        self.write("\n```\n" + output.strip() + ("\n" + gpu.strip() if gpu else "") + "\n```\n")

    def dispatch(self, stage: Stage, limit: float) -> bool:
        if stage.name == "first-light":
            return self.first_light(limit)
        if stage.name == "extension":
            return self.extension(limit)
        if stage.name.startswith("tests-"):
            return self.tests(limit, stage.name.removeprefix("tests-"))
        return self.bench(stage, limit)

    def bench_json(self) -> dict[str, dict]:
        """{file stem: its JSON} of every benchmark that wrote one (``bench_verify``, ``host_time``, ...)."""
        found = {}
        for path in sorted(self.scratch.glob("*/*.json")):
            try:
                found[path.stem] = json.loads(path.read_text())
            except (OSError, ValueError) as exc:  # a benchmark cut while writing: reported, not fatal
                self.write(f"\n{path.name} could not be read: {exc}\n")
        return found


def plan(stages: list[Stage], budget: float, dry: bool) -> tuple[list[tuple[Stage, bool]], float]:
    """([(stage, fits)], planned seconds): in order, each stage that still fits in the budget after the
    ones planned before it (a stage too long for what is left is skipped, a shorter one after it may run)."""
    planned, total = [], 0.0
    for s in stages:
        expected = s.dry_expected if dry else s.expected
        fits = total + expected <= budget
        planned.append((s, fits))
        total += expected if fits else 0
    return planned, total


def launched_kernels(rows: list[str]) -> set[str]:
    """Short kernel names in the configs column (the last cell) of first-light rows: ``rms_norm: w4; ...``."""
    names = set()
    for row in rows:
        configs = row.rstrip().rstrip("|").rsplit("|", 1)[-1]
        names.update(part.split(":")[0].strip() for part in configs.split(";") if ":" in part)
    return names


def all_kernels() -> set[str]:
    """Short names of every Triton kernel of the package (as first light's configs column writes them)."""
    from common import triton_kernels

    return {name.strip("_").removesuffix("_kernel") for name in triton_kernels()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--dry-run", action="store_true", help="on the CPU: interpreter, tiny shapes, no CUDA build")
    parser.add_argument("--stages", default="", help="stage names to run, comma-separated (default: all but optional)")
    args = parser.parse_args()
    names = [n for n in args.stages.split(",") if n]
    unknown = [n for n in names if n not in {s.name for s in STAGES}]
    if unknown:
        parser.error(f"--stages: no stage named {', '.join(unknown)} (stages: {', '.join(s.name for s in STAGES)})")
    budget_text = os.environ.get(BUDGET_ENV, str(DRY_BUDGET if args.dry_run else BUDGET))
    try:
        budget = float(budget_text)
    except ValueError:
        budget = float("nan")
    if not budget > 0:
        parser.error(f"{BUDGET_ENV} must be a positive number of seconds, got {budget_text!r}")
    args.out.mkdir(parents=True, exist_ok=True)
    check = Check(args.out, args.dry_run, budget)
    chosen = [s for s in STAGES if s.name in names or not names and (args.dry_run or not s.optional)]
    if "extension" in names and "first-light" not in names:
        check.start_build()

    # the plan: what fits, in order, with its expected seconds
    expected = {s.name: s.dry_expected if args.dry_run else s.expected for s in chosen}
    planned, total = plan(chosen, budget, args.dry_run)
    mode = "dry run (CPU, interpreter, tiny shapes)" if args.dry_run else "GPU"
    check.write(f"# GPU check, {mode}: {time.strftime('%Y-%m-%d %H:%M:%S')}, budget {budget:.0f} s\n\n")
    check.write("| stage | expected s | limit s | plan | what |\n|---|---|---|---|---|\n")
    for s, fits in planned:
        check.write(f"| {s.name} | {expected[s.name]:.0f} | {s.limit:.0f} | {'run' if fits else 'skip'} | {s.what} |\n")
    check.write(f"\nPlanned: {total:.0f} s of {budget:.0f} s.\n")
    left_out = [s.name for s in STAGES if s.optional and s not in chosen]
    if left_out:
        check.write(f"Optional, not planned (run with --stages): {', '.join(left_out)}.\n")
    check.info()

    failed, skipped = [], []
    for s, _ in planned:
        left = check.left()
        if expected[s.name] > left:
            skipped.append(f"{s.name} (expected {expected[s.name]:.0f} s, {max(left, 0):.0f} s left)")
            continue
        began = time.monotonic()
        try:
            ok = check.dispatch(s, min(s.limit, left))
        except Exception as exc:  # a broken stage is a failed stage, the next one still runs
            check.write(f"\n{s.name}: the stage itself raised {type(exc).__name__}: {exc}\n")
            ok = False
        check.results.append((s.name, "ok" if ok else "FAILED", time.monotonic() - began))
        if not ok:
            failed.append(s.name)
    if check.build is not None and check.build.poll() is None:
        os.killpg(check.build.pid, signal.SIGKILL)

    check.write("\n## Result\n\n| stage | status | seconds |\n|---|---|---|\n")
    for name, status, seconds in check.results:
        check.write(f"| {name} | {status} | {seconds:.0f} |\n")
    if skipped:
        check.write("\nSkipped (budget): " + "; ".join(skipped) + "\n")
    results = check.bench_json()
    lines = targets(results, check.test_results, args.dry_run)
    check.write(targets_table(lines, args.dry_run))
    report = dict(stages=check.results, tests=check.test_results, targets=[vars(t) for t in lines], benches=results)
    (args.out / "results.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    elapsed = time.monotonic() - check.started
    verdict = "FAILED: " + ", ".join(failed) if failed else "all stages that ran passed"
    if args.dry_run and skipped:
        verdict += " (a dry run must run every stage)"
    check.write(f"\n{verdict}; {elapsed:.0f} s in all.\n")
    shutil.rmtree(check.scratch, ignore_errors=True)
    return 1 if failed or (args.dry_run and skipped) else 0


if __name__ == "__main__":
    sys.exit(main())
