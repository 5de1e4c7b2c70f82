"""Timing and reporting shared by the benchmarks in bench/.

Every benchmark measures specdec next to its peer in the same run and reports median and
p20/p80 times (a ``Timing``, which also says how it was measured). On CUDA there are two methods:

* ``"graph"`` (kernel bodies): ``calls`` calls captured in one CUDA graph, each after a read-only
  L2 flush (a sum over twice the L2's size, which leaves no dirty lines for the timed call to write
  back), replayed and timed with CUDA events; a graph of the flushes alone is replayed beside it and
  subtracted, so a call costs its GPU time from a cold L2 with no launch gaps. A function that
  cannot be captured (it synchronises) falls back to ``"events"`` and the Timing says why.
* ``"events"`` (calls whose host time matters, e.g. a public op): CUDA events around each call,
  the same read-only flush before it; a host-bound call shows its host time.

On the CPU the methods of a comparison run interleaved (one call of each in turn) and are timed
with ``time.thread_time``, the calling thread's CPU time: on a shared machine the other processes'
load hits every method alike and sleeping or descheduled time is not counted, so the ratios between
methods stay meaningful even when the absolute times drift. Benchmarks set one intra-op thread on
the CPU (``cpu_threads``) so the thread's time is the work's time. ``--dry-run`` (the GPU check's
CPU rehearsal) means tiny shapes and one timed run.

Rows report bytes that must move over the copy bandwidth measured in the same run
(``copy_bandwidth_gbs``) or FLOP/s over the dense peak (``dense_peak_tflops``); ``fit_cost``
fits a fixed cost and a streaming rate to a benchmark's rows. A table made with ``configs=True``
ends each row with the kernel configurations the row launched (``specdec.kernels.tuning``), and
``Table.write`` saves the rows as markdown and as JSON (what the GPU check's summary reads).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import math
import pkgutil
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


def cpu_path_only(args: argparse.Namespace) -> None:
    """For benchmarks of the CPU path: refuse another ``--device`` and Triton's interpreter (which would stand in for
    a GPU's kernels), then set one intra-op thread."""
    from specdec import _backend

    if args.device != "cpu":
        raise SystemExit(f"--device: this benchmark measures the CPU path, got {args.device!r}")
    if _backend.interpreter_enabled():
        raise SystemExit("TRITON_INTERPRET is set: Triton's interpreter would stand in for a GPU; run with it unset")
    cpu_threads("cpu")


def clock(device: str) -> Callable[[], float]:
    """Seconds now: per-thread CPU time on the CPU, wall time after a synchronize on CUDA."""
    if device.startswith("cuda"):

        def wall() -> float:
            torch.cuda.synchronize()
            return time.perf_counter()

        return wall
    return time.thread_time


class Timing(tuple):
    """(median, p20, p80) microseconds; ``method`` says how they were measured."""

    method: str

    def __new__(cls, median: float, p20: float, p80: float, method: str) -> Timing:
        timing = super().__new__(cls, (median, p20, p80))
        timing.method = method
        return timing


def measure_us(fn: Callable[[], object], device: str, min_runs: int = 5, budget_s: float = 1.0,
               method: str = "events") -> Timing:  # fmt: skip
    """(median, p20, p80) time of ``fn()`` in microseconds (see ``measure_many_us``)."""
    return measure_many_us([fn], device, min_runs, budget_s, method)[0]


def measure_many_us(
    fns: Sequence[Callable[[], object]],
    device: str,
    min_runs: int = 5,
    budget_s: float = 1.0,
    method: str | Sequence[str] = "events",
) -> list[Timing]:
    """(median, p20, p80) microseconds of each function: on CUDA by ``method`` ("graph" or "events", one
    for all or one per function), on the CPU interleaved, one call of each in turn."""
    if DRY_RUN:
        min_runs, budget_s = 1, 0.0
    methods = [method] * len(fns) if isinstance(method, str) else list(method)
    if len(methods) != len(fns) or not set(methods) <= {"graph", "events"}:
        raise ValueError(f"method must be 'graph' or 'events', one or one per function, got {method!r}")
    if device.startswith("cuda"):
        return [_graph_us(fn) if m == "graph" else _events_us(fn) for fn, m in zip(fns, methods)]
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
    return [Timing(*_quantiles(samples), "cpu thread time") for samples in times]


@functools.cache
def _l2_flush() -> Callable[[], object]:
    """A read-only flush of the current GPU's L2: a sum over twice its size into one preallocated float."""
    size = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "L2_cache_size", 0) or 64 << 20
    data = torch.ones(2 * size // 4, dtype=torch.float32, device="cuda")
    sink = torch.empty((), dtype=torch.float32, device="cuda")
    return lambda: torch.sum(data, out=sink)


def _events_us(fn: Callable[[], object], why: str = "") -> Timing:
    """CUDA events around each call, each after a read-only L2 flush; up to 100 calls or about 100 ms."""
    flush = _l2_flush()
    fn()  # compiles, autotuning
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        fn()
    end.record()
    torch.cuda.synchronize()
    reps = 2 if DRY_RUN else max(5, min(100, int(1e5 / max(1e3 * start.elapsed_time(end) / 3, 1.0))))
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in pairs:
        flush()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    samples = [1e3 * start.elapsed_time(end) for start, end in pairs]
    return Timing(*_quantiles(samples), "events" + (f" ({why})" if why else ""))


def _graph_us(fn: Callable[[], object]) -> Timing:
    """GPU time of one call: graphs of (flush, call) x n and of flush x n replayed in turn, their difference / n."""
    flush = _l2_flush()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up off the capture: compiles, autotuning, the allocator
        fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    calls = 2 if DRY_RUN else max(3, min(50, int(2000 / max(1e3 * start.elapsed_time(end), 1.0))))
    replays = 2 if DRY_RUN else 10

    def body():
        flush()
        fn()

    graphs = []
    try:
        for step in (flush, body):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(calls):
                    step()
            graphs.append(graph)
    except Exception as exc:  # it synchronises or allocates on the host: time it call by call instead
        torch.cuda.synchronize()
        return _events_us(fn, why=f"no graph: {type(exc).__name__}")
    samples = []
    for _ in range(replays):
        elapsed = []
        for graph in graphs:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            torch.cuda.synchronize()
            elapsed.append(1e3 * start.elapsed_time(end))
        samples.append(max(elapsed[1] - elapsed[0], 0.0) / calls)
    return Timing(*_quantiles(samples), f"graph x{calls}")


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


DENSE_PEAK_TFLOPS = {"H100": 989.4, "H200": 989.4, "GH200": 989.4, "A100": 312.0}  # 16-bit tensor cores


def dense_peak_tflops(device: str) -> tuple[float, str]:
    """(dense 16-bit TFLOP/s, where the figure comes from): the data sheet's for a known GPU (the SXM
    parts), else a matmul measured here (an unknown GPU in fp16, the CPU in fp32)."""
    if device.startswith("cuda"):
        name = torch.cuda.get_device_name()
        for part, peak in sorted(DENSE_PEAK_TFLOPS.items(), key=lambda item: -len(item[0])):
            if part in name and "PCIe" not in name:
                return peak, f"{part} data sheet"
    n, dtype = (4096, torch.float16) if device.startswith("cuda") else (128 if DRY_RUN else 512, torch.float32)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    median = measure_us(lambda: a @ b, device)[0]
    return 2 * n**3 / (median * 1e-6) / 1e12, f"measured {n}^3 {str(dtype)[6:]} matmul"


def fit_cost(points: Sequence[tuple[float, float]]) -> tuple[float, float] | None:
    """Least squares of time = fixed + bytes / rate over (bytes, µs) points: (fixed µs, rate GB/s; inf when the
    time does not grow with the bytes), or None with fewer than two distinct byte counts."""
    if len({b for b, _ in points}) < 2:
        return None
    n = len(points)
    mean_b = sum(b for b, _ in points) / n
    mean_t = sum(t for _, t in points) / n
    slope = sum((b - mean_b) * (t - mean_t) for b, t in points) / sum((b - mean_b) ** 2 for b, _ in points)
    rate = 1e-3 / slope if slope > 0 else math.inf  # µs per byte -> GB/s
    return mean_t - slope * mean_b, rate


def fit_table(title: str, groups: dict[str, list[tuple[float, float]]], copy_gbs: float) -> list[dict]:
    """Print the fixed cost and streaming rate of each group of (bytes, µs) rows; the fits as JSON records."""
    table = Table(title, ["rows", "points", "fixed µs", "streaming GB/s", "% copy"])
    fits = []
    for name, points in groups.items():
        fit = fit_cost(points)
        if fit is None:
            table.add(name, len(points), "-", "-", "- (one size)")
            continue
        fixed, rate = fit
        pct = 100 * rate / copy_gbs
        table.add(name, len(points), f"{fixed:.1f}", f"{rate:.0f}", f"{pct:.0f}%" if math.isfinite(pct) else "-")
        fits.append(dict(rows=name, points=len(points), fixed_us=fixed, gbs=rate if math.isfinite(rate) else None))
    return fits


class Table:
    """A markdown table printed as rows arrive and optionally written to files; with ``configs``, each
    row ends with the kernel configurations launched since the previous row."""

    def __init__(self, title: str, columns: list[str], configs: bool = False):
        self.configs = configs
        columns = columns + ["kernel configs"] if configs else columns
        self.title, self.columns, self.rows, self.records = title, columns, [], []
        if configs:  # the first row's configurations start here
            tuning.clear_chosen()
        print(f"\n## {title}\n")
        print("| " + " | ".join(columns) + " |")
        print("|" + "---|" * len(columns))
        sys.stdout.flush()

    def add(self, *values, data: dict | None = None) -> None:
        """One row; ``data`` (numbers for the JSON record, e.g. ``x_floor``) goes beside its cells."""
        cells = [f"{v:.1f}" if isinstance(v, float) else str(v) for v in values]
        if self.configs:
            cells.append(launched_configs())
        self.rows.append(cells)
        self.records.append({**dict(zip(self.columns, cells)), **(data or {})})
        print("| " + " | ".join(cells) + " |")
        sys.stdout.flush()

    def write(self, out: Path | None, name: str, extra: dict | None = None) -> None:
        """OUT/name.md (the table) and OUT/name.json (title, rows as records keyed by column, then ``extra``)."""
        if out is None:
            return
        out.mkdir(parents=True, exist_ok=True)
        lines = [f"## {self.title}", "", "| " + " | ".join(self.columns) + " |", "|" + "---|" * len(self.columns)]
        lines += ["| " + " | ".join(r) + " |" for r in self.rows]
        (out / f"{name}.md").write_text("\n".join(lines) + "\n")
        report = dict(title=self.title, rows=self.records, **(extra or {}))
        (out / f"{name}.json").write_text(json.dumps(report, indent=1, default=str) + "\n")


def triton_kernels() -> set[str]:
    """Every Triton kernel of ``specdec.kernels``: the jit functions named ``*_kernel`` defined in its modules
    (helpers are ``*_tl``). What the compile matrix and first light must each cover."""
    import specdec.kernels as package

    found = set()
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package.__name__}.{info.name}")
        for name, value in vars(module).items():
            if name.endswith("_kernel") and hasattr(value, "arg_names") and value.fn.__module__ == module.__name__:
                found.add(name)
    return found


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
