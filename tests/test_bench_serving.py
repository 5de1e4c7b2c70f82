"""``bench/bench_serving.py``: Poisson arrivals into the step engine, the depth policies behind one interface."""

from __future__ import annotations

import json

import pytest
from helpers import run_bench, table_rows
from serving_policies import CostTable, admit
from serving_workload import percentile, workload


def test_admission_takes_the_best_slots_of_the_whole_batch_while_they_pay():
    """Slots by survival, best first, whatever the request; the prefix with the most tokens per second."""
    survival = [[0.9, 0.72, 0.5], [0.3, 0.1], [0.95, 0.9, 0.85]]
    free = admit(survival, lambda drafted: 1.0)  # drafting costs nothing: every slot pays
    assert free == [3, 2, 3]
    dear = admit(survival, lambda drafted: 1.0 + 0.35 * drafted)  # each slot must bring 0.35 * rate tokens
    assert dear == [0, 0, 0]
    mid = admit(survival, lambda drafted: 1.0 + 0.12 * drafted)
    assert mid == [2, 0, 3]  # 0.95, 0.9, 0.9, 0.85, 0.72: (3 + 4.32) / 1.6; with 0.5 too, (3 + 4.82) / 1.72 is less
    assert admit([[], [0.9]], lambda drafted: 1.0) == [0, 1]  # a request that may not draft gets 0


def test_the_cost_table_interpolates_in_depth_and_batch():
    costs = CostTable((1, 4), ((1.0, 2.0, 3.0), (2.0, 4.0, 6.0)))
    assert costs.cost(1, 0) == 1.0 and costs.cost(1, 1) == 2.0 and costs.cost(4, 8) == 6.0
    assert costs.cost(4, 2) == pytest.approx(3.0)  # mean depth 0.5 at batch 4
    assert costs.cost(2, 2) == pytest.approx((2 / 3) * 2.0 + (1 / 3) * 4.0)  # depth 1, a third of the way to 4
    assert costs.cost(8, 40) == 6.0  # beyond the table: the nearest batch, the deepest depth
    assert costs.capacity(8, 10) == pytest.approx(8 / (2.0 * 10))  # plain steps of the largest batch timed


def test_workloads_are_seeded_and_percentiles_interpolate():
    pool = [[1, 2], [3, 4, 5], [6]]
    a, b = workload(pool, 20, 5.0, (4, 9), seed=3), workload(pool, 20, 5.0, (4, 9), seed=3)
    assert a == b and a != workload(pool, 20, 5.0, (4, 9), seed=4)
    assert a.arrivals[0] == 0.0 and all(x < y for x, y in zip(a.arrivals, a.arrivals[1:]))
    assert all(4 <= n <= 9 for n in a.lengths) and {tuple(p) for p in a.prompts} == {(1, 2), (3, 4, 5), (6,)}
    assert 2.0 < 19 / a.arrivals[-1] < 12.0, "about 5 arrivals per second"
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5 and percentile([1.0, 2.0, 3.0, 4.0], 99) == pytest.approx(3.97)
    assert percentile([7.0], 99) == 7.0


def test_the_quick_run_serves_every_policy_at_every_load(tmp_path):
    done = run_bench("bench_serving.py", "--quick", "--out", str(tmp_path), cpu_path=True)
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "serving.json").read_text())
    policies = ["plain", "K=1", "K=2", "adaptive", "slot admission"]
    assert [(r["load"], r["policy"]) for r in report["rows"]] == [(load, p) for load in (0.5, 2.0) for p in policies]
    for row in report["rows"]:
        assert row["throughput"] > 0 and 0 < row["ttft_p50"] <= row["ttft_p99"]
        assert 0 < row["tpot_p50"] <= row["tpot_p99"]
        assert row["tokens_per_step"] == 1.0 or (row["policy"] != "plain" and row["tokens_per_step"] > 1.0)
    assert len(report["costs"]["seconds"]) == len(report["costs"]["batches"]) == 3  # batches 1, 2, 4
    assert [row[0] for row in table_rows(tmp_path / "serving_targets.md", "2")] == ["2"]
    for chart in ("serving_throughput.png", "serving_tpot_p99.png"):
        assert (tmp_path / chart).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_join_step_benchmark_runs_both_ways_over_the_same_steps(tmp_path):
    done = run_bench("bench_join_step.py", "--quick", "--out", str(tmp_path), cpu_path=True)
    assert done.returncode == 0, done.stderr
    rows = json.loads((tmp_path / "join_step.json").read_text())["rows"]
    assert [(r["policy"], r["every"]) for r in rows] == [("plain", 1), ("plain", 4)]
    for row in rows:
        assert row["join_ratio"] > 0 and row["other_ratio"] > 0 and row["all_ratio"] > 0
        assert int(row["join steps"]) >= 1  # requests joined running ones
