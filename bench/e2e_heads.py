"""The end-to-end Medusa and EAGLE tables (``bench_e2e.py``): the shipped heads against the draft chain.

``medusa_table``: the Medusa heads with every searched tree and their chain against autoregressive decoding and
the draft chain, greedy, interleaved in one run, with acceptance by depth. ``eagle_table``: EAGLE (the shipped
head) against the draft chain: tokens/s, tau and acceptance by depth (``bench_e2e.py --eagle-only`` runs just it).
"""

from __future__ import annotations

from common import Table
from e2e_runs import acceptance_by_depth, interleaved

from specdec.cli.demo import CHAIN, TREE, decode_all, first_difference, medusa_row
from specdec.decoding import DraftModelStrategy


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
    """EAGLE-2 and EAGLE-1 (the shipped head, ``specdec/assets/eagle``, also over the target's 1024 most frequent
    tokens; EAGLE-3's, ``assets/eagle3``) against the draft chain, interleaved:
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
        eagle_row(target, eagle3=True),
        *(eagle_row(target, top_k=1, tree_budget=d + 1, depth=d, frequent=f) for f in (False, True) for d in (6, 8)),
        *(eagle_row(target, eagle3=True, top_k=1, tree_budget=d + 1, depth=d) for d in (6, 8)),
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
