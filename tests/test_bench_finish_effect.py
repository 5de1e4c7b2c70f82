"""``bench/bench_finish_effect.py``: fixed depths timed per step and per whole static batch."""

from __future__ import annotations

import pytest
from bench_finish_effect import tail_share, tokens_at_depth
from forced_depths import StepRecord, full_batch_ms
from helpers import run_bench, table_rows


def test_a_shallower_chain_emits_what_the_deeper_one_accepted_up_to_its_depth():
    """Greedy chains accept the same prefix whatever their depth: per request 1 + min(accepted, depth), averaged
    over the whole-batch steps that drafted at least that deep (a step with part of the batch finished, or with
    an invalid request, does not count)."""
    steps = [
        StepRecord(running=3, depth=4, drafted=4, seconds=0.010, accepted=(4, 0, 2)),
        StepRecord(running=3, depth=4, drafted=4, seconds=0.012, accepted=(1, 3, 4)),
        StepRecord(running=2, depth=4, drafted=4, seconds=0.006, accepted=(4, 4)),  # part of the batch finished
        StepRecord(running=3, depth=4, drafted=4, seconds=0.011, accepted=(4, None, 4)),  # an invalid request
        StepRecord(running=3, depth=4, drafted=1, seconds=0.008, accepted=(1, 0, 1)),  # limits cut it to 1 level
    ]
    assert tokens_at_depth(steps, 3, 0) == pytest.approx((3 + 3 + 3) / 3)
    assert tokens_at_depth(steps, 3, 1) == pytest.approx((5 + 6 + 5) / 3)  # (2 + 1 + 2), (2 + 2 + 2), (2 + 1 + 2)
    assert tokens_at_depth(steps, 3, 2) == pytest.approx((7 + 8) / 2)  # (3 + 1 + 3), (2 + 3 + 3)
    assert tokens_at_depth(steps, 3, 4) == pytest.approx((9 + 11) / 2)
    assert tokens_at_depth(steps, 4, 1) is None
    assert full_batch_ms(steps, 3, 4) == pytest.approx(11.0)  # 10, 11, 12 ms: the limit-cut step is not depth 4
    assert full_batch_ms(steps, 3, 2) is None
    assert tail_share(steps, 3) == pytest.approx(0.006 / 0.047)
    assert tail_share([], 3) == 0.0


def test_the_quick_run_reports_every_depth_against_plain_decoding(tmp_path):
    done = run_bench("bench_finish_effect.py", "--quick", "--out", str(tmp_path), cpu_path=True)
    assert done.returncode == 0, done.stderr
    rows = table_rows(tmp_path / "finish_effect.md", "2")
    assert [row[1] for row in rows] == ["0", "1", "2"]
    assert rows[0][3] == "1.000x" and rows[0][6] == "1.000x" and rows[0][7] == "0.00"  # plain: no request ends early
    per_step = [float(row[5]) for row in rows]
    assert per_step[0] == 2.0  # plain decoding emits one token per request
    assert per_step == sorted(per_step) and all(t <= 2 * (d + 1) for d, t in enumerate(per_step))
    assert all(float(row[2]) > 0 and float(row[4]) > 0 and 0.0 <= float(row[7]) < 1.0 for row in rows)


def test_the_benchmark_refuses_a_depth_under_one():
    done = run_bench("bench_finish_effect.py", "--max-depth", "0", timeout=120)
    assert done.returncode == 2 and "--max-depth: must be an integer >= 1" in done.stderr
