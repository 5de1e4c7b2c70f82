"""End-to-end speculative decoding with the embedded pair: specdec vs HuggingFace, one run, same prompts.

Greedy (temperature 0), batch 1, each held-out prompt decoded alone for N new tokens
(EOS does not stop early), float32 weights from ``specdec/assets/pair`` for both libraries:

  specdec autoregressive | chain K=5 | tree 3,2,1,1,1 (deterministic rule) | n-gram K=5
  HF generate (greedy) | HF assisted generation (assistant_model = the draft) | HF prompt lookup (5 tokens)

tokens/s = generated tokens / time summed over prompts (prefill included); on the CPU the time
is the thread's CPU time with one intra-op thread (``common.clock``), on CUDA wall time;
tau = tokens per target forward (HF: counted with a forward hook on the target);
"identical" = every prompt's tokens equal specdec's autoregressive greedy tokens.
Then a temperature-1 run (specdec strategies with the tree on the stochastic rule, HF
sampling and HF assisted sampling): tokens/s and tau. Methods run interleaved prompt by
prompt, ``--repeats`` times, each (method, prompt) keeping its fastest run, so drifting
background load on a shared machine hits them all alike. Last, per strategy: the host
syncs of each step (counted, ``tests/sync_counter.py``) and the kernel launches of the
target forward it runs (counted by ``bench/count_launches.py`` with the Triton path
interpreted). A PNG bar chart of the greedy tokens/s goes to ``--out`` when matplotlib is
importable.

Last, the batch sweep of adaptive speculation (``batch_sweep``): batch 1, 2, 4, 8, 16, 32, greedy,
plain decoding, fixed draft chains K = 1..5 and the adaptive chain (K <= 8), plus n-gram K=5
(adaptive and fixed) against plain decoding at temperature 1; thread time, interleaved, each
(method, batch) the fastest of the repeats; a PNG line chart (``png_chart``: the venv has no
matplotlib) of the ratios to plain decoding goes to ``--out``. ``--sweep-only`` runs just that.

    python bench/bench_e2e.py --quick            # CPU smoke run: 2 prompts, 32 tokens
    python bench/bench_e2e.py --out OUT          # 6 prompts, 96 tokens, 3 repeats (CPU: one thread)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
from common import Table, bench_args, clock, cpu_threads  # noqa: E402
from png_chart import line_chart  # noqa: E402

from specdec.cli.demo import (  # noqa: E402
    ASSETS,
    Run,
    decode_all,
    first_difference,
    heldout_prompts,
    load_pair,
    strategies,
)


class ForwardCounter:
    """Counts forward calls of a transformers model (HF does not report its target forwards)."""

    def __init__(self, model):
        self.calls = 0
        model.register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        self.calls += 1


def hf_run(label, hf, counter, prompts, new_tokens, device, **kwargs) -> Run:
    """HuggingFace ``generate`` on each prompt alone; tau from the target's forward count (untimed: see
    ``interleaved``)."""
    tokens, forwards = [], 0
    for ids in prompts:
        x = torch.tensor([ids], device=device)
        counter.calls = 0
        with torch.inference_mode():
            y = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new_tokens, **kwargs)
        forwards += counter.calls
        tokens.append(y[0, len(ids) :].tolist())
    generated = sum(map(len, tokens))
    return Run(label, tokens, 0.0, generated, forwards, 0, 0)


def interleaved(methods, prompts, device: str, repeats: int) -> list[Run]:
    """Run every method on prompt 1, then every method on prompt 2, ..., ``repeats`` times over; each
    (method, prompt) keeps its fastest time (``common.clock``) and its first run's tokens and counters.

    On a shared machine the background load drifts over a run; interleaving spreads it evenly over
    the methods and the fastest of several runs drops the bursts, so the ratios stay meaningful.
    """
    now = clock(device)
    parts: list[list[Run]] = [[None] * len(methods) for _ in prompts]
    for _ in range(repeats):
        for part, p in zip(parts, prompts):
            for i, m in enumerate(methods):
                start = now()
                run = m([p])
                seconds = now() - start
                part[i] = replace(run, seconds=seconds) if part[i] is None else replace(
                    part[i], seconds=min(part[i].seconds, seconds)
                )
    runs = []
    for i in range(len(methods)):
        mine = [part[i] for part in parts]
        total = [sum(getattr(r, f) for r in mine) for f in ("seconds", "generated", "forwards", "drafted", "accepted")]
        runs.append(Run(mine[0].label, [t for r in mine for t in r.tokens], *total))
    return runs


def step_counts(target, draft, prompts, quick: bool) -> Table:
    """Per strategy: host syncs per step (counted over a greedy generation) and target launches per forward."""
    sys.path.insert(0, str(BENCH.parent / "tests"))
    from count_launches import syncs_per_step

    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(BENCH.parent))
    out = subprocess.run(
        [sys.executable, str(BENCH / "count_launches.py"), "--json"], env=env, capture_output=True, text=True
    )
    launches = json.loads(out.stdout) if out.returncode == 0 else None
    forward_kind = {"autoregressive": "decode", "draft chain": "chain K=5", "n-gram": "chain K=5"}
    table = Table(
        "Per step: host syncs (counted on the CPU's path) and the target forward's kernel launches (Triton path, "
        "counted on the CPU by bench/count_launches.py)",
        ["decoding", "host syncs per step", "target forward", "launches per forward", "per decoder layer"],
    )
    for label, strategy in strategies(draft):
        syncs = syncs_per_step(target, strategy, prompts[:1], max_new_tokens=16 if quick else 32)
        kind = next((k for prefix, k in forward_kind.items() if label.startswith(prefix)), "tree 16 nodes")
        per_forward, per_layer = launches[kind]["1"] if launches else ("?", "?")
        counted = f"{min(syncs)}-{max(syncs)}" if min(syncs) != max(syncs) else str(syncs[0])
        table.add(label, f"{counted} ({len(syncs)} steps)", kind, per_forward, per_layer)
    if launches is None:
        print(f"count_launches.py failed: {out.stderr[-400:]}")
    return table


def load_hf(directory: Path, device: str):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32).to(device).eval()
    # Same stopping rule as the specdec runs: exactly N tokens, EOS does not end a completion.
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = model.config.pad_token_id
    return model


def chart(runs: list[Run], baseline: Run, path: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no chart (pip install matplotlib)"
    fig, ax = plt.subplots(figsize=(8, 3.6))
    names = [r.label for r in runs]
    speeds = [r.tokens_per_s for r in runs]
    colors = ["#4c72b0" if not r.label.startswith("HF") else "#dd8452" for r in runs]
    bars = ax.barh(names[::-1], speeds[::-1], color=colors[::-1])
    for bar, r in zip(bars, runs[::-1]):
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {r.tokens_per_s / baseline.tokens_per_s:.2f}x")
    ax.set_xlabel("tokens/s (greedy, batch 1)")
    ax.set_title("Embedded pair: specdec (blue) vs HuggingFace (orange)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return f"chart written to {path}"


SWEEP_BATCHES = (1, 2, 4, 8, 16, 32)
SWEEP_FIXED = (1, 2, 3, 4, 5)
SWEEP_ADAPTIVE_MAX = 8


def batch_sweep(target, draft, pool: list[list[int]], device: str, quick: bool, repeats: int, out: Path | None):
    """Adaptive speculation against plain decoding and fixed chains at every batch size (issue 16).

    Per batch size B the work is the same for every method: ``max(1, 6 // B)`` batches of B held-out prompts
    (the pool cycled), N new tokens each, EOS ignored. Decoders are built and warmed once per B, so the
    adaptive one starts each timed run with what it measured before (as a server would).
    """
    import time

    from specdec.decoding import AdaptiveSpeculation, DraftModelStrategy, NgramStrategy, SpeculativeDecoder

    # The controller's clock: the thread's CPU time on the CPU (the same as the benchmark's), wall time on
    # CUDA (the step's read-back has synchronised already; common.clock would add a sync).
    step_clock = time.perf_counter if device.startswith("cuda") else time.thread_time
    batches, new_tokens = ((1, 4), 16) if quick else (SWEEP_BATCHES, 48)
    fixed = SWEEP_FIXED[::2] if quick else SWEEP_FIXED
    now = clock(device)

    def methods():
        chain = [(f"K={k}", DraftModelStrategy(draft, (1,) * k), False, 0.0) for k in fixed]
        adaptive = AdaptiveSpeculation(clock=step_clock)
        return [
            ("plain", None, False, 0.0), *chain,
            (f"adaptive K<={SWEEP_ADAPTIVE_MAX}", DraftModelStrategy(draft, (1,) * SWEEP_ADAPTIVE_MAX), adaptive, 0.0),
            ("plain T=1", None, False, 1.0),
            ("n-gram T=1 adaptive", NgramStrategy(5), AdaptiveSpeculation(clock=step_clock), 1.0),
            ("n-gram T=1 fixed", NgramStrategy(5), False, 1.0),
        ]  # fmt: skip

    results = {}
    for batch in batches:
        groups = [[pool[(g * batch + i) % len(pool)] for i in range(batch)] for g in range(max(1, 6 // batch))]
        plan = [(label, SpeculativeDecoder(target, s, adaptive=a), t) for label, s, a, t in methods()]
        for _, decoder, t in plan:  # warm-up
            decoder.generate(groups[0], max_new_tokens=new_tokens, temperature=t, seed=0, eos_token_id=None)
        best = {(label, g): float("inf") for label, _, _ in plan for g in range(len(groups))}
        depth = {}
        for _ in range(repeats):
            for g, prompts in enumerate(groups):
                for label, decoder, t in plan:
                    start = now()
                    result = decoder.generate(prompts, max_new_tokens=new_tokens, temperature=t, seed=g,
                                              eos_token_id=None)  # fmt: skip
                    best[label, g] = min(best[label, g], now() - start)
                    chosen = [d for st in result.stats for d in st.chosen_depths]
                    depth[label] = depth.get(label, []) + chosen
        tokens = len(groups) * batch * new_tokens
        results[batch] = {
            label: (tokens / sum(best[label, g] for g in range(len(groups))), sum(d) / len(d))
            for label, d in depth.items()
        }
    labels = list(results[batches[0]])
    fixed_labels = [f"K={k}" for k in fixed]
    adaptive_label = labels[len(fixed) + 1]
    table = Table(
        f"Batch sweep, embedded pair, {device}, greedy unless T=1, {new_tokens} tokens per request, fastest of "
        f"{repeats}: tokens/s and ratios (chains vs plain; n-gram T=1 vs plain T=1)",
        ["batch", "plain tok/s", *fixed_labels, "adaptive", "adaptive mean depth", "adaptive / best of plain+fixed",
         "plain T=1 tok/s", "n-gram T=1 adaptive", "n-gram T=1 fixed"],
    )  # fmt: skip
    series = {name: [] for name in [*fixed_labels, "adaptive", "n-gram T=1 adaptive", "n-gram T=1 fixed"]}
    for batch, r in results.items():
        plain, plain_t1 = r["plain"][0], r["plain T=1"][0]
        ratios = [r[f][0] / plain for f in fixed_labels]
        adaptive = r[adaptive_label][0] / plain
        ngram = [r["n-gram T=1 adaptive"][0] / plain_t1, r["n-gram T=1 fixed"][0] / plain_t1]
        table.add(
            batch, plain, *[f"{x:.2f}x" for x in ratios], f"{adaptive:.2f}x", f"{r[adaptive_label][1]:.2f}",
            f"{adaptive / max(1.0, *ratios):.2f}x", plain_t1, *[f"{x:.2f}x" for x in ngram],
        )  # fmt: skip
        for name, v in zip(series, [*ratios, adaptive, *ngram]):
            series[name].append(v)
    table.write(out, "e2e_batch_sweep")
    if out is not None:
        line_chart(out / "e2e_batch_sweep.png", "TOKENS/S VS PLAIN DECODING, EMBEDDED PAIR, CPU 1 THREAD",
                   [str(b) for b in batches], series, "X PLAIN")  # fmt: skip
        print(f"chart written to {out / 'e2e_batch_sweep.png'}")


def main() -> None:
    args = bench_args(
        __doc__.splitlines()[0],
        lambda p: (
            p.add_argument("--repeats", type=int, default=None, help="runs per (method, prompt); fastest kept"),
            p.add_argument("--sweep-only", action="store_true", help="only the adaptive batch sweep"),
        ),
    )
    device = args.device
    cpu_threads(device)
    num_prompts, new_tokens = (2, 32) if args.quick else (6, 96)
    repeats = args.repeats or (1 if args.quick or device.startswith("cuda") else 3)
    target, draft, tokenizer = load_pair(device, assets=ASSETS)
    if args.sweep_only:
        pool = [tokenizer.encode(p["text"]).ids for p in heldout_prompts(ASSETS)]
        batch_sweep(target, draft, pool, device, args.quick, repeats, args.out)
        return
    target_dir, draft_dir = ASSETS / "target", ASSETS / "draft"
    hf_target, hf_draft = load_hf(target_dir, device), load_hf(draft_dir, device)
    counter = ForwardCounter(hf_target)
    prompts = [tokenizer.encode(p["text"]).ids for p in heldout_prompts(ASSETS)[:num_prompts]]
    plan = strategies(draft)
    hf_plan = [
        ("HF generate greedy", {"do_sample": False}),
        ("HF assisted (draft)", {"do_sample": False, "assistant_model": hf_draft}),
        ("HF prompt lookup", {"do_sample": False, "prompt_lookup_num_tokens": 5}),
    ]
    for label, strategy in plan:  # warm-up: one-off allocation and dispatch costs
        decode_all(target, strategy, label, prompts[:1], 8)
    for label, kwargs in hf_plan:
        hf_run(label, hf_target, counter, prompts[:1], 8, device, **kwargs)

    methods = [lambda ps, s=s, label=label: decode_all(target, s, label, ps, new_tokens) for label, s in plan]
    methods += [
        lambda ps, kw=kw, label=label: hf_run(label, hf_target, counter, ps, new_tokens, device, **kw)
        for label, kw in hf_plan
    ]
    runs = interleaved(methods, prompts, device, repeats)
    base, hf_base, hf_assist = runs[0], runs[len(plan)], runs[len(plan) + 1]
    title = (
        f"End-to-end greedy decoding, embedded pair, {device}, batch 1, {num_prompts} held-out prompts x "
        f"{new_tokens} tokens, fastest of {repeats}"
    )
    table = Table(
        title,
        ["decoding", "tokens/s", "vs specdec AR", "vs HF greedy", "vs HF assisted", "tau", "acceptance", "identical"],
    )
    for r in runs:
        same = all(first_difference(a, b) is None for a, b in zip(r.tokens, base.tokens))
        table.add(
            r.label, r.tokens_per_s, f"{r.tokens_per_s / base.tokens_per_s:.2f}x",
            f"{r.tokens_per_s / hf_base.tokens_per_s:.2f}x", f"{r.tokens_per_s / hf_assist.tokens_per_s:.2f}x",
            f"{r.tau:.2f}", "-" if r.acceptance is None else f"{r.acceptance:.2f}", "yes" if same else "NO",
        )  # fmt: skip
    table.write(args.out, "e2e_greedy")
    if args.out is not None:
        print(chart(runs, base, args.out / "e2e_greedy.png"))
    else:
        print("no --out: chart not written")

    # Temperature 1: exact sampling, so tokens differ run to run; speed and tau only.
    # The tree uses the stochastic rule here: children sampled from the draft (SpecInfer).
    sample_plan = strategies(draft, tree_rule="stochastic")
    sample_kw = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0}
    methods = [
        lambda ps, s=s, label=label: decode_all(target, s, label, ps, new_tokens, temperature=1.0)
        for label, s in sample_plan
    ]
    methods += [
        lambda ps, kw=kw, label=label: hf_run(label, hf_target, counter, ps, new_tokens, device, **kw)
        for label, kw in [
            ("HF sampling", sample_kw),
            ("HF assisted sampling", sample_kw | {"assistant_model": hf_draft}),
        ]
    ]
    torch.manual_seed(0)
    sampled = interleaved(methods, prompts, device, repeats)
    t1 = Table(
        f"Temperature 1 (top-k/top-p off), embedded pair, {device}, batch 1, "
        f"{num_prompts} prompts x {new_tokens} tokens",
        ["decoding", "tokens/s", "vs specdec AR", "vs HF assisted", "tau", "acceptance"],
    )
    for r in sampled:
        t1.add(
            r.label, r.tokens_per_s, f"{r.tokens_per_s / sampled[0].tokens_per_s:.2f}x",
            f"{r.tokens_per_s / sampled[-1].tokens_per_s:.2f}x", f"{r.tau:.2f}",
            "-" if r.acceptance is None else f"{r.acceptance:.2f}",
        )  # fmt: skip
    t1.write(args.out, "e2e_temperature1")
    step_counts(target, draft, prompts, args.quick).write(args.out, "e2e_step_counts")
    pool = [tokenizer.encode(p["text"]).ids for p in heldout_prompts(ASSETS)]
    batch_sweep(target, draft, pool, device, args.quick, repeats, args.out)


if __name__ == "__main__":
    main()
