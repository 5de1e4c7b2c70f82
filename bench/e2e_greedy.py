"""The end-to-end greedy and temperature-1 tables (``bench_e2e.py``): specdec's strategies against HuggingFace.

Greedy (temperature 0), batch 1, each held-out prompt decoded alone for N new tokens (EOS does not stop early),
float32 weights from ``specdec/assets/pair`` for both libraries:

  specdec autoregressive | chain K=5 | chain K=5 unfused | tree 3,2,1,1,1 (deterministic rule) | n-gram K=5 |
  Medusa heads
  HF generate (greedy) | HF assisted generation (assistant_model = the draft) | HF prompt lookup (5 tokens)

"unfused" = the same chain with every draft forward through ``LlamaModel.forward`` (``fused=False``; on the CPU
the chain row's draft forwards run in C++, ``specdec.model.draft_forward_cpu``); "identical" = every prompt's
tokens equal specdec's autoregressive greedy tokens. Then a temperature-1 run (specdec strategies, the unfused
chain again, the tree on the stochastic rule, HF sampling and HF assisted sampling): tokens/s and tau. Methods
run interleaved prompt by prompt (``e2e_runs.interleaved``). A PNG bar chart of the greedy tokens/s goes to
``--out`` when matplotlib is importable. ``step_counts``: per strategy, the host syncs of each step (counted,
``bench/sync_counter.py``) and the kernel launches of the target forward it runs (counted by
``bench/count_launches.py`` with the Triton path interpreted). ``kernel_configs``: each kernel's configuration
at its last launch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from common import Table, launched_configs
from e2e_runs import ForwardCounter, hf_run, interleaved, load_hf

from specdec.cli.demo import CHAIN, Run, decode_all, first_difference, medusa_row, strategies
from specdec.decoding import DraftModelStrategy
from specdec.testing import ASSETS

BENCH = Path(__file__).resolve().parent


def greedy_and_sampled(target, draft, prompts, num_prompts: int, new_tokens: int, device: str, repeats: int,
                       out: Path | None) -> None:  # fmt: skip
    """The greedy table (``e2e_greedy``, and its chart with ``out``) and the temperature-1 table
    (``e2e_temperature1``)."""
    target_dir, draft_dir = ASSETS / "target", ASSETS / "draft"
    hf_target, hf_draft = load_hf(target_dir, device), load_hf(draft_dir, device)
    counter = ForwardCounter(hf_target)
    plan = [*strategies(draft), medusa_row(target)]
    unfused = DraftModelStrategy(draft, (1,) * CHAIN, fused=False)
    plan.insert(2, (f"draft chain K={CHAIN} unfused", unfused))  # the fused chain's peer, right after it
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
    table.write(out, "e2e_greedy")
    if out is not None:
        print(chart(runs, base, out / "e2e_greedy.png"))
    else:
        print("no --out: chart not written")

    # Temperature 1: exact sampling, so tokens differ run to run; speed and tau only.
    # The tree uses the stochastic rule here: children sampled from the draft (SpecInfer).
    sample_plan = [*strategies(draft, tree_rule="stochastic"), medusa_row(target)]
    sample_plan.insert(2, (f"draft chain K={CHAIN} unfused", unfused))
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
    t1.write(out, "e2e_temperature1")


def step_counts(target, draft, prompts, quick: bool) -> Table:
    """Per strategy: host syncs per step (counted over a greedy generation) and target launches per forward."""
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
    for label, strategy in [*strategies(draft), medusa_row(target)]:
        syncs = syncs_per_step(target, strategy, prompts[:1], max_new_tokens=16 if quick else 32)
        kind = next((k for prefix, k in forward_kind.items() if label.startswith(prefix)), "tree 16 nodes")
        per_forward, per_layer = launches[kind]["1"] if launches else ("?", "?")
        counted = f"{min(syncs)}-{max(syncs)}" if min(syncs) != max(syncs) else str(syncs[0])
        table.add(label, f"{counted} ({len(syncs)} steps)", kind, per_forward, per_layer)
    if launches is None:
        print(f"count_launches.py failed: {out.stderr[-400:]}")
    return table


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
