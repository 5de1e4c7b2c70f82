"""Timing and reporting shared by the microbenchmarks in bench/.

Every benchmark measures specdec next to its peer in the same run and reports
median and p20/p80 times. On CUDA, times come from ``triton.testing.do_bench``
(CUDA events, cache flushed between runs); on the CPU from a perf_counter loop.
``--dry-run`` (the GPU check's CPU rehearsal) means tiny shapes and one timed run.
A table made with ``configs=True`` ends each row with the kernel configurations the
row launched (``specdec.kernels.tuning``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from specdec.kernels import tuning

DRY_RUN = False  # set by bench_args(--dry-run): one timed run per measurement


def bench_args(description: str) -> argparse.Namespace:
    """The flags every benchmark script takes."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="small shapes only (CPU smoke run)")
    parser.add_argument("--out", type=Path, default=None, help="folder for the markdown table")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes, one timed run (tests the script)")
    args = parser.parse_args()
    global DRY_RUN
    DRY_RUN = args.dry_run
    args.quick = args.quick or args.dry_run
    return args


def measure_us(fn: Callable[[], object], device: str, min_runs: int = 5, budget_s: float = 1.0) -> tuple[float, ...]:
    """(median, p20, p80) wall time of ``fn()`` in microseconds."""
    if DRY_RUN:
        min_runs, budget_s = 1, 0.0
    if device.startswith("cuda"):
        from triton.testing import do_bench

        ms = do_bench(fn, quantiles=[0.5, 0.2, 0.8], warmup=1 if DRY_RUN else 25, rep=1 if DRY_RUN else 100)
        return tuple(1e3 * t for t in ms)
    fn()  # warm-up
    times = []
    start = time.perf_counter()
    while len(times) < min_runs or (time.perf_counter() - start < budget_s and len(times) < 1000):
        t0 = time.perf_counter()
        fn()
        times.append(1e6 * (time.perf_counter() - t0))
    times.sort()
    q = statistics.quantiles(times, n=10) if len(times) > 1 else times * 9
    return statistics.median(times), q[1], q[7]


def copy_bandwidth_gbs(device: str, nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth measured here (read + write bytes per second)."""
    if not device.startswith("cuda"):
        nbytes = 1 << 26
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    median, _, _ = measure_us(lambda: dst.copy_(src), device)
    return 2 * nbytes / (median * 1e-6) / 1e9


class Table:
    """A markdown table printed as rows arrive and optionally written to a file; with ``configs``, each
    row ends with the kernel configurations launched since the previous row."""

    def __init__(self, title: str, columns: list[str], configs: bool = False):
        self.configs = configs
        columns = columns + ["kernel configs"] if configs else columns
        self.title, self.columns, self.rows = title, columns, []
        tuning.clear_chosen()
        print(f"\n## {title}\n")
        print("| " + " | ".join(columns) + " |")
        print("|" + "---|" * len(columns))
        sys.stdout.flush()

    def add(self, *values) -> None:
        cells = [f"{v:.1f}" if isinstance(v, float) else str(v) for v in values]
        if self.configs:
            cells.append(launched_configs())
        self.rows.append(cells)
        print("| " + " | ".join(cells) + " |")
        sys.stdout.flush()

    def write(self, out: Path | None, name: str) -> None:
        if out is None:
            return
        out.mkdir(parents=True, exist_ok=True)
        lines = [f"## {self.title}", "", "| " + " | ".join(self.columns) + " |", "|" + "---|" * len(self.columns)]
        lines += ["| " + " | ".join(r) + " |" for r in self.rows]
        (out / f"{name}.md").write_text("\n".join(lines) + "\n")


def launched_configs() -> str:
    """The configuration of every specdec kernel launched since the last call ('-' for none), then forget them."""
    chosen = tuning.chosen_configs()
    tuning.clear_chosen()
    if not chosen:
        return "-"
    return "; ".join(f"{short_name(name)}: {tuning.describe(c)}" for name, c in sorted(chosen.items()))


def short_name(kernel: str) -> str:
    """``_tree_walk_kernel`` -> ``tree_walk``."""
    return kernel.strip("_").removesuffix("_kernel")
