"""End-to-end speculative decoding with the embedded pair: specdec vs HuggingFace, one run, same prompts.

Greedy (temperature 0), batch 1, each held-out prompt decoded alone for N new tokens
(EOS does not stop early), float32 weights from ``specdec/assets/pair`` for both libraries:

  specdec autoregressive | chain K=5 | chain K=5 unfused | tree 3,2,1,1,1 (deterministic rule) | n-gram K=5 |
  Medusa heads
  HF generate (greedy) | HF assisted generation (assistant_model = the draft) | HF prompt lookup (5 tokens)

tokens/s = generated tokens / time summed over prompts (prefill included); on the CPU the time
is the thread's CPU time with one intra-op thread (``common.clock``), on CUDA wall time;
"unfused" = the same chain with every draft forward through ``LlamaModel.forward`` (``fused=False``;
on the CPU the chain row's draft forwards run in C++, ``specdec.model.draft_forward_cpu``);
tau = tokens per target forward (HF: counted with a forward hook on the target);
"identical" = every prompt's tokens equal specdec's autoregressive greedy tokens.
Then a temperature-1 run (specdec strategies, the unfused chain again, the tree on the stochastic rule, HF
sampling and HF assisted sampling): tokens/s and tau. Methods run interleaved prompt by
prompt, ``--repeats`` times, each (method, prompt) keeping its fastest run, so drifting
background load on a shared machine hits them all alike. Last, per strategy: the host
syncs of each step (counted, ``tests/sync_counter.py``) and the kernel launches of the
target forward it runs (counted by ``bench/count_launches.py`` with the Triton path
interpreted). Then the Medusa heads' own table (``medusa_table``): every searched tree and the
heads' chain against autoregressive decoding and the draft chain, interleaved in one run, with
acceptance by depth. Then EAGLE (the shipped head) against the draft chain: tokens/s, tau and
acceptance by depth (``--eagle-only`` runs just that table). A PNG bar chart of the greedy
tokens/s goes to ``--out`` when matplotlib is importable. Then the engine peers at batch 1 and 6
(``vllm_peer_rows``): specdec's engine, vLLM stock and vLLM with specdec's plugin, run in vLLM's own
environment (``make install-vllm`` builds .venv-vllm, or point ``SPECDEC_VLLM_PYTHON`` at a Python
with vLLM); skipped with the reason when there is none (``--vllm-only`` runs just that table).

Last, the batch sweep of adaptive speculation (``batch_sweep``): batch 1, 2, 4, 8, 16, 32, greedy,
plain decoding, fixed draft chains K = 1..5 and the adaptive chain (K <= 8), plus n-gram K=5
(adaptive and fixed) against plain decoding at temperature 1; thread time, interleaved, each
(method, batch) the fastest of the repeats, and adaptive against the best of plain and fixed chains also as
the median of paired per-round ratios (steadier on a noisy machine) and of held-out ones (each round against
the method fastest in the other rounds: no winner's curse), n-gram T=1 against plain T=1 paired too; a PNG
line chart (``png_chart``: the venv has no matplotlib) of the ratios to plain decoding goes to ``--out``.
``--sweep-only`` runs just that; ``--sweep-decoders N`` times N independent adaptive decoders per batch size and
reports their mean (one controller's choices follow its own history, so one decoder per cell is one draw).

    python bench/bench_e2e.py --quick            # CPU smoke run: 2 prompts, 32 tokens
    python bench/bench_e2e.py --dry-run          # the GPU check's rehearsal: 1 prompt, 8 tokens
    python bench/bench_e2e.py --out OUT          # 6 prompts, 96 tokens, 3 repeats (CPU: one thread)
    python bench/bench_e2e.py --vllm-only        # only the engine-peer table
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
from png_chart import line_chart  # noqa: E402

from specdec.cli.demo import (  # noqa: E402
    ASSETS,
    CHAIN,
    TREE,
    Run,
    decode_all,
    first_difference,
    heldout_token_ids,
    load_pair,
    medusa_row,
    strategies,
)
from specdec.decoding import DraftModelStrategy  # noqa: E402
from specdec.decoding.replay import sweep_groups  # noqa: E402


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
    the methods and the fastest of several runs drops the bursts, so the ratios stay meaningful. On a
    GPU every method first decodes the first prompt untimed: Triton compiles each new shape once, and
    that cost would otherwise land on whichever method meets the shape first (seen on the H200).
    """
    now = clock(device)
    if device.startswith("cuda"):
        for m in methods:
            m(prompts[:1])
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
    for label, strategy in [*strategies(draft), medusa_row(target)]:
        syncs = syncs_per_step(target, strategy, prompts[:1], max_new_tokens=16 if quick else 32)
        kind = next((k for prefix, k in forward_kind.items() if label.startswith(prefix)), "tree 16 nodes")
        per_forward, per_layer = launches[kind]["1"] if launches else ("?", "?")
        counted = f"{min(syncs)}-{max(syncs)}" if min(syncs) != max(syncs) else str(syncs[0])
        table.add(label, f"{counted} ({len(syncs)} steps)", kind, per_forward, per_layer)
    if launches is None:
        print(f"count_launches.py failed: {out.stderr[-400:]}")
    return table


def acceptance_by_depth(target, strategy, prompts, new_tokens) -> list[float]:
    """Greedy, each prompt alone, fixed draft sizes (as the timed rows): the share of steps reaching depth d + 1
    that accept its draft token."""
    from specdec.decoding import SpeculativeDecoder

    decoder, drafted, accepted = SpeculativeDecoder(target, strategy, adaptive=False), [], []
    for ids in prompts:
        stats = decoder.generate([ids], max_new_tokens=new_tokens, eos_token_id=None).stats[0]
        for totals, counts in ((drafted, stats.drafted_at), (accepted, stats.accepted_at)):
            totals.extend([0] * (len(counts) - len(totals)))
            for d, c in enumerate(counts):
                totals[d] += c
    return [a / d if d else 0.0 for a, d in zip(accepted, drafted)]


def medusa_table(target, draft, prompts, new_tokens: int, device: str, repeats: int) -> Table:
    """The Medusa heads (``specdec/assets/medusa``) with every searched tree and their chain, against
    autoregressive decoding and the draft chain, greedy, interleaved in one run (``interleaved``)."""
    from specdec.decoding import DraftModelStrategy, MedusaStrategy, NoDraft
    from specdec.decoding.medusa import presets

    heads = medusa_row(target)[1].heads
    plan = [("autoregressive", NoDraft()), (f"draft chain K={CHAIN}", DraftModelStrategy(draft, (1,) * CHAIN))]
    plan += [("Medusa chain", MedusaStrategy(heads, "chain"))]
    trees = [name for name in presets() if name != "default"]
    default = next(name for name in trees if presets()[name] == presets()["default"])
    plan += [(f"Medusa {name}" + " (default)" * (name == default), MedusaStrategy(heads, name)) for name in trees]
    for label, strategy in plan:  # warm-up
        decode_all(target, strategy, label, prompts[:1], 8)
    methods = [lambda ps, s=s, label=label: decode_all(target, s, label, ps, new_tokens) for label, s in plan]
    runs = interleaved(methods, prompts, device, repeats)
    base, chain = runs[0], runs[1]
    table = Table(
        f"Medusa heads, embedded target, {device}, greedy, batch 1, {len(prompts)} held-out prompts x {new_tokens} "
        f"tokens, fastest of {repeats}",
        ["decoding", "nodes", "tokens/s", "vs specdec AR", "vs draft chain", "tau", "acceptance by depth", "identical"],
    )
    for (label, strategy), r in zip(plan, runs):
        same = all(first_difference(a, b) is None for a, b in zip(r.tokens, base.tokens))
        by_depth = acceptance_by_depth(target, strategy, prompts, new_tokens) if strategy.max_depth else []
        table.add(
            label, strategy.max_nodes, r.tokens_per_s, f"{r.tokens_per_s / base.tokens_per_s:.2f}x",
            f"{r.tokens_per_s / chain.tokens_per_s:.2f}x", f"{r.tau:.2f}",
            " / ".join(f"{a:.2f}" for a in by_depth) or "-", "yes" if same else "NO",
        )  # fmt: skip
    return table


def eagle_table(target, draft, prompts, new_tokens: int, device: str, repeats: int) -> Table:
    """EAGLE-2 and EAGLE-1 (the shipped head, ``specdec/assets/eagle``) against the draft chain, interleaved:
    greedy tokens/s, tau, acceptance by depth (accepted / reached, depths 1..8), identical to AR greedy."""
    from specdec.cli.demo import eagle_row
    from specdec.decoding import NoDraft

    label, strategy = eagle_row(target, tree_budget=64, depth=6, top_k=8, confidence_temperature=1.0)
    paper = (label + " (paper's confidences)", strategy)
    plan = [
        ("autoregressive", NoDraft()),
        (f"draft chain K={CHAIN}", DraftModelStrategy(draft, (1,) * CHAIN)),
        ("draft tree " + ",".join(map(str, TREE)), DraftModelStrategy(draft, TREE, rule="deterministic")),
        eagle_row(target),
        eagle_row(target, tree_budget=64, depth=6, top_k=8),
        paper,
        eagle_row(target, static_tree="default", tree_budget=8),
        eagle_row(target, static_tree="default", tree_budget=32, depth=6, top_k=4),
    ]
    # warm-up, and acceptance by depth (untimed)
    by_depth = {label: acceptance_by_depth(target, strategy, prompts, new_tokens)[:8] for label, strategy in plan}
    methods = [lambda ps, s=s, label=label: decode_all(target, s, label, ps, new_tokens) for label, s in plan]
    runs = interleaved(methods, prompts, device, repeats)
    base, chain = runs[0], runs[1]
    table = Table(
        f"EAGLE vs the draft chain, greedy, embedded pair, {device}, batch 1, {len(prompts)} held-out prompts x "
        f"{new_tokens} tokens, fastest of {repeats} (interleaved)",
        ["decoding", "tokens/s", "vs AR", "vs chain", "tau", "acceptance by depth 1..8", "identical"],
    )
    for r in runs:
        depth = " ".join(f"{a:.2f}" for a in by_depth[r.label]) or "-"
        same = all(first_difference(a, b) is None for a, b in zip(r.tokens, base.tokens))
        table.add(
            r.label, r.tokens_per_s, f"{r.tokens_per_s / base.tokens_per_s:.2f}x",
            f"{r.tokens_per_s / chain.tokens_per_s:.2f}x", f"{r.tau:.2f}", depth, "yes" if same else "NO",
        )  # fmt: skip
    return table


def vllm_peer_rows(target, draft, prompts, new_tokens: int, repeats: int, device: str) -> Table | None:
    """Engine peers at batch 1 and 6, greedy: specdec's own engine next to vLLM stock and vLLM with specdec's
    plugin (autoregressive, draft model and n-gram, K = 5 drafts), the same held-out prompts and token count.

    vLLM runs in its own environment (``bench_vllm_plugin.vllm_python``: this interpreter, else
    ``$SPECDEC_VLLM_PYTHON``, else ``.venv-vllm``), one child process per configuration holding its engine;
    without one the table is skipped with the reason. Batch 1 decodes each prompt alone, batch 6 all six
    together; every configuration decodes a group of prompts before any moves to the next, ``repeats``
    times over, each (configuration, group) keeping its fastest: CPU time of specdec's thread (one
    intra-op thread) and of vLLM's process (one thread, in-process engine core).
    """
    from bench_vllm_plugin import VllmChild, vllm_python

    from specdec.cli.demo import CHAIN
    from specdec.decoding import SpeculativeDecoder

    python, where = vllm_python()
    if python is None or device != "cpu":
        print(f"\nvLLM peer rows skipped: {where if python is None else 'measured on the CPU build only'}")
        return None
    batches = (1, min(6, len(prompts)))
    plan = dict(strategies(draft))
    mine = {"autoregressive": "autoregressive", "draft": f"draft chain K={CHAIN}", "ngram": f"n-gram K={CHAIN}"}
    configs = [(engine, method) for method in mine for engine in ("specdec", "vLLM stock", "vLLM + specdec plugin")]
    configs.remove(("vLLM + specdec plugin", "autoregressive"))  # nothing to verify: the plugin never runs
    children = {
        c: VllmChild(python, c[1], 0 if c[1] == "autoregressive" else CHAIN, "plugin" in c[0], max(batches))
        for c in configs if c[0] != "specdec"
    }  # fmt: skip
    now = clock(device)
    decoders = {method: SpeculativeDecoder(target, plan[label]) for method, label in mine.items()}
    groups = {b: [list(range(i, min(i + b, len(prompts)))) for i in range(0, len(prompts), b)] for b in batches}
    best, tokens, verify = {}, {}, {}
    for _ in range(repeats):
        for batch in batches:
            for group in groups[batch]:  # every configuration on this group of prompts, then the next group
                for config in configs:
                    if config[0] == "specdec":
                        start = now()
                        out = decoders[config[1]].generate([prompts[i] for i in group], max_new_tokens=new_tokens,
                                                           temperature=0.0, eos_token_id=None).tokens  # fmt: skip
                        seconds = now() - start
                    else:
                        reply = children[config].generate(group, new_tokens)
                        assert reply["verify_calls"] > 0 or "plugin" not in config[0], "the plugin did not run"
                        seconds, out = reply["seconds"], reply["tokens"]
                        verify[config, batch, group[0]] = reply["verify_seconds"], reply["verify_steps"]
                    key = (config, batch, group[0])
                    best[key] = min(best.get(key, float("inf")), seconds)
                    tokens[key] = out
    for child in children.values():
        child.close()
    seconds = {(c, b): sum(best[c, b, g[0]] for g in groups[b]) for c in configs for b in batches}
    generated = len(prompts) * new_tokens
    b1, b6 = batches
    table = Table(
        f"Engine peers: specdec's engine, vLLM ({where}) stock and with specdec's plugin, embedded pair, greedy, "
        f"{len(prompts)} prompts x {new_tokens} tokens, CPU time, one thread, fastest of {repeats} interleaved",
        ["engine", "decoding", f"batch {b1} tok/s", f"batch {b6} tok/s", "plugin / stock", "identical to own AR",
         f"rejection sampler us/step (batch {b1} / {b6})"],
    )  # fmt: skip

    def sampler_us(config, batch) -> str:  # the last rep's thread time in vLLM's rejection sampler per step
        spent = [verify[config, batch, g[0]] for g in groups[batch]]
        return f"{1e6 * sum(s for s, _ in spent) / max(sum(n for _, n in spent), 1):.0f}"

    for engine, method in configs:
        rates = [generated / seconds[(engine, method), b] for b in batches]
        stock = ("vLLM stock", method)
        ratio = " / ".join(f"{seconds[stock, b] / seconds[(engine, method), b]:.2f}x" for b in batches)
        own_ar = (engine if engine != "vLLM + specdec plugin" else "vLLM stock", "autoregressive")
        same = all(tokens[(engine, method), b, g[0]] == tokens[own_ar, b, g[0]] for b in batches for g in groups[b])
        label = method if method == "autoregressive" else mine[method].replace("draft chain", "draft model")
        speculative_vllm = engine != "specdec" and method != "autoregressive"
        per_step = " / ".join(sampler_us((engine, method), b) for b in batches) if speculative_vllm else "-"
        table.add(engine, label, *rates, ratio if "plugin" in engine else "-", "yes" if same else "NO", per_step)
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


SWEEP_BATCHES = (1, 2, 4, 8, 16, 32)
SWEEP_FIXED = (1, 2, 3, 4, 5)
SWEEP_ADAPTIVE_MAX = 8


def paired_ratio(rounds: dict[str, list[float]], references: list[str], label: str) -> float:
    """``label``'s speed over the reference with the lowest median round time, as the median of per-round ratios.

    Each round ran every method once, so a slow phase of the machine slows a round's methods alike and cancels
    in its ratio; the min-of-N speeds of the table's other columns keep it, and the best of several references
    picked from them after the fact is biased up by their noise."""
    import statistics

    reference = min(references, key=lambda name: statistics.median(rounds[name]))
    return statistics.median(ref / own for ref, own in zip(rounds[reference], rounds[label]))


def held_out_ratio(rounds: dict[str, list[float]], references: list[str], label: str) -> float | None:
    """``label``'s speed over the best reference, each round's ratio taken against the reference that was fastest
    (median) in the other rounds; the median over rounds (None with fewer than 2 rounds).

    ``paired_ratio`` picks the best reference from the same rounds it then compares with: among references a
    few percent apart, the one picked was more often lucky in those rounds, so the ratio leans low (the winner's
    curse). Here no round's ratio uses a reference chosen by that round's own times."""
    import statistics

    n = len(rounds[label])
    if n < 2:
        return None
    ratios = []
    for r in range(n):
        others = {name: statistics.median(t for i, t in enumerate(rounds[name]) if i != r) for name in references}
        reference = min(references, key=others.__getitem__)
        ratios.append(rounds[reference][r] / rounds[label][r])
    return statistics.median(ratios)


def spread(ratios: list[float | None]) -> str:
    """One decoder's ratio, or several decoders' mean with their range ("-" without enough rounds)."""
    if any(r is None for r in ratios):
        return "-"
    mean = sum(ratios) / len(ratios)
    return f"{mean:.2f}x" if len(ratios) == 1 else f"{mean:.3f}x ({min(ratios):.2f}-{max(ratios):.2f})"


def batch_sweep(
    target, draft, pool: list[list[int]], device: str, quick: bool, repeats: int, out: Path | None, only=None,
    decoders: int = 1,
):  # fmt: skip
    """Adaptive speculation against plain decoding and fixed chains at every batch size (issue 16).

    Per batch size B the work is the same for every method: ``max(1, 6 // B)`` batches of B held-out prompts
    (the pool cycled), N new tokens each, EOS ignored. Decoders are built and warmed once per B, so the
    adaptive one starts each timed run with what it measured before (as a server would). A round runs every
    method once (the order rotated from round to round); the table's speeds are each method's fastest round
    per prompt batch, and its "paired" column the median per-round ratio (``paired_ratio``).

    ``decoders`` independent adaptive chain decoders per batch size (``--sweep-decoders``): one controller's
    choices follow its own history (which shape it measured in which minute), so one decoder per cell is one
    draw; with several, the adaptive columns are their means (speed and depth) and the ratio columns the mean of
    each decoder's ratio, with the range beside it.
    """
    import time

    from specdec.decoding import AdaptiveSpeculation, DraftModelStrategy, NgramStrategy, SpeculativeDecoder

    # The controller's clock: the thread's CPU time on the CPU (the same as the benchmark's), wall time on
    # CUDA (the step's read-back has synchronised already; common.clock would add a sync).
    step_clock = time.perf_counter if device.startswith("cuda") else time.thread_time
    batches, new_tokens = ((1, 4), 16) if quick else (SWEEP_BATCHES, 48)
    batches = tuple(only) if only else batches  # --batches
    fixed = SWEEP_FIXED[::2] if quick else SWEEP_FIXED
    fixed_labels, adaptive_label = [f"K={k}" for k in fixed], f"adaptive K<={SWEEP_ADAPTIVE_MAX}"
    adaptive_labels = [adaptive_label] if decoders == 1 else [f"{adaptive_label} #{i + 1}" for i in range(decoders)]
    now = clock(device)

    def methods():
        chain = [(label, DraftModelStrategy(draft, (1,) * k), False, 0.0) for label, k in zip(fixed_labels, fixed)]
        adaptive = [
            (label, DraftModelStrategy(draft, (1,) * SWEEP_ADAPTIVE_MAX), AdaptiveSpeculation(clock=step_clock), 0.0)
            for label in adaptive_labels
        ]
        return [
            ("plain", None, False, 0.0), *chain, *adaptive,
            ("plain T=1", None, False, 1.0),
            ("n-gram T=1 adaptive", NgramStrategy(5), AdaptiveSpeculation(clock=step_clock), 1.0),
            ("n-gram T=1 fixed", NgramStrategy(5), False, 1.0),
        ]  # fmt: skip

    results, paired = {}, {}
    for batch in batches:
        groups = sweep_groups(pool, batch)
        plan = [(label, SpeculativeDecoder(target, s, adaptive=a), t) for label, s, a, t in methods()]
        for _, decoder, t in plan:  # warm-up
            decoder.generate(groups[0], max_new_tokens=new_tokens, temperature=t, seed=0, eos_token_id=None)
        best = {(label, g): float("inf") for label, _, _ in plan for g in range(len(groups))}
        depth = {}
        rounds = {label: [0.0] * repeats for label, _, _ in plan}  # each round's time per method, for paired ratios
        for r in range(repeats):
            for g, prompts in enumerate(groups):
                for label, decoder, t in plan[r % len(plan) :] + plan[: r % len(plan)]:  # no method always first
                    start = now()
                    result = decoder.generate(prompts, max_new_tokens=new_tokens, temperature=t, seed=g,
                                              eos_token_id=None)  # fmt: skip
                    seconds = now() - start
                    best[label, g] = min(best[label, g], seconds)
                    rounds[label][r] += seconds
                    chosen = [d for st in result.stats for d in st.chosen_depths]
                    depth[label] = depth.get(label, []) + chosen
        tokens = len(groups) * batch * new_tokens
        results[batch] = {
            label: (tokens / sum(best[label, g] for g in range(len(groups))), sum(d) / len(d))
            for label, d in depth.items()
        }
        paired[batch] = (
            [paired_ratio(rounds, ["plain", *fixed_labels], label) for label in adaptive_labels],
            [held_out_ratio(rounds, ["plain", *fixed_labels], label) for label in adaptive_labels],
            paired_ratio(rounds, ["plain T=1"], "n-gram T=1 adaptive"),
        )
        means = [results[batch][label] for label in adaptive_labels]
        results[batch][adaptive_label] = tuple(sum(v) / len(v) for v in zip(*means))  # the decoders' mean
    table = Table(
        f"Batch sweep, embedded pair, {device}, greedy unless T=1, {new_tokens} tokens per request, fastest of "
        f"{repeats}{'' if decoders == 1 else f', {decoders} adaptive decoders (means; ratios with their range)'}: "
        f"tokens/s and ratios (chains vs plain; n-gram T=1 vs plain T=1)",
        ["batch", "plain tok/s", *fixed_labels, "adaptive", "adaptive mean depth", "adaptive / best of plain+fixed",
         "paired: adaptive / best", "held out: adaptive / best", "plain T=1 tok/s", "n-gram T=1 adaptive",
         "n-gram T=1 fixed", "paired: n-gram T=1 adaptive / plain"],
    )  # fmt: skip
    series = {name: [] for name in [*fixed_labels, "adaptive", "n-gram T=1 adaptive", "n-gram T=1 fixed"]}
    for batch, r in results.items():
        plain, plain_t1 = r["plain"][0], r["plain T=1"][0]
        ratios = [r[f][0] / plain for f in fixed_labels]
        adaptive = r[adaptive_label][0] / plain
        ngram = [r["n-gram T=1 adaptive"][0] / plain_t1, r["n-gram T=1 fixed"][0] / plain_t1]
        best_paired, held_out, ngram_paired = paired[batch]
        table.add(
            batch, plain, *[f"{x:.2f}x" for x in ratios], f"{adaptive:.2f}x", f"{r[adaptive_label][1]:.2f}",
            f"{adaptive / max(1.0, *ratios):.2f}x", spread(best_paired), spread(held_out), plain_t1,
            *[f"{x:.2f}x" for x in ngram],
            f"{ngram_paired:.2f}x",
        )  # fmt: skip
        for name, v in zip(series, [*ratios, adaptive, *ngram]):
            series[name].append(v)
    table.write(out, "e2e_batch_sweep")
    if out is not None:
        line_chart(out / "e2e_batch_sweep.png", "TOKENS/S VS PLAIN DECODING, EMBEDDED PAIR, CPU 1 THREAD",
                   [str(b) for b in batches], series, "X PLAIN")  # fmt: skip
        print(f"chart written to {out / 'e2e_batch_sweep.png'}")


def main() -> None:
    def extra(parser):
        parser.add_argument("--repeats", type=int, default=None, help="runs per (method, prompt); fastest kept")
        parser.add_argument("--eagle-only", action="store_true", help="only the EAGLE table")
        parser.add_argument("--vllm-only", action="store_true", help="only the engine-peer table (vLLM rows)")
        parser.add_argument("--sweep-only", action="store_true", help="only the adaptive batch sweep")
        parser.add_argument("--batches", type=int, nargs="+", help="the sweep's batch sizes (default: all six)")
        parser.add_argument("--sweep-decoders", type=int, default=1, help="independent adaptive decoders per batch "
                            "size in the sweep (their mean is reported)")  # fmt: skip

    args = bench_args(__doc__.splitlines()[0], extra)
    device = args.device
    cpu_threads(device)
    num_prompts, new_tokens = (1, 8) if args.dry_run else (2, 32) if args.quick else (6, 96)
    repeats = args.repeats or (1 if args.quick or device.startswith("cuda") else 3)
    target, draft, tokenizer = load_pair(device, assets=ASSETS)
    prompts = heldout_token_ids(tokenizer)[:num_prompts]
    if args.eagle_only:
        eagle_table(target, draft, prompts, new_tokens, device, repeats).write(args.out, "e2e_eagle")
        return
    if args.vllm_only:
        table = vllm_peer_rows(target, draft, prompts, new_tokens, repeats, device)
        if table is not None:
            table.write(args.out, "e2e_vllm")
        return
    if args.sweep_only:
        pool = heldout_token_ids(tokenizer)
        if args.sweep_decoders < 1:
            raise SystemExit(f"--sweep-decoders must be >= 1, got {args.sweep_decoders}")
        batch_sweep(target, draft, pool, device, args.quick, repeats, args.out, args.batches, args.sweep_decoders)
        return
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
    table.write(args.out, "e2e_greedy")
    if args.out is not None:
        print(chart(runs, base, args.out / "e2e_greedy.png"))
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
    t1.write(args.out, "e2e_temperature1")
    if device.startswith("cuda") or args.dry_run:  # counted on the CPU's path, through the interpreter: minutes
        print("\nHost syncs and launches per step: counted by a CPU run (bench/count_launches.py), not here")
    else:
        step_counts(target, draft, prompts, args.quick).write(args.out, "e2e_step_counts")
    medusa_table(target, draft, prompts, new_tokens, device, repeats).write(args.out, "e2e_medusa")
    eagle_table(target, draft, prompts, new_tokens, device, repeats).write(args.out, "e2e_eagle")
    if args.dry_run:  # a vLLM engine per configuration takes minutes to start
        print("\nvLLM peer rows: not in a dry run (bench/bench_e2e.py --vllm-only)")
    else:
        peers = vllm_peer_rows(target, draft, prompts, new_tokens, repeats, device)
        if peers is not None:
            peers.write(args.out, "e2e_vllm")
    kernel_configs(args.out)
    if args.dry_run:  # the sweep decodes every batch size with eight decoders: a run of its own
        print("\nAdaptive batch sweep: not in a dry run (bench/bench_e2e.py --sweep-only)")
    else:
        pool = heldout_token_ids(tokenizer)
        batch_sweep(target, draft, pool, device, args.quick, repeats, args.out)


if __name__ == "__main__":
    main()
