"""The GPU check (``bench/gpu_check.sh``): its plan fits the budgets, its arguments are checked, and a short
dry run writes the summary a GPU run would (CI runs the whole dry run: ``make gpu-dry-run``)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import gpu_check
import gpu_targets
from common import triton_kernels

ROOT = Path(__file__).resolve().parent.parent

EIGHT_MINUTES = 480  # issues 18 and 34: the bound for the whole check on an H200
CI_DRY_RUN = 200  # the dry run's share of CI: 3 minutes 20 s
# issue 34's Targets table, one line per bound (its combined rows split in two)
TARGET_LINES = [
    ("decode attention, context >= 4k, batch >= 8", ">= 85% of copy bandwidth"),
    ("decode attention, every row", ">= 1.0x SDPA"),
    ("decode attention, batch 1", "fitted fixed cost <= 22 us"),
    ("64-node tree, batch >= 8", ">= 2x SDPA+mask"),
    ("64-node tree, batch >= 8", ">= 40% of dense bf16 peak"),
    ("64-node tree vs FlexAttention", "reported"),
    ("chain of 8", ">= 1.5x SDPA+mask"),
    ("8B-shaped decode step with graphs", "<= 1.25x the weight-bandwidth floor"),
    ("verification at batch >= 8", "<= 1.5x its byte floor"),
    ("verification at batch 1, inside a graph", "<= 15 us GPU time"),
    ("public verify_chain / verify_tree / sample call, batch 1", "<= 25 us host time"),
    ("unchecked run_* entry", "<= 15 us host time"),
    ("paged rollback, batch 64", "<= 2x its byte floor"),
    ("gpu-marked and compiled Triton tests", "all pass, the six KV-cache cases included"),
]


def test_the_gpu_plan_runs_every_stage_within_eight_minutes():
    default = [s for s in gpu_check.STAGES if not s.optional]
    assert gpu_check.BUDGET <= EIGHT_MINUTES
    planned, total = gpu_check.plan(default, gpu_check.BUDGET, dry=False)
    assert all(fits for _, fits in planned), [s.name for s, fits in planned if not fits]
    assert total == sum(s.expected for s in default) <= gpu_check.BUDGET
    assert [s.name for s in gpu_check.STAGES if s.optional] == ["bench_model", "bench_sampling", "bench_e2e",
                                                                "bench_split_partials"]  # fmt: skip
    names = [s.name for s in default]
    assert names == ["first-light", "extension", "tests-kv-cache", "tests-gpu", "tests-triton",  # issue 34's order
                     "bench_tree_attention", "bench_verify", "bench_kv_rollback", "bench_model_ops", "bench_host_time",
                     "bench_step"]  # fmt: skip
    assert dict(gpu_check.STAGES[names.index("bench_tree_attention")].env) == {"SPECDEC_AUTOTUNE": "1"}
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
    assert {"tree_attention", "merge_splits", "tree_walk", "rms_norm"} <= kernels
    assert len(kernels) == len(triton_kernels())


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
                                                             "failures.log", "bench.log", "results.json"}  # fmt: skip
    statuses = target_statuses(summary)
    assert statuses[TARGET_LINES[12]] in ("PASS", "FAIL")  # rollback measured (tiny shapes)
    assert all(statuses[line] == "not measured" for line in TARGET_LINES[:12])  # their stages did not run
    assert statuses[TARGET_LINES[13]] == "not measured"
    report = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [t["status"] for t in report["targets"]] == [statuses[line] for line in TARGET_LINES]
    assert report["benches"]["bench_kv_rollback"]["rows"]  # the benchmark's rows beside the targets


def target_statuses(summary: str) -> dict[tuple[str, str], str]:
    """{(what, target): status} from the summary's table of issue 34's targets; every line exactly once."""
    table = summary[summary.index("## Issue 34's targets") :]
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in table.splitlines() if line.startswith("| ")]
    found = {(r[0], r[1]): r[3] for r in rows[1:]}
    assert len(rows) - 1 == len(found) == len(TARGET_LINES) and set(found) == set(TARGET_LINES), found
    assert set(found.values()) <= {"PASS", "FAIL", "not measured"}
    return found


def fake_results(changes: dict | None = None) -> dict:
    """The benchmarks' JSON as a GPU run writes it, every target met; ``changes`` ({(bench, row, field): value})
    replaces rows' fields."""
    tree_rows = []
    for batch in (1, 8):
        for context in (1024, 4096):
            nbytes = batch * context * 4096
            tree_rows += [
                dict(batch=batch, context=context, shape="decode", bytes=nbytes, planned_us=10 + nbytes / 3.8e6,
                     pct_copy=90.0, x_sdpa=1.1),
                dict(batch=batch, context=context, shape="chain 8", x_sdpa=2.0),
                dict(batch=batch, context=context, shape="tree 64", x_sdpa=2.5, pct_peak=45.0, x_flex=1.3),
            ]  # fmt: skip
    results = dict(
        bench_tree_attention=dict(rows=tree_rows, flex_errors=[], peak_tflops=989.4, peak_source="H200 data sheet"),
        bench_step=dict(rows=[dict(batch=1, kind="decode", graphs=True, x_floor=1.2),
                              dict(batch=1, kind="decode", graphs=False, x_floor=3.0)]),
        bench_verify=dict(rows=[dict(case="chain B=1 K=4", batch=1, x_floor=4.0, graph_us=9.0),
                                dict(case="chain B=8 K=4", batch=8, x_floor=1.4, graph_us=20.0)]),
        host_time=dict(targets=[
            dict(what="host time of sample (public), batch 1, µs", value=20.0, target=25, **{"pass": True}),
            dict(what="host time of sample (check=False), batch 1, µs", value=9.0, target=15, **{"pass": True}),
        ]),
        bench_kv_rollback=dict(rows=[{"layout": "paged", "batch": "64", "paths": "tree", "x floor": "1.90"},
                                     {"layout": "paged", "batch": "64", "paths": "chains", "x floor": "-"},
                                     {"layout": "contiguous", "batch": "64", "paths": "tree", "x floor": "9.0"}]),
    )  # fmt: skip
    for (bench, index, field), value in (changes or {}).items():
        results[bench]["rows"][index][field] = value
    return results


PASSED = {name: (True, "10 passed in 1.0s") for name in gpu_targets.TEST_STAGES}


def statuses_of(results, tests=PASSED, dry=False) -> list[str]:
    lines = gpu_check.targets(results, tests, dry)
    assert [(t.what, t.target) for t in lines] == TARGET_LINES
    return [t.status for t in lines]


def test_every_target_passes_on_a_run_that_meets_them_and_each_fails_alone():
    assert statuses_of(fake_results()) == ["PASS"] * len(TARGET_LINES)
    breaks = {  # one change each -> the one target line it breaks
        ("bench_tree_attention", 9, "pct_copy"): (84.0, 0),  # decode, batch 8, context 4096
        ("bench_tree_attention", 0, "x_sdpa"): (0.99, 1),  # any decode row
        ("bench_tree_attention", 0, "planned_us"): (40.0, 2),  # batch 1's fit: a fixed cost past 22 us
        ("bench_tree_attention", 8, "x_sdpa"): (1.9, 3),  # tree, batch 8
        ("bench_tree_attention", 11, "pct_peak"): (39.0, 4),
        ("bench_tree_attention", 1, "x_sdpa"): (1.4, 6),  # chain 8
        ("bench_step", 0, "x_floor"): (1.3, 7),
        ("bench_verify", 1, "x_floor"): (1.6, 8),
        ("bench_verify", 0, "graph_us"): (16.0, 9),
        ("bench_kv_rollback", 0, "x floor"): ("2.10", 12),
    }
    for change, (value, index) in breaks.items():
        statuses = statuses_of(fake_results({change: value}))
        assert statuses == ["PASS"] * index + ["FAIL"] + ["PASS"] * (len(TARGET_LINES) - index - 1), change
    # rows outside a target's sizes do not count against it
    assert statuses_of(fake_results({("bench_tree_attention", 2, "x_sdpa"): 1.0}))[3] == "PASS"  # tree, batch 1
    assert statuses_of(fake_results({("bench_verify", 0, "x_floor"): 9.0}))[8] == "PASS"  # batch 1
    assert statuses_of(fake_results({("bench_step", 1, "x_floor"): 9.0}))[7] == "PASS"  # graphs off


def test_failures_that_are_not_rows_fail_their_lines():
    results = fake_results()
    results["host_time"]["targets"][1].update(value=16.0, **{"pass": False})
    for row in results["bench_tree_attention"]["rows"]:
        row.pop("x_flex", None)
    results["bench_tree_attention"]["flex_errors"] = ["Traceback (most recent call last):\n  ...\nRuntimeError: no"]
    statuses = statuses_of(results, dict(PASSED, **{"tests-kv-cache": (False, "1 failed, 5 passed in 3.0s")}))
    assert [i for i, s in enumerate(statuses) if s == "FAIL"] == [5, 11, 13]
    flex = gpu_check.targets(results, PASSED, False)[5]
    assert "RuntimeError: no" in flex.value  # the error's last line, the whole of it in bench.log


def test_what_did_not_run_is_not_measured():
    assert statuses_of({}, {}) == ["not measured"] * len(TARGET_LINES)
    results = fake_results()
    del results["bench_verify"]
    statuses = statuses_of(results, {"tests-gpu": PASSED["tests-gpu"]})
    assert [i for i, s in enumerate(statuses) if s != "PASS"] == [8, 9, 13]
    assert set(statuses[i] for i in (8, 9, 13)) == {"not measured"}
    line = gpu_check.targets(results, {}, False)[8]
    assert "no bench_verify.json" in line.value


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
