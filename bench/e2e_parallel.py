"""The end-to-end parallel-drafting tables (``bench_e2e.py``): the shipped parallel draft (PARD) and parallel EAGLE
head against the draft chain and EAGLE-2.

``parallel_tables`` prints three tables, methods interleaved in one run (``e2e_runs.interleaved``), fixed draft
sizes (adaptive off, so a row drafts what its label says):

* greedy, batch 1: autoregressive, the draft chain K=5 (fused C++ on the CPU), EAGLE-2 as the demo runs it, the
  parallel draft's and the parallel EAGLE head's chains (K=5, the block size) and best-first trees by node budget
  (8 to 64), with tau and whether every output equals target greedy; then, adaptive (each step's depth chosen by
  the controller), the draft chain (K <= 8) and the parallel trees (their budget's share of the chosen depth);
* temperature 1 (seeded), batch 1: the draft chain and the parallel chain by rule (coupled: plain sampling's
  tokens; stochastic: the optimal rejection rule), trees, and adaptive;
* greedy, batch 8: the chains and trees, one batch of eight prompts per run; then the chains at K=2 (the best fixed
  depth at that batch) and adaptive (K <= 8, one decoder per row across the runs).
* greedy, batch 1, tau only: the parallel EAGLE head's trees by node budget and confidence temperature (what chose
  ``ParallelEagleStrategy``'s default), beside its chains.

``bench_e2e.py --parallel-only`` runs just these.
"""

from __future__ import annotations

import time

import torch
from common import Table
from e2e_runs import interleaved

from specdec.cli.demo import CHAIN, Run, decode_all, eagle_row, first_difference
from specdec.decoding import (
    DraftModelStrategy,
    NoDraft,
    ParallelDraftStrategy,
    ParallelEagleStrategy,
    SpeculativeDecoder,
)
from specdec.model import ParallelDraft, ParallelEagleHead
from specdec.testing import ASSETS, pair_dirs

PARALLEL = ASSETS.parent / "parallel"
PARALLEL_EAGLE = ASSETS.parent / "parallel_eagle"
TREE_BUDGETS = (8, 12, 16, 32, 64)


def load_parallel(target) -> ParallelDraft:
    return ParallelDraft.from_pretrained(PARALLEL, target, target_path=pair_dirs()[0], dtype=target.dtype,
                                         device=target.device)  # fmt: skip


def parallel_plan(target, draft, parallel, head, *, chains=True, eagle=True) -> list[tuple[str, object]]:
    """(label, strategy) rows: the draft chain, EAGLE-2, the parallel draft's (``parallel``) and the parallel EAGLE
    head's (``head``) chains and trees."""
    plan = [(f"draft chain K={CHAIN}", DraftModelStrategy(draft, (1,) * CHAIN))]
    if eagle:
        plan.append(eagle_row(target))
    for name, make, block in (
        ("parallel", lambda **o: ParallelDraftStrategy(parallel, **o), parallel.block_size),
        ("parallel EAGLE", lambda **o: ParallelEagleStrategy(head, **o), head.block_size),
    ):
        depths = sorted({CHAIN, block}) if chains else [CHAIN]
        plan += [(f"{name} chain K={k}", make(depth=k)) for k in depths]
        plan += [(f"{name} tree {n} nodes", make(max_nodes=n)) for n in TREE_BUDGETS]
    return plan


def decode_batch(decoder: SpeculativeDecoder, label: str, prompts: list[list[int]], new_tokens: int) -> Run:
    """Every prompt in one batch (greedy); the engine's counters summed over requests. One decoder serves every run
    of a row, so an adaptive controller carries what it learnt from run to run, as a server's would."""
    start = time.perf_counter()
    result = decoder.generate(prompts, max_new_tokens=new_tokens, eos_token_id=None)
    if next(decoder.target.parameters()).is_cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    totals = [sum(getattr(s, f) for s in result.stats) for f in ("generated", "drafted", "accepted")]
    steps = max(s.target_forwards for s in result.stats)  # one target forward per step serves the whole batch
    return Run(label, result.tokens, seconds, totals[0], steps * len(prompts), totals[1], totals[2])


def ratio_table(title: str, runs: list[Run], tau_column: str, identical_column: str, differs: str) -> Table:
    """A table of ``runs`` (autoregressive first, the draft chain second): tokens/s, both ratios, tau, and whether each
    row's tokens equal the first row's (``differs`` marks those that do not)."""
    base, chain = runs[0], runs[1]
    table = Table(title, ["decoding", "tokens/s", "vs AR", "vs draft chain K=5", tau_column, identical_column])
    for r in runs:
        same = all(first_difference(a, b) is None for a, b in zip(r.tokens, base.tokens))
        ratios = (f"{r.tokens_per_s / base.tokens_per_s:.2f}x", f"{r.tokens_per_s / chain.tokens_per_s:.2f}x")
        table.add(r.label, r.tokens_per_s, *ratios, f"{r.tau:.2f}", "yes" if same else differs)
    return table


def parallel_tables(target, draft, prompts, batch_prompts, new_tokens: int, device: str, repeats: int) -> list:
    """The three tables (module docstring); returns them as ``(Table, file name)`` pairs."""
    tables = []
    parallel, head = load_parallel(target), ParallelEagleHead.from_pretrained(PARALLEL_EAGLE, target)
    rows = [("autoregressive", NoDraft()), *parallel_plan(target, draft, parallel, head)]
    plan = [(label, s, False) for label, s in rows]
    plan += [
        ("draft chain adaptive (K<=8)", DraftModelStrategy(draft, (1,) * 8), True),
        ("parallel tree adaptive (<=16 nodes)", ParallelDraftStrategy(parallel, max_nodes=16), True),
        ("parallel EAGLE tree adaptive (<=16 nodes)", ParallelEagleStrategy(head, max_nodes=16), True),
    ]
    for _, strategy, adaptive in plan:  # warm-up: first calls pay one-off costs
        decode_all(target, strategy, "", prompts[:1], 8, adaptive=adaptive)
    methods = [lambda ps, s=s, label=label, a=a: decode_all(target, s, label, ps, new_tokens, adaptive=a)
               for label, s, a in plan]  # fmt: skip
    runs = interleaved(methods, prompts, device, repeats)
    title = (f"Parallel drafting, greedy, embedded pair, {device}, batch 1, {len(prompts)} held-out prompts x "
             f"{new_tokens} tokens, fastest of {repeats} (interleaved)")  # fmt: skip
    tables.append((ratio_table(title, runs, "tau", "identical to AR", "NO"), "e2e_parallel"))

    plan = [
        ("autoregressive", NoDraft(), False),
        (f"draft chain K={CHAIN} (coupled)", DraftModelStrategy(draft, (1,) * CHAIN), False),
        (f"draft chain K={CHAIN} (stochastic)", DraftModelStrategy(draft, (1,) * CHAIN, rule="stochastic"), False),
        (f"parallel chain K={CHAIN} (coupled)", ParallelDraftStrategy(parallel, depth=CHAIN), False),
        (f"parallel chain K={CHAIN} (stochastic)", ParallelDraftStrategy(parallel, depth=CHAIN, rule="stochastic"),
         False),
        *[(f"parallel tree {n} nodes", ParallelDraftStrategy(parallel, max_nodes=n), False) for n in (8, 16)],
        (f"parallel EAGLE chain K={CHAIN}", ParallelEagleStrategy(head, depth=CHAIN), False),
        *[(f"parallel EAGLE tree {n} nodes", ParallelEagleStrategy(head, max_nodes=n), False) for n in (8, 16)],
        ("draft chain adaptive (K<=8, coupled)", DraftModelStrategy(draft, (1,) * 8), True),
        ("parallel tree adaptive (<=16 nodes)", ParallelDraftStrategy(parallel, max_nodes=16), True),
        ("parallel EAGLE tree adaptive (<=16 nodes)", ParallelEagleStrategy(head, max_nodes=16), True),
    ]  # fmt: skip
    methods = [lambda ps, s=s, label=label, a=a: decode_all(target, s, label, ps, new_tokens, temperature=1.0,
                                                            adaptive=a) for label, s, a in plan]  # fmt: skip
    runs = interleaved(methods, prompts, device, repeats)
    title = (f"Parallel drafting, temperature 1 (seeded), embedded pair, {device}, batch 1, {len(prompts)} prompts x "
             f"{new_tokens} tokens, fastest of {repeats} (interleaved)")  # fmt: skip
    tables.append((ratio_table(title, runs, "tau", "identical to AR (seeded)", "no"), "e2e_parallel_t1"))

    plan = [("autoregressive", NoDraft(), False)]
    rows = parallel_plan(target, draft, parallel, head, chains=False, eagle=False)
    plan += [(label, s, False) for label, s in rows]
    block = parallel.block_size
    plan += [
        ("draft chain K=2", DraftModelStrategy(draft, (1, 1)), False),
        ("parallel chain K=2", ParallelDraftStrategy(parallel, depth=2), False),
        ("parallel EAGLE chain K=2", ParallelEagleStrategy(head, depth=2), False),
        (f"draft chain adaptive (K<={block})", DraftModelStrategy(draft, (1,) * block), True),
        (f"parallel chain adaptive (K<={block})", ParallelDraftStrategy(parallel, depth=block), True),
        (f"parallel EAGLE chain adaptive (K<={head.block_size})", ParallelEagleStrategy(head), True),
        ("parallel EAGLE tree adaptive (<=16 nodes)", ParallelEagleStrategy(head, max_nodes=16), True),
    ]
    decoders = [SpeculativeDecoder(target, s, adaptive=a) for _, s, a in plan]
    for decoder in decoders:  # warm-up: first calls pay one-off costs (and the controllers their first steps)
        decode_batch(decoder, "", batch_prompts, 8)
    methods = [lambda ps, d=d, label=label: decode_batch(d, label, ps[0], new_tokens)
               for (label, _, _), d in zip(plan, decoders)]  # fmt: skip
    runs = interleaved(methods, [batch_prompts], device, repeats)
    title = (f"Parallel drafting, greedy, embedded pair, {device}, batch {len(batch_prompts)}, {new_tokens} tokens "
             f"each, fastest of {repeats} (interleaved)")  # fmt: skip
    tables.append((ratio_table(title, runs, "tokens per request-step", "identical to AR", "NO"), "e2e_parallel_batch"))
    tables.append((tree_tau_table(target, head, prompts, new_tokens), "e2e_parallel_eagle_tau"))
    return tables


def tree_tau_table(target, head, prompts, new_tokens: int) -> Table:
    """Greedy tau of the parallel EAGLE head's trees by node budget (columns) and confidence temperature (rows)."""
    temperatures = (1.0, 0.5, 0.3, 0.2, 0.1)
    title = (f"Parallel EAGLE trees, greedy tau by node budget and confidence temperature, embedded pair, batch 1, "
             f"{len(prompts)} held-out prompts x {new_tokens} tokens")  # fmt: skip
    table = Table(title, ["confidence temperature", *[f"{n} nodes" for n in TREE_BUDGETS]])
    for t in temperatures:
        taus = [decode_all(target, ParallelEagleStrategy(head, max_nodes=n, confidence_temperature=t), "", prompts,
                           new_tokens, adaptive=False).tau for n in TREE_BUDGETS]  # fmt: skip
        table.add(t, *[f"{tau:.2f}" for tau in taus])
    chains = [decode_all(target, ParallelEagleStrategy(head, depth=k), "", prompts, new_tokens, adaptive=False).tau
              for k in (5, head.block_size)]  # fmt: skip
    blank = [""] * (len(TREE_BUDGETS) - 1)
    table.add(f"chains K=5 / K={head.block_size}", f"{chains[0]:.2f} / {chains[1]:.2f}", *blank)
    return table
