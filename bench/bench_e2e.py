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

    python bench/bench_e2e.py --quick            # CPU smoke run: 2 prompts, 32 tokens
    python bench/bench_e2e.py --dry-run          # the GPU check's rehearsal: 1 prompt, 8 tokens
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
from common import Table, bench_args, clock, cpu_threads, launched_configs  # noqa: E402

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


def kernel_configs(out) -> None:
    """One row: each kernel's configuration at its last launch in the runs above (the rows interleave their
    runs, so a column per row could not tell them apart)."""
    configs = launched_configs()
    table = Table("Kernel configurations of the runs above (each kernel's last launch)", ["kernel configs"])
    table.add(configs)
    table.write(out, "e2e_kernel_configs")


def main() -> None:
    args = bench_args(
        __doc__.splitlines()[0],
        lambda p: p.add_argument("--repeats", type=int, default=None, help="runs per (method, prompt); fastest kept"),
    )
    device = args.device
    cpu_threads(device)
    num_prompts, new_tokens = (1, 8) if args.dry_run else (2, 32) if args.quick else (6, 96)
    repeats = args.repeats or (1 if args.quick or device.startswith("cuda") else 3)
    target, draft, tokenizer = load_pair(device, assets=ASSETS)
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
    if device.startswith("cuda") or args.dry_run:  # counted on the CPU's path, through the interpreter: minutes
        print("\nHost syncs and launches per step: counted by a CPU run (bench/count_launches.py), not here")
    else:
        step_counts(target, draft, prompts, args.quick).write(args.out, "e2e_step_counts")
    kernel_configs(args.out)


if __name__ == "__main__":
    main()
