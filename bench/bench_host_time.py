"""Host time of the public ops and of their unchecked calls: microseconds a call, batch 1.

A public call checks its arguments, picks the backend, allocates its results and plans its
launches; the unchecked call (``check=False``, or a model op's registered ``<op>_op.run``) skips the checks. On the
CPU the Triton bodies run with their launches captured (``tuning.capture_launches``): specdec's host
code runs, no kernel does, and Triton's own dispatch of each launch is left out. TRITON_INTERPRET=1 is
set only so that the Triton bodies are chosen for CPU tensors; with the launches captured the
interpreter never runs. ``--dispatch`` (CPU only) adds Triton's dispatch: the launches go through
Triton's JIT to ``stand_in_driver``'s launcher (kernels compiled for sm_90, nothing launched), which
leaves out only the real launcher's packing of the arguments and its driver call. On CUDA the calls
launch for real and a call's host time is the time until it returns.

Each sample times ``--inner`` calls in a row (one thread's CPU time on the CPU, wall time on CUDA,
one intra-op thread), the operations interleaved sample by sample after a warm-up; rows give the
median and p20/p80 of the per-call time and the launches a call makes, next to the target.

    python bench/bench_host_time.py                   # table on stdout
    python bench/bench_host_time.py --out OUT         # also OUT/host_time.json and OUT/host_time.md
    python bench/bench_host_time.py --out OUT.json    # the JSON to that file
    python bench/bench_host_time.py --dispatch        # on the CPU: with Triton's dispatch of every launch
    python bench/bench_host_time.py --dry-run         # a few calls (tests the script)

The JSON holds every row and a ``targets`` list: ``{"what", "value", "target", "pass"}``.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # before specdec decorates its kernels: the Triton bodies for CPU tensors
    _device = sys.argv[sys.argv.index("--device") + 1] if "--device" in sys.argv[:-1] else None
    import torch

    if (_device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cpu" and "--dispatch" not in sys.argv:
        os.environ["TRITON_INTERPRET"] = "1"

import contextlib
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from common import Table, bench_args, cpu_threads  # noqa: E402
from stand_in_driver import stand_in_driver, triton_bodies  # noqa: E402

from specdec import use_backend  # noqa: E402
from specdec.kernels import (  # noqa: E402
    SamplingParams,
    add_rms_norm,
    apply_rotary,
    rms_norm,
    sample,
    silu_mul,
    triton_dispatch,  # noqa: E402
    tuning,  # noqa: E402
    verify_chain,
    verify_chain_greedy,
    verify_tree,
    verify_tree_greedy,
)
from specdec.kernels.rms_norm import add_rms_norm_op, rms_norm_op  # noqa: E402
from specdec.kernels.rotary import apply_rotary_op  # noqa: E402
from specdec.kernels.silu_mul import silu_mul_op  # noqa: E402

PUBLIC_US, UNCHECKED_US = 25.0, 15.0  # issue 34's targets for a batch-1 call
VOCAB, K = 32000, 5
TREE = [-1, 0, 0, 0, 1, 1, 2, 2, 3, 4, 5, 6, 7, 8, 9, 10]  # 16 nodes, depth 4
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER = 4096, 32, 8, 128, 14336  # an 8B-shaped layer, one token


@dataclass
class Case:
    op: str
    entry: str  # "public", or the unchecked call: "check=False" or the registered op's "<op>_op.run"
    fn: Callable[[], object]
    fast_launch: bool = True  # False: Triton's own dispatch of every launch (SPECDEC_FAST_LAUNCH=0), no target

    @property
    def label(self) -> str:
        return self.entry if self.fast_launch else f"{self.entry}, fast launch off"

    @property
    def target(self) -> float | None:
        if not self.fast_launch:
            return None
        return PUBLIC_US if self.entry == "public" else UNCHECKED_US


def with_fast_launch_off(all_cases: list[Case]) -> list[Case]:
    """The cases, then the public verification calls and one model op again with Triton's own dispatch: what the
    fast launch path saves, where launches are dispatched (CUDA, or ``--dispatch``)."""
    again = {("verify_chain", "public"), ("verify_tree", "public"), ("sample", "public"),
             ("rms_norm", "rms_norm_op.run")}  # fmt: skip
    return all_cases + [replace(c, fast_launch=False) for c in all_cases if (c.op, c.entry) in again]


def cases(device: str) -> list[Case]:
    """Batch 1: a chain of K drafts (stochastic), a 16-node tree (deterministic), one draw, greedy
    chains and trees, and one token through each model op."""
    torch.manual_seed(0)
    i32 = dict(dtype=torch.int32, device=device)
    params = SamplingParams.make(1, temperature=0.8, top_k=50, top_p=0.9, seed=1, device=device)
    greedy = SamplingParams.make(1, device=device)
    chain_logits = torch.randn(K + 1, VOCAB, device=device)
    drafts, draft_offsets = torch.randint(0, VOCAB, (K,), **i32), torch.tensor([0, K], **i32)
    draft_probs = torch.softmax(torch.randn(K, VOCAB, device=device), -1)
    n = len(TREE)
    tree_logits = torch.randn(n, VOCAB, device=device)
    nodes, parents = torch.randint(0, VOCAB, (n,), **i32), torch.tensor(TREE, **i32)
    node_offsets = torch.tensor([0, n], **i32)
    depth = 4
    row = torch.randn(1, VOCAB, device=device)
    chain_args = (chain_logits, drafts, draft_offsets)
    tree_args = (tree_logits, nodes, parents, node_offsets)

    x = torch.randn(1, HIDDEN, device=device)
    residual, weight = torch.randn(1, HIDDEN, device=device), torch.ones(HIDDEN, device=device)
    normed = torch.empty_like(x)
    q, k = torch.randn(1, HEADS, HEAD_DIM, device=device), torch.randn(1, KV_HEADS, HEAD_DIM, device=device)
    positions = torch.tensor([7], device=device)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, HEAD_DIM, 2, device=device).float() / HEAD_DIM)
    gate_up, act = torch.randn(1, 2 * INTER, device=device), torch.empty(1, INTER, device=device)
    return [
        Case("verify_chain", "public", lambda: verify_chain(
            *chain_args, params, rule="stochastic", draft_probs=draft_probs, max_draft_len=K)),
        Case("verify_chain", "check=False", lambda: verify_chain(
            *chain_args, params, rule="stochastic", draft_probs=draft_probs, max_draft_len=K, check=False)),
        Case("verify_tree", "public", lambda: verify_tree(*tree_args, params, rule="deterministic", max_depth=depth)),
        Case("verify_tree", "check=False", lambda: verify_tree(
            *tree_args, params, rule="deterministic", max_depth=depth, check=False)),
        Case("sample", "public", lambda: sample(row, params)),
        Case("sample", "check=False", lambda: sample(row, params, check=False)),
        Case("verify_chain_greedy", "public", lambda: verify_chain_greedy(*chain_args, greedy, max_draft_len=K)),
        Case("verify_chain_greedy", "check=False", lambda: verify_chain_greedy(
            *chain_args, greedy, max_draft_len=K, check=False)),
        Case("verify_tree_greedy", "public", lambda: verify_tree_greedy(*tree_args, greedy, max_depth=depth)),
        Case("verify_tree_greedy", "check=False", lambda: verify_tree_greedy(
            *tree_args, greedy, max_depth=depth, check=False)),
        Case("rms_norm", "public", lambda: rms_norm(x, weight, 1e-5, out=normed)),
        Case("rms_norm", "rms_norm_op.run", lambda: rms_norm_op.run(x, weight, 1e-5, normed)),
        Case("add_rms_norm", "public", lambda: add_rms_norm(x, residual, weight, 1e-5, out=normed)),
        Case("add_rms_norm", "add_rms_norm_op.run", lambda: add_rms_norm_op.run(x, residual, weight, 1e-5, normed)),
        Case("apply_rotary", "public", lambda: apply_rotary(q, k, positions, inv_freq)),
        Case("apply_rotary", "apply_rotary_op.run", lambda: apply_rotary_op.run(q, k, positions, inv_freq)),
        Case("silu_mul", "public", lambda: silu_mul(gate_up, out=act)),
        Case("silu_mul", "silu_mul_op.run", lambda: silu_mul_op.run(gate_up, act)),
    ]  # fmt: skip


def measure(all_cases: list[Case], device: str, samples: int, inner: int, warmup: int,
            launched: list | None = None) -> list[dict]:  # fmt: skip
    """Per case: median, p20, p80 microseconds a call and launches a call, the cases interleaved. ``launched``: the
    stand-in driver's list of launches (``--dispatch``); else CPU launches are captured."""
    cuda = device.startswith("cuda")
    now = time.perf_counter if cuda else time.thread_time
    capture = contextlib.nullcontext if cuda or launched is not None else tuning.capture_launches
    times: list[list[float]] = [[] for _ in all_cases]
    launches = [0] * len(all_cases)
    for round_ in range(warmup + samples):
        for i, case in enumerate(all_cases):
            if launched is not None:
                launched.clear()
            with capture() as recorded:
                previous = triton_dispatch._enabled
                if not case.fast_launch:
                    triton_dispatch._enabled = False
                start = now()
                for _ in range(inner):
                    case.fn()
                elapsed = now() - start
                triton_dispatch._enabled = previous
            if round_ >= warmup:
                times[i].append(1e6 * elapsed / inner)
            recorded = launched if launched is not None else recorded
            if recorded is not None:
                launches[i] = len(recorded) // inner
        if cuda:
            torch.cuda.synchronize()  # (between samples: the queue never fills and blocks a call)
    rows = []
    for case, samples_us, n in zip(all_cases, times, launches):
        q = statistics.quantiles(samples_us, n=10) if len(samples_us) > 1 else samples_us * 9
        median = statistics.median(samples_us)
        rows.append(dict(op=case.op, entry=case.label, median_us=median, p20_us=q[1], p80_us=q[7],
                         launches=None if cuda else n, target_us=case.target,
                         ok=None if case.target is None else median <= case.target))  # fmt: skip
    return rows


def main() -> None:
    def extra(parser):
        parser.add_argument("--samples", type=int, default=200, help="timed samples per operation")
        parser.add_argument("--inner", type=int, default=10, help="calls per sample")
        parser.add_argument("--dispatch", action="store_true",
                            help="CPU: launches dispatched by Triton to a stand-in sm_90 driver")  # fmt: skip

    args = bench_args(__doc__.splitlines()[0], extra)
    samples, inner, warmup = (2, 2, 1) if args.dry_run else (args.samples, args.inner, 20)
    cpu_threads(args.device)
    cuda = args.device.startswith("cuda")
    if args.dispatch and cuda:
        raise SystemExit("--dispatch stands in for a GPU: run it with --device cpu")
    with torch.inference_mode():
        if args.dispatch:
            mode = "launches dispatched by Triton to a stand-in sm_90 driver (nothing runs)"
            with stand_in_driver() as launched, triton_bodies():
                rows = measure(with_fast_launch_off(cases(args.device)), args.device, samples, inner, warmup,
                               launched)  # fmt: skip
        else:
            mode = "launched" if cuda else "launches captured (Triton bodies, nothing runs)"
            all_cases = with_fast_launch_off(cases(args.device)) if cuda else cases(args.device)
            with use_backend("triton"):
                rows = measure(all_cases, args.device, samples, inner, warmup)
    table = Table(
        f"Host time per call, batch 1 ({args.device}, {mode}; {samples} samples x {inner} calls, one thread)",
        ["op", "entry", "median µs", "p20 µs", "p80 µs", "launches", "target µs", "met"],
    )
    for r in rows:
        launches = "-" if r["launches"] is None else r["launches"]
        met = "-" if r["ok"] is None else "PASS" if r["ok"] else "FAIL"
        table.add(r["op"], r["entry"], r["median_us"], r["p20_us"], r["p80_us"], launches, r["target_us"] or "-", met)
    targets = [
        dict(what=f"host time of {r['op']} ({r['entry']}), batch 1, µs", value=round(r["median_us"], 2),
             target=r["target_us"], **{"pass": r["ok"]})
        for r in rows
        if r["target_us"] is not None
    ]  # fmt: skip
    report = dict(device=args.device, mode=mode, samples=samples, inner=inner, rows=rows, targets=targets)
    if args.out is not None:
        if args.out.suffix == ".json":
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=1) + "\n")
        else:
            table.write(args.out, "host_time")
            (args.out / "host_time.json").write_text(json.dumps(report, indent=1) + "\n")
    failed = [t["what"] for t in targets if not t["pass"]]
    print(f"\n{len(targets) - len(failed)} of {len(targets)} targets met")


if __name__ == "__main__":
    main()
