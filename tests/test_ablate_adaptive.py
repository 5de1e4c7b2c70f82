"""The controller ablation (``bench/ablate_adaptive.py``): each variant switches its part off, and only its own
controller's; the replay table has a row per variant. And the benchmark of the controller's own time."""

from pathlib import Path

import pytest
from ablate_adaptive import VARIANTS, Ablated
from helpers import run_bench, table_rows
from replay import Trace, replay

import specdec.decoding.adaptive as adaptive
import specdec.decoding.step_cost as step_cost
from specdec.decoding.adaptive import AdaptiveSpeculation, StepCostModel

TRACE = Path(__file__).parent / "data" / "adaptive_trace.json"


def test_each_variant_switches_its_part_off():
    x = StepCostModel.features(4, 8, 2, 400.0)
    for name, table in (("no shape means", "shape_mean"), ("no level residuals", "residual")):
        ctl = Ablated(name)
        for seconds in (10.0, 11.0, 12.0):
            ctl.cost.observe(x, seconds)
        assert not getattr(ctl.cost, table), name
        full = AdaptiveSpeculation()
        for seconds in (10.0, 11.0, 12.0):
            full.cost.observe(x, seconds)
        assert getattr(full.cost, table), name  # the shipped controller keeps it
    assert Ablated("no exploration").explore_every > 10**8
    assert Ablated("pooled acceptance").acceptance.request_weight > 10**8
    ctl = Ablated("no warm-up ladder")
    ctl.bind(max_depth=8, max_nodes=9)
    assert ctl._warm_up == [8, 0]


def test_a_variants_constants_hold_only_while_its_controller_runs():
    trace = Trace.load(TRACE)
    seen = []

    class Spy(Ablated):
        def _explore(self, *args):  # called from choose, inside the variant's constants
            seen.append((adaptive.EXPLORE_MARGIN, step_cost.SHAPE_STEP_CAP))
            return super()._explore(*args)

    replay(trace, 2, seed=0, passes=1, controller=lambda clock: Spy("no exploration margin", clock=clock))
    assert seen and all(margin == 0.0 for margin, _ in seen)
    assert adaptive.EXPLORE_MARGIN > 0 and step_cost.SHAPE_STEP_CAP < 1  # restored
    for spec in VARIANTS.values():
        for name in spec.get("step_cost", {}):
            assert hasattr(step_cost, name), name
        for name in spec.get("adaptive", {}):
            assert hasattr(adaptive, name), name


@pytest.mark.parametrize("variant", ["no shape means", "no warm-up ladder"])
def test_a_variant_without_a_part_that_matters_replays_differently(variant):
    trace = Trace.load(TRACE)
    full = replay(trace, 8, seed=0, passes=1, controller=lambda clock: Ablated("full", clock=clock))
    other = replay(trace, 8, seed=0, passes=1, controller=lambda clock: Ablated(variant, clock=clock))
    assert full == replay(trace, 8, seed=0, passes=1)  # "full" is the shipped controller
    assert other != full


def test_the_replay_table_has_a_row_per_variant(tmp_path):
    run = run_bench("ablate_adaptive.py", "--replay", str(TRACE), "--seeds", "1", "--batches", "1", "--variants",
                    "no exploration", "--out", str(tmp_path))  # fmt: skip
    assert run.returncode == 0, run.stderr
    for condition in ("plain", "stalls"):
        path = tmp_path / f"ablation_replay_{condition}.md"
        for name in ("full", "no exploration"):
            assert len(table_rows(path, name)) == 1, (condition, name)


def test_the_serving_replay_table_has_a_row_per_variant_and_the_whole_controller_is_its_own_reference(tmp_path):
    serving_trace = Path(__file__).resolve().parents[1] / "bench" / "traces" / "embedded_pair_cpu_3e22767.json"
    run = run_bench("ablate_adaptive.py", "--serving", str(serving_trace), "--seeds", "1", "--rounds", "1", "--loads",
                    "2", "--variants", "no shape means", "--out", str(tmp_path))  # fmt: skip
    assert run.returncode == 0, run.stderr
    path = tmp_path / "ablation_serving.md"
    (full,) = table_rows(path, "full")
    (ablated,) = table_rows(path, "no shape means")
    assert full[2] == "+0.0000 +- 0.0000" and 0.9 < float(full[1]) < 1.1
    assert ablated[2] != full[2]


def test_the_controller_time_benchmark_times_the_controllers_calls(tmp_path):
    """``bench/bench_controller_time.py``: a row per batch size, the controller's time a positive share of a step."""
    run = run_bench("bench_controller_time.py", "--batches", "2", "--tokens", "6", "--rounds", "1", "--out",
                    str(tmp_path), cpu_path=True)  # fmt: skip
    assert run.returncode == 0, run.stderr
    (row,) = table_rows(tmp_path / "controller_time.md", "2")
    steps, per_step, step, share = int(row[1]), float(row[2]), float(row[3]), float(row[4].rstrip("%"))
    assert steps > 0 and per_step > 0 and step > 0 and 0 < share < 100
