"""The benchmarks' shared measurement code (bench/common.py) and the parts of the kernel benchmarks the GPU
check's summary depends on: the cost fit, the timing methods, the JSON a table writes, FlexAttention's kept
error and the step's byte floor."""

import json
import math
from pathlib import Path

import bench_step
import bench_tree_attention
import common
import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def test_the_fit_recovers_a_fixed_cost_and_a_streaming_rate():
    fixed_us, gbs = 7.0, 2000.0
    points = [(nbytes, fixed_us + nbytes / (gbs * 1e3)) for nbytes in (1e6, 4e6, 16e6, 64e6)]  # µs
    fixed, rate = common.fit_cost(points)
    assert fixed == pytest.approx(fixed_us) and rate == pytest.approx(gbs)
    noisy = [(b, t * (1.02 if i % 2 else 0.98)) for i, (b, t) in enumerate(points)]
    fixed, rate = common.fit_cost(noisy)
    assert abs(fixed - fixed_us) < 2 and abs(rate - gbs) < 0.1 * gbs
    assert common.fit_cost([(1e6, 5.0), (1e6, 6.0)]) is None  # one size: nothing to fit
    assert common.fit_cost([(1e6, 5.0), (2e6, 5.0)]) == (5.0, math.inf)  # flat: no streaming term


def test_cpu_timings_unpack_as_three_numbers_and_say_how_they_were_measured():
    (timing,) = common.measure_many_us([lambda: torch.ones(8).sum()], "cpu", min_runs=3, budget_s=0.0)
    median, p20, p80 = timing
    assert 0 < p20 <= median <= p80 and timing.method == "cpu thread time"
    with pytest.raises(ValueError, match="method must be 'graph' or 'events'"):
        common.measure_many_us([lambda: None], "cpu", method="wall")
    with pytest.raises(ValueError, match="method"):
        common.measure_many_us([lambda: None, lambda: None], "cpu", method=["graph"])


def test_a_table_writes_its_rows_as_json_records(tmp_path, capsys):
    table = common.Table("t", ["case", "x floor"])
    table.add("chain B=8", "1.20", data=dict(batch=8, x_floor=1.2))
    table.add("tree B=8", "-")
    table.write(tmp_path, "bench_x", dict(copy_gbs=100.0))
    report = json.loads((tmp_path / "bench_x.json").read_text())
    assert report["title"] == "t" and report["copy_gbs"] == 100.0
    assert report["rows"] == [{"case": "chain B=8", "x floor": "1.20", "batch": 8, "x_floor": 1.2},
                              {"case": "tree B=8", "x floor": "-"}]  # fmt: skip
    assert "| chain B=8 | 1.20 |" in (tmp_path / "bench_x.md").read_text()


def test_flex_attention_keeps_its_whole_error():
    n, length = 3, 5
    case = dict(n=n, length=length, q4=torch.randn(1, 4, n, 8), k_dense=torch.randn(1, 2, length, 8),
                v_dense=torch.randn(1, 2, length, 8), mask4=torch.ones(1, 1, 2, 2, dtype=torch.bool))  # fmt: skip
    fn, error = bench_tree_attention.flex_runner(case, "cpu", compiled=False)  # the mask is too small
    assert fn is None
    assert error.startswith("Traceback (most recent call last)") and "IndexError" in error
    assert error.count("\n") > 5  # the traceback, not a one-line summary
    case["mask4"] = torch.ones(n, length, dtype=torch.bool).tril(length - n).expand(1, 1, n, length)
    fn, error = bench_tree_attention.flex_runner(case, "cpu", compiled=False)
    assert error == "" and fn().shape == (1, 4, n, 8)


def test_the_step_floor_counts_every_weight_once_and_the_context():
    model = bench_step.random_model(bench_step.SHAPE_QUICK, torch.float32, "cpu")
    layer = (4 + 2 * 2) * 32 * 128 + 128 * 128 + 2 * 384 * 128 + 128 * 384 + 2 * 128  # qkv, o, gate_up, down, norms
    weights = 2 * layer + 128 + 4096 * 128  # two layers, the final norm, the LM head (not the embedding table)
    kv = 2 * 2 * 8 * bench_step.CONTEXT * 2 * 32  # layers x K/V x batch 8 x context x 2 KV heads x 32
    assert bench_step.floor_bytes(model, 8, 48) == 4 * (weights + 48 * 128 + kv)
