"""``python -m specdec demo``: speculative decoding with the embedded model pair, end to end.

The pair (``specdec/assets/pair``, loaded by ``specdec.testing``) is a small LLaMA target and a
one-layer draft distilled from it, both trained on the Python standard library.
The demo completes held-out code prompts with plain autoregressive decoding, a greedy draft
chain, a draft token tree, n-gram (prompt lookup) drafts, the target's Medusa heads
(``specdec/assets/medusa``, no draft model), EAGLE-2 over the EAGLE head (a tree, and the top-1 chain over
the target's frequent tokens) and the EAGLE-3 head (``specdec/assets/eagle``, ``specdec/assets/eagle3``) and the
parallel draft (``specdec/assets/parallel``, PARD: one draft forward proposes a chain, or a best-first tree) and
the parallel EAGLE head (``specdec/assets/parallel_eagle``: one head forward proposes a chain);
checks that every speculative output equals the target's own greedy output token for token; and
prints tokens/s, speedup, tau (tokens per target forward) and the draft acceptance rate.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.testing import ASSETS, heldout_prompts, load_pair, pair_dirs

MEDUSA = ASSETS.parent / "medusa"  # 4 heads trained for the embedded target
CHAIN = 5
TREE = (3, 2, 1, 1, 1)  # depth 5 like the chain; 28 nodes keep the CPU verify forward cheap
ADAPTIVE_CHAIN = 8  # the longest chain the adaptive row may draft (it picks each step's length)
PARALLEL = ASSETS.parent / "parallel"  # the parallel draft (PARD) trained for the embedded target
PARALLEL_CHAIN = 5  # the parallel draft's chain length
PARALLEL_TREE = dict(max_nodes=8)  # its best-first tree (ParallelDraftStrategy options; depth: the block size)
PARALLEL_EAGLE = ASSETS.parent / "parallel_eagle"  # the parallel EAGLE head trained for the embedded target
PARALLEL_EAGLE_CHAIN = 5  # its chain length (on the CPU its fastest shape: bench_e2e.py --parallel-only)


def strategies(draft, tree_rule: str = "deterministic") -> list[tuple[str, object]]:
    """(label, strategy) for each way of decoding the demo compares; the first is the baseline.

    ``tree_rule``: "deterministic" (top-k children; what greedy decoding wants) or "stochastic"
    (children sampled from the draft; SpecInfer's rule for sampling at temperature > 0).
    """
    from specdec.decoding import DraftModelStrategy, NgramStrategy, NoDraft

    tree = ",".join(map(str, TREE)) + ("" if tree_rule == "deterministic" else f" ({tree_rule})")
    return [
        ("autoregressive", NoDraft()),
        (f"draft chain K={CHAIN}", DraftModelStrategy(draft, (1,) * CHAIN)),
        (f"draft tree {tree}", DraftModelStrategy(draft, TREE, rule=tree_rule)),
        (f"n-gram K={CHAIN}", NgramStrategy(num_draft=CHAIN, max_ngram=3)),
    ]


# EAGLE-2 over the shipped head (specdec/assets/eagle); its confidences sharpened (the head is under-confident at
# depth 2 and beyond; ``bench/bench_e2e.py --eagle-only`` runs it beside the paper's confidences).
EAGLE = dict(tree_budget=12, depth=5, top_k=2, confidence_temperature=0.3)


def eagle_row(target, assets: str | Path = ASSETS, *, eagle3: bool = False, frequent: bool = False,
              **options) -> tuple[str, object]:  # fmt: skip
    """(label, EagleStrategy) with the EAGLE head shipped for the embedded target (``eagle3``: the EAGLE-3 head,
    ``specdec/assets/eagle3``; ``frequent``: the EAGLE head drafting over the target's 1024 most frequent tokens,
    ``frequent_token_ids``); ``options`` override ``EAGLE``."""
    from specdec.decoding.eagle import EagleStrategy
    from specdec.model.eagle import EagleHead
    from specdec.model.eagle3 import Eagle3Head
    from specdec.testing import frequent_token_ids

    loader, directory = (Eagle3Head, "eagle3") if eagle3 else (EagleHead, "eagle")
    head = loader.from_pretrained(Path(assets).parent / directory, target)
    if frequent:
        head.set_draft_vocabulary(frequent_token_ids(assets))
    options = {**EAGLE, **options}
    strategy = EagleStrategy(head, **options)
    kind = "EAGLE-1" if options.get("static_tree") else "EAGLE-2"
    kind += " (EAGLE-3 head)" if eagle3 else ""
    kind += f" ({head.draft_vocab_size}-token draft vocabulary)" if frequent else ""
    if options["top_k"] == 1 and not options.get("static_tree"):  # the tree is a chain of the best tokens
        return f"{kind} top-1 chain, depth {strategy.max_nodes - 1}", strategy
    return f"{kind} {options['tree_budget']} nodes, depth {options['depth']}", strategy


def medusa_row(target, choices=None) -> tuple[str, object]:
    """(label, strategy): the shipped Medusa heads on the embedded target, with the searched tree by default."""
    from specdec.decoding import MedusaStrategy

    strategy = MedusaStrategy.from_pretrained(MEDUSA, target, choices)
    return f"Medusa heads, {strategy.max_nodes}-node tree", strategy


def parallel_rows(target, assets: str | Path = ASSETS) -> list[tuple[str, object]]:
    """(label, strategy) for the parallel draft shipped beside the pair ``assets`` (its chain and its tree) and the
    parallel EAGLE head (its chain)."""
    from specdec.decoding import ParallelDraftStrategy, ParallelEagleStrategy
    from specdec.model import ParallelDraft, ParallelEagleHead

    target_dir, _ = pair_dirs(assets)
    draft = ParallelDraft.from_pretrained(
        Path(assets).parent / PARALLEL.name, target, target_path=target_dir, dtype=target.dtype, device=target.device
    )
    tree = ParallelDraftStrategy(draft, **PARALLEL_TREE)
    head = ParallelEagleHead.from_pretrained(Path(assets).parent / PARALLEL_EAGLE.name, target)
    return [
        (f"parallel draft chain K={PARALLEL_CHAIN}", ParallelDraftStrategy(draft, depth=PARALLEL_CHAIN)),
        (f"parallel draft tree {tree.max_nodes} nodes, depth {tree.max_depth}", tree),
        (f"parallel EAGLE chain K={PARALLEL_EAGLE_CHAIN}", ParallelEagleStrategy(head, depth=PARALLEL_EAGLE_CHAIN)),
    ]


@dataclass
class Run:
    """One strategy over every prompt: tokens per prompt, wall time, and the engine's counters summed."""

    label: str
    tokens: list[list[int]]
    seconds: float
    generated: int
    forwards: int
    drafted: int
    accepted: int

    @property
    def tokens_per_s(self) -> float:
        return self.generated / self.seconds

    @property
    def tau(self) -> float:
        return self.generated / self.forwards

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None


class Progress:
    """A one-line progress bar on a terminal (nothing when the stream is not a TTY, e.g. in logs)."""

    def __init__(self, total: int, stream=sys.stderr, width: int = 30):
        self.total, self.done, self.stream, self.width = total, 0, stream, width
        self.live = hasattr(stream, "isatty") and stream.isatty()
        self.start = time.perf_counter()

    def advance(self, what: str) -> None:
        self.done += 1
        if self.live:
            filled = self.width * self.done // self.total
            bar = "#" * filled + "." * (self.width - filled)
            elapsed = time.perf_counter() - self.start
            self.stream.write(f"\r[{bar}] {self.done}/{self.total} {elapsed:4.0f}s {what:<28}")
            self.stream.flush()

    def close(self) -> None:
        if self.live:
            self.stream.write("\r" + " " * (self.width + 48) + "\r")
            self.stream.flush()


def decode_all(target, strategy, label, prompts, max_new_tokens, progress=None, temperature=0.0, adaptive=False) -> Run:
    """Decode each prompt on its own (batch 1, the latency case speculation is for); prompt i uses seed i.

    ``adaptive``: as ``SpeculativeDecoder`` takes it; off by default here, so a row labelled with a size drafts
    that size every step."""
    from specdec.decoding import SpeculativeDecoder

    decoder = SpeculativeDecoder(target, strategy, adaptive=adaptive)
    cuda = next(target.parameters()).is_cuda
    tokens, seconds, totals = [], 0.0, [0, 0, 0, 0]
    for i, ids in enumerate(prompts):
        start = time.perf_counter()
        result = decoder.generate(
            [ids], max_new_tokens=max_new_tokens, temperature=temperature, seed=i, eos_token_id=None
        )
        if cuda:
            torch.cuda.synchronize()
        seconds += time.perf_counter() - start
        s = result.stats[0]
        tokens.append(result.tokens[0])
        for i, value in enumerate((s.generated, s.target_forwards, s.drafted, s.accepted)):
            totals[i] += value
        if progress is not None:
            progress.advance(label)
    return Run(label, tokens, seconds, *totals)


def first_difference(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (or of the shorter end), None when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def table(runs: list[Run], baseline: Run, identical: dict[str, bool]) -> str:
    rows = [
        "| decoding | tokens/s | speedup | tau | acceptance | identical to greedy |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for r in runs:
        acc = "-" if r.acceptance is None else f"{r.acceptance:.2f}"
        same = "baseline" if r is baseline else ("yes" if identical[r.label] else "NO")
        rows.append(
            f"| {r.label} | {r.tokens_per_s:.1f} | {r.tokens_per_s / baseline.tokens_per_s:.2f}x "
            f"| {r.tau:.2f} | {acc} | {same} |"
        )
    return "\n".join(rows)


def main(
    device: str = "cpu",
    *,
    num_prompts: int = 3,
    max_new_tokens: int = 96,
    show: int = 2,
    assets: str | Path = ASSETS,
    out=None,
) -> int:
    """Run the demo; returns 0 when every speculative output equals the target's greedy output, else 1.

    Parameters
    ----------
    device : "cpu" or "cuda"; the models run in float32 (they are small; it keeps greedy ties rare).
    num_prompts : held-out prompts to complete (each decoded alone, batch 1).
    max_new_tokens : tokens generated per prompt (EOS does not stop early, so every run does equal work).
    show : how many of the completions to print.
    assets : the pair's directory (the embedded one by default).
    out : text stream for the report (stdout by default); the progress bar goes to stderr.
    """
    out = out or sys.stdout
    if device.startswith("cuda") and not torch.cuda.is_available():
        print(f"error: --device {device}: CUDA is not available here", file=sys.stderr)
        return 2
    threads = torch.get_num_threads()
    if not device.startswith("cuda"):
        # The pair is small: intra-op threads cost more than they save, and on a busy machine
        # OpenMP's spinning threads slow every op down many times over.
        torch.set_num_threads(1)
    try:
        return _demo(device, num_prompts, max_new_tokens, show, assets, out)
    finally:
        torch.set_num_threads(threads)


def _demo(device, num_prompts, max_new_tokens, show, assets, out) -> int:
    target, draft, tokenizer = load_pair(device, assets=assets)
    params = sum(p.numel() for p in target.parameters()), sum(p.numel() for p in draft.parameters())
    cfg_t, cfg_d = target.config, draft.config
    print(
        f"specdec demo on {device}: target {params[0] / 1e6:.1f}M parameters ({cfg_t.num_layers} layers, "
        f"hidden {cfg_t.hidden_size}), draft {params[1] / 1e6:.2f}M ({cfg_d.num_layers} layer, "
        f"hidden {cfg_d.hidden_size}), trained on the Python standard library",
        file=out,
    )
    prompts = heldout_prompts(assets)[:num_prompts]
    ids = [tokenizer.encode(p["text"]).ids for p in prompts]
    print(
        f"{len(prompts)} held-out prompts, {max_new_tokens} greedy tokens each; "
        "every output is checked against the target's own greedy decoding\n",
        file=out,
    )
    from specdec.decoding import DraftModelStrategy

    # Every row drafts its labelled size but the last, which adapts each step's chain length (0 = plain).
    eagle_chain = eagle_row(target, assets, frequent=True, top_k=1, tree_budget=7, depth=6)  # the CPU's fastest EAGLE
    rows = [*strategies(draft), medusa_row(target), eagle_row(target, assets), eagle_chain,
            eagle_row(target, assets, eagle3=True), *parallel_rows(target, assets)]  # fmt: skip
    plan = [(label, s, False) for label, s in rows]
    plan.append((f"draft chain adaptive (K<={ADAPTIVE_CHAIN})", DraftModelStrategy(draft, (1,) * ADAPTIVE_CHAIN), True))
    # Warm-up: first calls pay one-off costs (allocations, kernel selection) that are not decoding speed.
    for _, strategy, adaptive in plan:
        decode_all(target, strategy, "", ids[:1], 8, adaptive=adaptive)
    progress = Progress(len(plan) * len(ids))
    runs = [
        decode_all(target, strategy, label, ids, max_new_tokens, progress, adaptive=adaptive)
        for label, strategy, adaptive in plan
    ]
    progress.close()
    baseline = runs[0]
    identical = {}
    for r in runs[1:]:
        diffs = [first_difference(a, b) for a, b in zip(r.tokens, baseline.tokens)]
        identical[r.label] = all(d is None for d in diffs)
    for i, p in enumerate(prompts[:show]):
        print(f"--- prompt {i + 1}: {p['file']} line {p['line']} (held out) ---", file=out)
        print(p["text"].rstrip("\n")[-400:], file=out)
        print(f"--- completion ({max_new_tokens} tokens, target greedy) ---", file=out)
        print(tokenizer.decode(baseline.tokens[i]), file=out)
        print(file=out)
    for r in runs[1:]:
        if identical[r.label]:
            print(f"{r.label}: all {len(ids)} outputs identical to target-only greedy decoding", file=out)
        else:
            where = [first_difference(a, b) for a, b in zip(r.tokens, baseline.tokens)]
            print(
                f"{r.label}: DIFFERS from target-only greedy decoding (first difference per prompt: {where})", file=out
            )
    print(file=out)
    print(table(runs, baseline, identical), file=out)
    print(
        "\ntau = tokens per target forward; acceptance = accepted / proposed draft tokens; "
        "speedup = tokens/s over autoregressive decoding in this run.",
        file=out,
    )
    return 0 if all(identical.values()) else 1
