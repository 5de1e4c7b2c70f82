"""The batch sweep of adaptive speculation (``bench_e2e.py --sweep-only``): adaptive against fixed chains per batch.

Batch 1, 2, 4, 8, 16, 32, greedy, plain decoding, fixed draft chains K = 1..5 and the adaptive chain (K <= 8),
plus n-gram K=5 (adaptive and fixed) against plain decoding at temperature 1; thread time, interleaved, each
(method, batch) the fastest of the repeats, and adaptive against the best of plain and fixed chains also as the
median of paired per-round ratios (steadier on a noisy machine) and of held-out ones (each round against the
method fastest in the other rounds: no winner's curse), n-gram T=1 against plain T=1 paired too; a PNG line chart
(``png_chart``: the venv has no matplotlib) of the ratios to plain decoding goes to ``--out``. ``--sweep-decoders
N`` times N independent adaptive decoders per batch size and reports their mean (one controller's choices follow
its own history, so one decoder per cell is one draw).
"""

from __future__ import annotations

from pathlib import Path

from common import Table, clock
from png_chart import line_chart
from replay import sweep_groups

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
