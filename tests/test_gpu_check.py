"""The GPU check (``bench/gpu_check.sh``): its plan fits the budgets, its arguments are checked, and a short
dry run writes the summary a GPU run would (CI runs the whole dry run: ``make gpu-dry-run``)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import gpu_check  # noqa: E402

from specdec.kernels import tuning  # noqa: E402

EIGHT_MINUTES = 480  # issue 18's bound for the whole check on an H200
CI_DRY_RUN = 180  # the dry run's share of CI: 3 minutes


def test_the_gpu_plan_runs_every_stage_within_eight_minutes():
    default = [s for s in gpu_check.STAGES if not s.optional]
    assert gpu_check.BUDGET <= EIGHT_MINUTES
    planned, total = gpu_check.plan(default, gpu_check.BUDGET, dry=False)
    assert all(fits for _, fits in planned), [s.name for s, fits in planned if not fits]
    assert total == sum(s.expected for s in default) <= gpu_check.BUDGET
    assert [s.name for s in gpu_check.STAGES if s.optional] == ["bench_model", "bench_sampling"]  # with --stages
    names = [s.name for s in gpu_check.STAGES]
    assert names[:4] == ["first-light", "extension", "tests-gpu", "tests-triton"]  # then benchmarks, by value
    assert all(name.startswith("bench_") for name in names[4:])
    assert gpu_check.STAGES[0].expected <= 60 and gpu_check.STAGES[0].limit <= 90  # first light is short


def test_the_dry_run_plan_fits_its_share_of_ci():
    planned, total = gpu_check.plan(gpu_check.STAGES, gpu_check.DRY_BUDGET, dry=True)  # optional stages too
    assert all(fits for _, fits in planned)
    assert total <= CI_DRY_RUN


def test_every_stage_may_run_its_expected_time():
    for stage in gpu_check.STAGES:
        assert stage.limit >= max(stage.expected, stage.dry_expected), stage.name


def test_a_short_budget_skips_what_does_not_fit_and_keeps_the_order():
    stages = [gpu_check.Stage(name, expected, 2 * expected, expected, "") for name, expected in
              [("a", 30), ("b", 50), ("c", 40), ("d", 20), ("e", 10)]]  # fmt: skip
    planned, total = gpu_check.plan(stages, 100, dry=False)
    assert [(s.name, fits) for s, fits in planned] == [("a", True), ("b", True), ("c", False), ("d", True),
                                                       ("e", False)]  # fmt: skip
    assert total == 100
    _, total = gpu_check.plan(gpu_check.STAGES, 100, dry=False)
    assert 0 < total <= 100


def test_every_benchmark_stage_has_its_script_and_a_dry_run():
    for stage in gpu_check.STAGES:
        if stage.name.startswith("bench_"):
            script = ROOT / "bench" / f"{stage.name}.py"
            assert script.exists(), stage.name
            assert "bench_args(" in script.read_text(), f"{stage.name} does not take --dry-run (common.bench_args)"


def test_first_light_rows_name_the_kernels_they_launched():
    rows = [
        "| model-ops | rms_norm | PASS | max err 1e-3 / ok | 0.5 | rms_norm: w4; rotary: HEAD_BLOCK=8 w4 |",
        "| sampling | sample | FAIL | ValueError: x | 0.1 |  |",
        "| kv | kv_append | PASS | equal | 0.2 | kv_append: w4 |",
    ]
    assert gpu_check.launched_kernels(rows) == {"rms_norm", "rotary", "kv_append"}
    kernels = gpu_check.all_kernels()
    assert {"tree_attention", "merge_splits", "tree_walk", "rms_norm", "greedy_walk"} <= kernels
    assert len(kernels) == len(tuning.triton_kernels())


def gpu_check_run(tmp_path, *args, **env):
    command = [sys.executable, "bench/gpu_check.py", *args, str(tmp_path / "out")]
    return subprocess.run(command, cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, timeout=300)


def test_unknown_stages_and_bad_budgets_are_refused(tmp_path):
    result = gpu_check_run(tmp_path, "--dry-run", "--stages", "bench_verify,bench_nope")
    assert result.returncode == 2 and "--stages: no stage named bench_nope" in result.stderr, result.stderr
    for budget in ("seven", "0", "-5", "nan"):
        result = gpu_check_run(tmp_path, "--dry-run", SPECDEC_GPU_CHECK_BUDGET=budget)
        assert result.returncode == 2, result.stderr
        assert f"SPECDEC_GPU_CHECK_BUDGET must be a positive number of seconds, got '{budget}'" in result.stderr
    assert not (tmp_path / "out").exists()  # refused before anything ran


def test_a_dry_run_stage_writes_the_summary(tmp_path):
    result = gpu_check_run(tmp_path, "--dry-run", "--stages", "bench_kv_rollback")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "| bench_kv_rollback | 5 | 60 | run |" in summary  # the plan, printed first
    assert "### bench_kv_rollback: done" in summary and "kernel configs |" in summary  # its table, configs column
    assert "| bench_kv_rollback | ok |" in summary and "all stages that ran passed" in summary
    assert {p.name for p in (tmp_path / "out").iterdir()} <= {"summary.md", "info.txt", "build.log", "tests.log",
                                                             "failures.log", "bench.log"}  # fmt: skip


def test_a_dry_run_that_skips_a_stage_fails(tmp_path):
    result = gpu_check_run(tmp_path, "--dry-run", "--stages", "bench_kv_rollback", SPECDEC_GPU_CHECK_BUDGET="1")
    assert result.returncode == 1
    summary = (tmp_path / "out" / "summary.md").read_text()
    assert "| bench_kv_rollback | 5 | 60 | skip |" in summary
    assert "Skipped (budget): bench_kv_rollback" in summary and "a dry run must run every stage" in summary


def test_failures_are_logged_as_they_happen(tmp_path):
    """A test stage cut at its limit keeps its tracebacks: each failure reaches SPECDEC_FAILURES_LOG when it is
    reported (here the run is killed right after a failing test, before pytest prints anything)."""
    probe = tmp_path / "test_probe.py"
    probe.write_text(
        "import os, signal\n\n"
        "def test_a_planted_failure():\n    assert 1 == 2, 'planted failure'\n\n"
        "def test_the_cut():\n    os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    log = tmp_path / "failures.log"
    env = dict(os.environ, SPECDEC_FAILURES_LOG=str(log), PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider", "-q", str(probe)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode != 0 and "failed" not in result.stdout  # killed before its summary
    text = log.read_text()
    assert "==== " in text and "test_a_planted_failure (call)" in text and "planted failure" in text
