"""Timing and reporting shared by the benchmarks in bench/.

Every benchmark measures specdec next to its peer in the same run and reports median and
p20/p80 times. On CUDA, times come from ``triton.testing.do_bench`` (CUDA events, cache flushed
between runs). On the CPU the methods of a comparison run interleaved (one call of each in turn)
and are timed with ``time.thread_time``, the calling thread's CPU time: on a shared machine the
other processes' load hits every method alike and sleeping or descheduled time is not counted,
so the ratios between methods stay meaningful even when the absolute times drift. Benchmarks
set one intra-op thread on the CPU (``cpu_threads``) so the thread's time is the work's time.
``--dry-run`` (the GPU check's CPU rehearsal) means tiny shapes and one timed run. A table made
with ``configs=True`` ends each row with the kernel configurations the row launched
(``specdec.kernels.tuning``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from specdec.kernels import tuning

DRY_RUN = False  # set by bench_args(--dry-run): one timed run per measurement


def bench_args(description: str, extra: Callable[[argparse.ArgumentParser], None] | None = None) -> argparse.Namespace:
    """The flags every benchmark script takes (``extra`` adds a script's own)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="small shapes only (CPU smoke run)")
    parser.add_argument("--out", type=Path, default=None, help="folder for the markdown table")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes, one timed run (tests the script)")
    if extra is not None:
        extra(parser)
    args = parser.parse_args()
    global DRY_RUN
    DRY_RUN = args.dry_run
    args.quick = args.quick or args.dry_run
    return args


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1 (argparse names the argument in its error)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def cpu_threads(device: str) -> None:
    """One intra-op thread on the CPU: ``time.thread_time`` then measures all of the work (and a shared
    machine's spinning OpenMP threads do not distort small ops)."""
    if not device.startswith("cuda"):
        torch.set_num_threads(1)


def clock(device: str) -> Callable[[], float]:
    """Seconds now: per-thread CPU time on the CPU, wall time after a synchronize on CUDA."""
    if device.startswith("cuda"):

        def wall() -> float:
            torch.cuda.synchronize()
            return time.perf_counter()

        return wall
    return time.thread_time


def measure_us(fn: Callable[[], object], device: str, min_runs: int = 5, budget_s: float = 1.0) -> tuple[float, ...]:
    """(median, p20, p80) time of ``fn()`` in microseconds (see ``measure_many_us``)."""
    return measure_many_us([fn], device, min_runs, budget_s)[0]


def measure_many_us(
    fns: Sequence[Callable[[], object]], device: str, min_runs: int = 5, budget_s: float = 1.0
) -> list[tuple[float, ...]]:
    """(median, p20, p80) microseconds of each function; on the CPU interleaved, one call of each in turn."""
    if DRY_RUN:
        min_runs, budget_s = 1, 0.0
    if device.startswith("cuda"):
        from triton.testing import do_bench

        warmup, rep = (1, 1) if DRY_RUN else (25, 100)
        return [tuple(1e3 * t for t in do_bench(fn, quantiles=[0.5, 0.2, 0.8], warmup=warmup, rep=rep)) for fn in fns]
    now = clock(device)
    for fn in fns:  # warm-up
        fn()
    times: list[list[float]] = [[] for _ in fns]
    start = now()
    while len(times[0]) < min_runs or (now() - start < budget_s * len(fns) and len(times[0]) < 1000):
        for fn, samples in zip(fns, times):
            t0 = now()
            fn()
            samples.append(1e6 * (now() - t0))
    return [_quantiles(samples) for samples in times]


def _quantiles(samples: list[float]) -> tuple[float, float, float]:
    samples = sorted(samples)
    q = statistics.quantiles(samples, n=10) if len(samples) > 1 else samples * 9
    return statistics.median(samples), q[1], q[7]


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
        if configs:  # the first row's configurations start here
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
