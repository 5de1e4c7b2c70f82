"""Ablation of the adaptive controller (issue 39): each part switched off in turn, judged against the whole.

Each variant is the shipped ``AdaptiveSpeculation`` with one part of its machinery disabled (module constants
swapped in while its methods run, or a table that forgets what it is told), so every variant runs side by side
in one process, on the same work:

* ``--replay TRACE``: the recorded-trace replay of the static batch sweep (``bench/replay.py``), every variant on
  the same noise seeds, under the trace's own noise, and again with 2% stalled steps and the measured cost of
  switching between plain and drafting steps; ratios are the best fixed depth's seconds over the variant's.
* ``--serving TRACE``: the serving benchmark's Poisson arrivals replayed on a trace (``bench_serving.py --replay``),
  every variant and every fixed depth on the same workloads and clock seeds; ratios are paired per run.
* ``--tests``: the controller's tests once per variant (this module as a pytest plugin), and which fail.

    python bench/ablate_adaptive.py --replay bench/traces/embedded_pair_cpu_dbf04f7.json --seeds 20
    python bench/ablate_adaptive.py --serving bench/traces/embedded_pair_cpu_3e22767.json --seeds 10
    python bench/ablate_adaptive.py --tests
"""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
from pathlib import Path

from common import Table

from specdec.decoding import adaptive as adaptive_module
from specdec.decoding import step_cost as step_cost_module
from specdec.decoding.adaptive import AdaptiveSpeculation, warm_up_depths

INF = math.inf


class _Forgetful(dict):
    """A table that keeps nothing: the part of the cost model that reads it falls back to what it does without."""

    def __setitem__(self, key, value):
        pass


VARIANTS: dict[str, dict] = {
    "full": {},
    "no outlier caps": dict(step_cost=dict(FIT_OUTLIER_CAP=INF, SHAPE_STEP_CAP=INF)),
    "no level residuals": dict(forget=("residual",)),
    "no shape means": dict(forget=("shape_mean",)),  # the ridge fit alone (the residuals rest on the means)
    "one warm-up ladder": dict(
        adaptive=dict(warm_up_depths=lambda m: warm_up_depths(m)[: len(warm_up_depths(m)) // 2])
    ),
    "no warm-up ladder": dict(adaptive=dict(warm_up_depths=lambda m: [m, 0])),
    "no exploration": dict(explore_every=10**9),
    "no exploration margin": dict(adaptive=dict(EXPLORE_MARGIN=0.0)),
    "pooled acceptance": dict(request_weight=1e9),
}


@contextlib.contextmanager
def _swapped(module, values: dict):
    saved = {name: getattr(module, name) for name in values}
    for name, value in values.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


class Ablated(AdaptiveSpeculation):
    """``AdaptiveSpeculation`` with the parts named by ``VARIANTS[variant]`` switched off."""

    def __init__(self, variant: str, **kwargs):
        spec = VARIANTS[variant]
        self._spec = spec
        if "explore_every" in spec:  # (a caller's own value stands: the tests of bad options pass one)
            kwargs.setdefault("explore_every", spec["explore_every"])
        with self._patched():
            super().__init__(**kwargs)
        for table in spec.get("forget", ()):
            setattr(self.cost, table, _Forgetful())
        if "request_weight" in spec:
            self.acceptance.request_weight = spec["request_weight"]

    @contextlib.contextmanager
    def _patched(self):
        spec = self._spec
        with _swapped(step_cost_module, spec.get("step_cost", {})), _swapped(adaptive_module, spec.get("adaptive", {})):
            yield


def _wrap(name):
    method = getattr(AdaptiveSpeculation, name)

    def wrapped(self, *args, **kwargs):
        with self._patched():
            return method(self, *args, **kwargs)

    wrapped.__name__ = name
    return wrapped


for _name in ("bind", "start", "forget", "choose", "restart_clock", "observe"):
    setattr(Ablated, _name, _wrap(_name))


def pytest_configure(config) -> None:
    """As a pytest plugin (``--tests``): every ``AdaptiveSpeculation`` the tests make is the variant named by
    ``SPECDEC_ABLATE``."""
    import os
    import sys

    variant = os.environ.get("SPECDEC_ABLATE")
    if variant is None:
        return

    class Variant(Ablated):
        def __init__(self, **kwargs):
            super().__init__(variant, **kwargs)

    for module in list(sys.modules.values()):  # every module that imported the class by name
        if getattr(module, "AdaptiveSpeculation", None) is AdaptiveSpeculation:
            module.AdaptiveSpeculation = Variant


def tests_ablation(variants: list[str], tests: list[str]) -> None:
    """Runs ``tests`` once per variant (this module as a pytest plugin) and prints the tests each variant fails."""
    import os
    import subprocess
    import sys

    here = Path(__file__).resolve().parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(here), str(here.parent), os.environ.get("PYTHONPATH", "")]))
    print("| variant | tests failed |\n|---|---|")
    for name in variants:
        run = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "ablate_adaptive", "-p", "no:cacheprovider", "-rf", *tests],
            env=dict(env, SPECDEC_ABLATE=name), capture_output=True, text=True, cwd=here.parent,
        )  # fmt: skip
        failed = [
            line.split("::", 1)[1].split(" - ")[0] for line in run.stdout.splitlines() if line.startswith("FAILED")
        ]
        print(f"| {name} | {', '.join(failed) or 'none'} |", flush=True)


def replay_ablation(trace_path: Path, variants: list[str], batches: list[int], seeds: int, out: Path | None) -> None:
    from replay import SwitchPenalty, Trace, replay, replay_fixed

    trace = Trace.load(trace_path)
    conditions = [("trace noise", 0.0, None), ("2% stalls, switch 50%/15%", 0.02, SwitchPenalty(0.5, 0.15, 4))]
    for label, stalls, switch in conditions:
        table = Table(
            f"Controller ablation, replay of {trace_path.name}, {label}, {seeds} seeds: best fixed depth's seconds "
            f"over the variant's (mean over seeds), and the variant's mean over batches less the full controller's "
            f"(paired by seed, +- its standard error)",
            ["variant", *(f"B={b}" for b in batches), "mean", "vs full"],
        )
        ratios = {}
        for batch in batches:
            best = min(replay_fixed(trace, batch, k, switch) for k in range(trace.max_depth + 1))
            for name in variants:
                ratios[name, batch] = [
                    best / replay(trace, batch, seed=s, stalls=stalls, switch=switch,
                                  controller=lambda clock, n=name: Ablated(n, clock=clock)).seconds
                    for s in range(seeds)
                ]  # fmt: skip
        per_seed = {n: [statistics.mean(ratios[n, b][s] for b in batches) for s in range(seeds)] for n in variants}
        for name in variants:
            diffs = [a - b for a, b in zip(per_seed[name], per_seed["full"])]
            error = statistics.stdev(diffs) / math.sqrt(seeds) if seeds > 1 else 0.0
            table.add(
                name, *(f"{statistics.mean(ratios[name, b]):.3f}" for b in batches),
                f"{statistics.mean(per_seed[name]):.4f}", f"{statistics.mean(diffs):+.4f} +- {error:.4f}",
            )  # fmt: skip
        table.write(out, f"ablation_replay_{'stalls' if stalls else 'plain'}")


def serving_ablation(trace_path: Path, variants: list[str], loads: list[float], rounds: int, seeds: int,
                     max_depth: int, out: Path | None) -> None:  # fmt: skip
    """Every variant and every fixed depth on the serving benchmark's replay (``bench_serving.py --replay``): 8 slots,
    48 requests of 16-96 tokens, ``rounds`` workloads x ``seeds`` clock seeds per load."""
    from replay import Trace
    from serving_policies import FixedDepth
    from serving_replay import replay_rounds, trace_costs

    trace = Trace.load(trace_path)
    slots, lengths, requests = 8, (16, 96), 48
    capacity = trace_costs(trace, [slots], max_depth).capacity(slots, sum(lengths) / 2)

    class Variant:
        def __init__(self, name):
            self.name = name

        def controller(self, clock):
            return Ablated(self.name, clock=clock)

    fixed = [FixedDepth(d) for d in range(max_depth + 1)]
    table = Table(
        f"Controller ablation, serving replayed on {trace_path.name} ({slots} slots, {requests} requests of "
        f"{lengths[0]}-{lengths[1]} tokens, draft chain up to {max_depth}, {rounds} workloads x {seeds} clock seeds): "
        f"per load, the mean of throughput over the best fixed depth's, and the mean of the variant's over the full "
        f"controller's less 1, paired by run, +- standard error",
        ["variant", *(f"load {g:g}: / best fixed" for g in loads), *(f"load {g:g}: against full" for g in loads)],
    )
    cells = {}
    for load in loads:
        runs = replay_rounds(trace, fixed + [Variant(n) for n in variants], load * capacity, rounds, seeds, requests,
                             lengths, slots, max_depth)  # fmt: skip
        best = max((p.name for p in fixed), key=lambda n: statistics.mean(r.throughput for r in runs[n]))
        for name in variants:
            mine = [r.throughput for r in runs[name]]
            diffs = [a / b - 1 for a, b in zip(mine, (r.throughput for r in runs["full"]))]
            error = statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else 0.0
            cells[name, load] = (statistics.mean(a / b.throughput for a, b in zip(mine, runs[best])),
                                 f"{statistics.mean(diffs):+.4f} +- {error:.4f}")  # fmt: skip
        print(f"load {load:g} replayed", flush=True)
    for name in variants:
        table.add(name, *(f"{cells[name, g][0]:.3f}" for g in loads), *(cells[name, g][1] for g in loads))
    table.write(out, "ablation_serving")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replay", type=Path, help="replay the variants on this trace")
    parser.add_argument("--serving", type=Path, metavar="TRACE", help="the serving benchmark's Poisson arrivals, "
                        "replayed on this trace (recorded with --match-tokens 96), with every variant")  # fmt: skip
    parser.add_argument("--tests", nargs="*", help="run these tests (default: the controller's) with every variant")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--seeds", type=int, default=12)
    parser.add_argument("--loads", type=float, nargs="+", default=[0.5, 1.0, 2.0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-depth", type=int, default=4)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    variants = ["full", *(v for v in args.variants if v != "full")]
    if args.replay:
        replay_ablation(args.replay, variants, args.batches, args.seeds, args.out)
    if args.tests is not None:
        tests_ablation(variants, args.tests or ["tests/test_adaptive.py", "tests/test_adaptive_replay.py"])
    if args.serving:
        serving_ablation(args.serving, variants, args.loads, args.rounds, args.seeds, args.max_depth, args.out)


if __name__ == "__main__":
    main()
