"""Seeded sampling that speculation cannot change (issue 35), measured on the embedded pair: CPU, float32.

Three parts, each a function printing a markdown table (``--out`` saves each as markdown and JSON):

1. ``agreement``: every strategy whose drafts are verified by "sample, then compare" (n-gram, draft trees top-k
   and coupled, draft chains coupled and argmax, Medusa, EAGLE-2, EAGLE-1) generates with per-request seeds,
   adaptive depths on (the default), EOS ignored, in batches; each request is compared token for token with
   seeded ``NoDraft`` decoding it alone (plain sampling) with the same seed. Position by position up to each
   request's first divergence and after it; the share of steps that drafted says how much speculation ran.
   ``NoDraft`` in the same batches is the control: what batching alone changes.
2. ``row_invariance``: the target's logits of a position computed in a 1-row forward (incremental decode, alone)
   against the same position computed in a multi-row forward: the causal prefill of the whole text, a chain's
   K+1 rows and a tree's rows (on the same 1-row prefix), a batch's decode rows. Bitwise-equal share, max
   |difference|, and how often ``specdec.kernels.sample`` with the same seed and offset draws another token; for
   the C++ ops (``auto``) and the PyTorch bodies (``torch``), shipped and with one GEMM path for every layer
   and row count (``GEMMS``: the skinny kernel in passes of 8 rows, or oneDNN with a packed weight), which shows
   whether the GEMMs are what varies. Then each linear path on its own, and what one path for all costs.
3. ``coupled_vs_optimal``: draft chains with the coupled, stochastic (optimal rejection) and deterministic
   (argmax, the fused C++ chain) rules and NoDraft, at T 0.7 and 1.0, fixed depths and adaptive, interleaved:
   tokens/s, ratios, tau, acceptance; and ``coupling_acceptance``: the one-draft acceptance each rule has on the
   models' own distributions along held-out text, beside two couplings not built (inverse CDF in each
   distribution's descending order, Gumbel-max).

One intra-op thread; times are thread CPU time (``common.clock``), methods interleaved prompt by prompt, each
(method, prompt) keeping its fastest of ``--repeats`` runs. The CPU path only: with ``TRITON_INTERPRET=1`` the
script refuses to run (Triton's interpreter would stand in for a GPU).

    python bench/bench_seeded.py --quick               # seconds: 2 prompts, a few tokens (tests/test_bench_seeded.py)
    python bench/bench_seeded.py --out OUT             # the full run (about 10 minutes of thread time)
    python bench/bench_seeded.py --parts 1 --reference-seed-shift 1   # the agreement against other seeds: fails
    python bench/bench_seeded.py --parts 1 --batch 1 --fixed-depths   # speculation every step, nothing batched
    python bench/bench_seeded.py --parts 1 --gemms oneDNN             # one GEMM path for every row count
    python bench/bench_seeded.py --parts 3 --ks 4 5                   # chains of 4 and 5
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from common import Table, bench_args, clock, cpu_threads, measure_many_us, positive_int
from e2e_runs import interleaved

from specdec import _backend, use_backend
from specdec.cli.demo import CHAIN, TREE, Run, eagle_row, first_difference, medusa_row
from specdec.decoding import DraftModelStrategy, NgramStrategy, NoDraft, SpeculativeDecoder
from specdec.decoding.proposal import tree_metadata_on
from specdec.kernels import SamplingParams, filtered_probs, sample
from specdec.model import block, cpu_linear, llama
from specdec.model.attention_metadata import AttentionMetadata, causal_positions, tree_positions
from specdec.testing import heldout_token_ids, load_pair

SEED_BASE = 2**40 + 17  # request seeds use both 32-bit words of the key
AGREEMENT_SAMPLING = {"T=1.0": dict(temperature=1.0), "T=0.7 top-p 0.9": dict(temperature=0.7, top_p=0.9)}
RULES = ("coupled", "stochastic", "deterministic")
SKINNY_PASS = 8  # rows per pass of the extension's skinny kernel (csrc/skinny_linear_cpu.cpp, kMaxRows)


# ----------------------------------------------------------------------------- part 1: agreement


def agreement_strategies(target, draft) -> dict[str, Callable[[], object]]:
    """(label -> fresh strategy) for every strategy verified by "sample, then compare" (the demo's sizes), after
    plain decoding in the same batches: the control, what batching alone changes."""
    tree = ",".join(map(str, TREE))
    return {
        "NoDraft (control: batched)": NoDraft,
        f"n-gram K={CHAIN}": lambda: NgramStrategy(num_draft=CHAIN, max_ngram=3),
        f"draft tree {tree} top-k": lambda: DraftModelStrategy(draft, TREE, rule="deterministic"),
        f"draft tree {tree} coupled": lambda: DraftModelStrategy(draft, TREE, rule="coupled"),
        f"draft chain K={CHAIN} coupled": lambda: DraftModelStrategy(draft, (1,) * CHAIN, rule="coupled"),
        f"draft chain K={CHAIN} argmax": lambda: DraftModelStrategy(draft, (1,) * CHAIN, rule="deterministic"),
        "Medusa": lambda: medusa_row(target)[1],
        "EAGLE-2": lambda: eagle_row(target)[1],
        "EAGLE-1": lambda: eagle_row(target, static_tree="default")[1],
    }


@dataclass
class Agreement:
    """One strategy's tokens against plain sampling's, summed over requests."""

    tokens: int = 0
    equal: int = 0
    equal_before: int = 0  # equal positions up to each request's first divergence
    equal_after: int = 0  # equal positions after it
    diverged: int = 0
    requests: int = 0

    def add(self, tokens: list[int], reference: list[int]) -> None:
        first = first_difference(tokens, reference)
        n = max(len(tokens), len(reference))
        before = n if first is None else first
        after = sum(a == b for a, b in zip(tokens[before:], reference[before:]))
        self.tokens, self.requests = self.tokens + n, self.requests + 1
        self.equal_before, self.equal_after = self.equal_before + before, self.equal_after + after
        self.equal += before + after
        self.diverged += first is not None


def agreement(
    target, draft, prompts: list[list[int]], *, new_tokens: int, seeds_per_prompt: int, batch: int,
    reference_seed_shift: int = 0, adaptive: bool = True, note: str = "",
) -> Table:  # fmt: skip
    """Seeded output of each strategy against seeded plain sampling (``NoDraft``, each request alone).

    Requests are (prompt, seed) pairs, ``seeds_per_prompt`` seeds per prompt, decoded in batches of ``batch`` by
    one decoder per strategy and sampling (its adaptive controller carries over from batch to batch, as a
    server's would). ``reference_seed_shift`` gives plain sampling other seeds: a check that the comparison
    can fail. ``note`` ends the title."""
    requests = [(p, SEED_BASE + s * len(prompts) + i) for s in range(seeds_per_prompt) for i, p in enumerate(prompts)]
    batches = [requests[i : i + batch] for i in range(0, len(requests), batch)]
    table = Table(
        f"Seeded output vs seeded plain sampling (NoDraft alone), embedded pair, CPU float32, "
        f"{len(requests)} requests x {new_tokens} tokens per sampling, batches of {batch}, "
        f"{'adaptive depths' if adaptive else 'fixed depths'}"
        + (f", plain sampling's seeds shifted by {reference_seed_shift}" if reference_seed_shift else "") + note,
        ["strategy", "sampling", "tokens", "equal", "equal before 1st divergence", "equal after", "requests diverged",
         "rate", "requests diverged from batched NoDraft", "steps that drafted", "tokens from drafts"],
    )  # fmt: skip
    strategies = agreement_strategies(target, draft)
    for name, sampling in AGREEMENT_SAMPLING.items():
        control = None  # the batched NoDraft's tokens (the first strategy)
        plain = SpeculativeDecoder(target, NoDraft())
        reference = [
            plain.generate([p], max_new_tokens=new_tokens, seed=[s + reference_seed_shift], eos_token_id=None,
                           **sampling).tokens[0]
            for p, s in requests
        ]  # fmt: skip
        for label, make in strategies.items():
            decoder = SpeculativeDecoder(target, make(), adaptive=adaptive)
            counts, emitted, steps, drafting, from_drafts = Agreement(), [], 0, 0, 0
            for group in batches:
                result = decoder.generate([p for p, _ in group], max_new_tokens=new_tokens, seed=[s for _, s in group],
                                          eos_token_id=None, **sampling)  # fmt: skip
                emitted += result.tokens
                for stats in result.stats:
                    steps += len(stats.chosen_depths)
                    drafting += sum(d > 0 for d in stats.chosen_depths)
                    from_drafts += stats.accepted
            for tokens, ref in zip(emitted, reference):
                counts.add(tokens, ref)
            control = control or emitted
            own = sum(a != b for a, b in zip(emitted, control))  # what speculation changed beyond batching
            table.add(
                label, name, counts.tokens, counts.equal, counts.equal_before, counts.equal_after,
                f"{counts.diverged}/{counts.requests}", f"{100 * counts.equal / counts.tokens:.2f}%",
                f"{own}/{counts.requests}", f"{100 * drafting / max(steps, 1):.0f}%", from_drafts,
                data=dict(rate=counts.equal / counts.tokens),
            )  # fmt: skip
    return table


# ----------------------------------------------------------------------------- part 2: the forward's row invariance


def skinny_passes_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` through the extension's skinny kernel with the rows padded to whole passes of 8: a pass of 8
    rows sums each row in one order, a pass of fewer rows over more partial sums (another order)."""
    rows = x.shape[0]
    if rows % SKINNY_PASS:
        x = torch.cat((x, x.new_zeros(-rows % SKINNY_PASS, x.shape[1])))
    return cpu_linear.skinny_linear(x, weight, bias)[:rows]


_ONEDNN_PACKS: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(weight) -> (weight, its oneDNN layout)


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` through oneDNN with the weight reordered for it (``cpu_linear.packed_linear``'s call), for
    every weight and row count (the library runs up to 16 rows, and small weights, on other paths)."""
    entry = _ONEDNN_PACKS.get(id(weight))
    if entry is None or entry[0] is not weight:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, cpu_linear.PACK_ROWS)
        entry = _ONEDNN_PACKS[id(weight)] = (weight, packed)
    return torch.ops.mkldnn._linear_pointwise(x, entry[1], bias, "none", [], "")


# The GEMMs of the target's forwards: the library's choice by row count, or one path for every layer and row count
# (where this build has it).
GEMMS = {
    "shipped": None,
    **({"skinny x8": skinny_passes_linear} if cpu_linear.skinny_available() else {}),
    **({"oneDNN": onednn_linear} if cpu_linear.AVAILABLE else {}),
}


@contextlib.contextmanager
def target_gemms(kind: str):
    """Model forwards in the block run the ``GEMMS[kind]`` linear layers, by rebinding the name the forward looks
    up (an experiment of this benchmark; the library is unchanged)."""
    linear = GEMMS[kind]
    if linear is None:
        yield
        return
    saved = block.linear_for, llama.linear_for
    block.linear_for = llama.linear_for = lambda x: linear
    try:
        yield
    finally:
        block.linear_for, llama.linear_for = saved


def run_forward(model, cache, rows: list[list[int]], parents: list[int] | None = None, commit: bool = False):
    """One forward of ``rows[b]`` (causal, or one token tree of ``parents`` for a one-request cache) after each
    request's prefix in ``cache``; the K/V committed with ``commit``, else discarded. Returns the logits."""
    counts = [len(r) for r in rows]
    cache.reserve(counts)
    tokens = torch.tensor([t for r in rows for t in r], dtype=torch.int64)
    q_offsets = torch.tensor([0, *itertools.accumulate(counts)], dtype=torch.int32)
    if parents is None:
        positions = causal_positions(q_offsets, cache.seq_lens, tokens.numel())
        metadata = AttentionMetadata(q_offsets)
    else:
        depth, mask = tree_metadata_on([parents], model.device)
        positions = tree_positions(q_offsets, cache.seq_lens, depth)
        metadata = AttentionMetadata(q_offsets, mask)
    logits, _ = model(tokens, positions, metadata, cache)
    cache.advance(counts) if commit else cache.discard()
    return logits


def path_tree(path: list[int], siblings: int, vocab: int) -> tuple[list[int], list[int], list[int]]:
    """(tokens, parents, path nodes) of a tree whose root-to-leaf path carries ``path`` and whose every path node
    past the root comes after ``siblings`` other children of its parent (tokens off the text)."""
    tokens, parents, nodes = [path[0]], [-1], [0]
    for token in path[1:]:
        for j in range(siblings):
            tokens.append((token + 1 + j) % vocab)
            parents.append(nodes[-1])
        tokens.append(token)
        parents.append(nodes[-1])
        nodes.append(len(tokens) - 1)
    return tokens, parents, nodes


def plain_texts(target, prompts: list[list[int]], new_tokens: int, context: int | None) -> list[list[int]]:
    """Each prompt (its last ``context`` tokens, all of it with None) with a seeded T=1 continuation by plain
    decoding, all cut to the shortest length."""
    prompts = [p[-context:] for p in prompts] if context else prompts
    decoder = SpeculativeDecoder(target, NoDraft())
    seeds = [SEED_BASE + i for i in range(len(prompts))]
    out = decoder.generate(prompts, max_new_tokens=new_tokens, temperature=1.0, seed=seeds, eos_token_id=None).tokens
    texts = [p + t for p, t in zip(prompts, out)]
    return [t[: min(map(len, texts))] for t in texts]


class RowPairs:
    """Logits rows of one position from a 1-row forward and from a multi-row forward, with the position."""

    def __init__(self):
        self.one, self.multi, self.positions = [], [], []

    def add(self, one: torch.Tensor, multi: torch.Tensor, positions: list[int]) -> None:
        self.one.append(one)
        self.multi.append(multi)
        self.positions += positions

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return torch.cat(self.one), torch.cat(self.multi), torch.tensor(self.positions)


def forward_pairs(target, texts: list[list[int]], verify_from: int, k: int, siblings: int) -> dict[str, RowPairs]:
    """forward kind -> ``RowPairs``: every position's 1-row logits (each text decoded alone, one token per
    forward from position 0) against the same position in a causal prefill of all texts (one ragged forward),
    a batch decode (one row per text per forward), and, from ``verify_from`` on, a chain of k+1 rows and a
    tree (the chain's path, ``siblings`` off-text siblings before each path node) on the 1-row prefix."""
    vocab, n = target.config.vocab_size, len(texts[0])
    tree_rows = 1 + k * (siblings + 1)
    kinds = {
        f"prefill ({len(texts)} x {n} rows, ragged)": RowPairs(),
        f"batch decode ({len(texts)} rows)": RowPairs(),
        f"chain ({k + 1} rows)": RowPairs(),
        f"tree ({tree_rows} rows, path of {k + 1})": RowPairs(),
    }
    prefill, batch, chain, tree = kinds.values()
    one_row = []
    for text in texts:
        cache, rows, verified = target.new_cache(1, n + tree_rows), [], []
        for t in range(n):
            if verify_from <= t and t + k < n:
                verified.append((t, run_forward(target, cache, [text[t : t + k + 1]])))
                tokens, parents, path = path_tree(text[t : t + k + 1], siblings, vocab)
                verified.append((t, run_forward(target, cache, [tokens], parents)[path]))
            rows.append(run_forward(target, cache, [[text[t]]], commit=True))
        rows = torch.cat(rows)
        one_row.append(rows)
        for i, (t, logits) in enumerate(verified):
            (chain if i % 2 == 0 else tree).add(rows[t : t + k + 1], logits, list(range(t, t + k + 1)))
    cache = target.new_cache(len(texts), n)
    logits = run_forward(target, cache, texts).view(len(texts), n, vocab)
    for rows, multi in zip(one_row, logits):
        prefill.add(rows, multi, list(range(n)))
    cache = target.new_cache(len(texts), n)
    decoded = torch.stack([run_forward(target, cache, [[text[t]] for text in texts], commit=True) for t in range(n)])
    for r, rows in enumerate(one_row):
        batch.add(rows, decoded[:, r], list(range(n)))
    return kinds


def flip_probability(one: torch.Tensor, multi: torch.Tensor, sampling: dict) -> torch.Tensor:
    """float64 ``[n]``: the measure of the uniforms u for which ``sample``'s inverse CDF (vocab order) over the
    two rows' filtered distributions (``filtered_probs``: the sampler's own filter) gives different tokens."""
    params = SamplingParams.make(one.shape[0], **sampling)
    cdf_a, cdf_b = (filtered_probs(x, params).probs.double().cumsum(-1) for x in (one, multi))
    lo, hi = torch.minimum(cdf_a, cdf_b), torch.maximum(cdf_a, cdf_b)
    # u in [lo_k, hi_k) picks token k under one CDF and not the other; both ends grow with k, so the union of
    # these intervals is their lengths past the previous upper end
    return (hi - torch.maximum(lo, F.pad(hi[:, :-1], (1, 0)))).clamp(min=0).sum(-1)


def sampled_flips(one: torch.Tensor, multi: torch.Tensor, positions: torch.Tensor, sampling: dict, draws: int) -> int:
    """Tokens ``sample`` draws differently from the two rows of each position, with ``draws`` seeds each and the
    position as the offset."""
    flips, chunk = 0, max(1, 4096 // draws)
    for i in range(0, one.shape[0], chunk):
        a, b, pos = one[i : i + chunk], multi[i : i + chunk], positions[i : i + chunk]
        rows = a.shape[0] * draws
        seeds = SEED_BASE + torch.arange(draws).repeat(a.shape[0])
        params = SamplingParams.make(rows, seed=seeds, offset=pos.repeat_interleave(draws), **sampling)
        drawn = [sample(x.repeat_interleave(draws, 0), params).tokens for x in (a, b)]
        flips += int((drawn[0] != drawn[1]).sum())
    return flips


def row_invariance(target, texts: list[list[int]], verify_from: int, *, k: int, siblings: int, draws: int) -> Table:
    """Part 2's main table: per backend, GEMMs and forward kind, how a position's logits differ between a 1-row
    forward and a multi-row one, and what that does to seeded draws (rows of equal bits draw equal tokens: only
    the others are sampled)."""
    names, samplings = list(AGREEMENT_SAMPLING), list(AGREEMENT_SAMPLING.values())
    table = Table(
        f"The target's logits of a position, 1-row forward vs multi-row forward, embedded pair, CPU float32, "
        f"{len(texts)} texts of {len(texts[0])} tokens; flips: tokens ``sample`` draws differently with the same "
        f"seed and offset ({draws} seeds per position, {names[0]}); expected flips: exact, from the sampler's "
        f"filtered probabilities",
        ["backend", "GEMMs", "forward", "positions", "bitwise equal", "max abs diff", f"flips {names[0]}",
         *[f"expected flips per 10^4 tokens, {n}" for n in names]],
    )  # fmt: skip
    # the C++ ops with each GEMM path, the PyTorch bodies shipped and with oneDNN throughout
    configs = [("auto", g) for g in GEMMS] + [("torch", g) for g in GEMMS if g != "skinny x8"]
    for backend, gemms in configs:
        with use_backend(backend), target_gemms(gemms), torch.inference_mode():
            kinds = forward_pairs(target, texts, verify_from, k, siblings)
            for kind, pairs in kinds.items():
                one, multi, positions = pairs.tensors()
                n = one.shape[0]
                differ = (one.view(torch.int32) != multi.view(torch.int32)).any(-1)
                one, multi, positions = one[differ], multi[differ], positions[differ]
                flips = sampled_flips(one, multi, positions, samplings[0], draws)
                expected = [1e4 * flip_probability(one, multi, s).sum().item() / n for s in samplings]
                table.add(
                    backend, gemms, kind, n, f"{100 * (1 - differ.float().mean().item()):.1f}%",
                    f"{(one - multi).abs().max().item() if one.numel() else 0.0:.2e}", f"{flips}/{n * draws}",
                    *[f"{e:.3f}" for e in expected],
                    data=dict(bitwise_equal=1 - differ.float().mean().item(), flips=flips, draws=n * draws),
                )  # fmt: skip
    return table


def linear_paths(target, row_counts: tuple[int, ...]) -> Table:
    """Each CPU linear path alone on the target's five weights: does row r of an n-row call equal the same path
    on row r alone (share of rows bitwise equal, max abs difference)."""
    paths = {"F.linear": F.linear, "oneDNN packed (F.linear below 2^18 elements)": cpu_linear.packed_linear}
    if cpu_linear.skinny_available():
        paths["skinny kernel (C++)"] = cpu_linear.skinny_linear
    paths["shipped choice (linear_for)"] = lambda x, w: cpu_linear.linear_for(x)(x, w)
    names = {
        "skinny x8": "skinny kernel, passes of 8 rows (skinny x8)",
        "oneDNN": "oneDNN packed, every weight (oneDNN)",
    }
    paths.update({names[g]: linear for g, linear in GEMMS.items() if linear is not None})
    table = Table(
        "Linear paths, target weights (qkv, o, gate/up, down, LM head), random rows: row r of an n-row call vs the "
        "same path on row r alone (bitwise equal rows; max abs diff)",
        ["path", *[f"n={n}" for n in row_counts]],
    )
    generator = torch.Generator().manual_seed(0)
    weights = [*target.linear_weights()[:4], target.lm_head_weight]
    with torch.inference_mode():
        inputs = {w.shape[1]: torch.randn(max(row_counts), w.shape[1], generator=generator) for w in weights}
        for name, linear in paths.items():
            cells = []
            for n in row_counts:
                equal = rows = 0
                worst = 0.0
                for w in weights:
                    x = inputs[w.shape[1]][:n]
                    alone = torch.cat([linear(x[r : r + 1], w) for r in range(n)])
                    together = linear(x, w)
                    equal += int((alone.view(torch.int32) == together.view(torch.int32)).all(-1).sum())
                    rows += n
                    worst = max(worst, (alone - together).abs().max().item())
                cells.append(f"{100 * equal / rows:.0f}% ({worst:.1e})")
            table.add(name, *cells)
    return table


def invariance_cost(target, text: list[int], shapes: list[tuple[str, int]], tree: tuple[list[int], list[int]],
                    budget_s: float) -> Table:  # fmt: skip
    """The target's forward time with each of ``GEMMS``, interleaved, per shape: (name, rows) where a name starting
    "tree" runs ``tree`` (tokens, parents), "prefill" the text's first rows from an empty cache, anything else the
    text's first rows as causal rows after the whole text."""
    table = Table(
        f"Cost of one GEMM path for every layer and row count: the target's forward (C++ ops), after a "
        f"{len(text)}-token prefix unless a prefill, thread time, interleaved",
        ["forward", "rows", *[f"{g} µs" for g in GEMMS], *[f"{g} / shipped" for g in list(GEMMS)[1:]]],
    )
    with torch.inference_mode():
        prefixed = target.new_cache(1, len(text) + 128)
        run_forward(target, prefixed, [text], commit=True)
        empty = target.new_cache(1, len(text) + 128)

        def timed(name: str, rows: int, gemms: str) -> Callable[[], None]:
            cache = empty if name.startswith("prefill") else prefixed
            rows_in, parents = (tree[0], tree[1]) if name.startswith("tree") else (text[:rows], None)

            def run():
                with target_gemms(gemms):
                    run_forward(target, cache, [rows_in], parents)

            return run

        for name, rows in shapes:
            times = [t[0] for t in measure_many_us([timed(name, rows, g) for g in GEMMS], "cpu", 3, budget_s)]
            table.add(name, rows, *[f"{t:.0f}" for t in times], *[f"{t / times[0]:.2f}x" for t in times[1:]])
    return table


# ----------------------------------------------------------------------------- part 3: coupled vs the optimal rule


def coupled_vs_optimal(target, draft, prompts: list[list[int]], *, ks: tuple[int, ...], new_tokens: int,
                       repeats: int, note: str = "") -> Table:  # fmt: skip
    """Draft chains of each rule against NoDraft at T 0.7 and 1.0 (top-k 0, top-p 1), fixed depths and adaptive,
    every method interleaved prompt by prompt (each decoder built once and warmed on the first prompt); ``note``
    ends the title."""
    seed_of = {tuple(p): SEED_BASE + i for i, p in enumerate(prompts)}

    def method(label, strategy, adaptive, temperature):
        decoder = SpeculativeDecoder(target, strategy, adaptive=adaptive)

        def run(batch):
            result = decoder.generate(batch, max_new_tokens=new_tokens, temperature=temperature,
                                      seed=[seed_of[tuple(p)] for p in batch], eos_token_id=None)  # fmt: skip
            totals = [sum(getattr(s, f) for s in result.stats) for f in ("generated", "target_forwards", "drafted",
                                                                           "accepted")]  # fmt: skip
            return Run(label, result.tokens, 0.0, *totals)

        return run

    plan = []  # (temperature, depths, K, rule, method)
    for temperature in (0.7, 1.0):
        plan.append((temperature, "-", "-", "NoDraft", method("NoDraft", NoDraft(), False, temperature)))
        for adaptive, k, rule in itertools.product((False, True), ks, RULES):
            strategy = DraftModelStrategy(draft, (1,) * k, rule=rule)
            depths = "adaptive" if adaptive else "fixed"
            plan.append((temperature, depths, k, rule, method(f"{rule} {k}", strategy, adaptive, temperature)))
    for *_, run in plan:  # warm-up: packs, first shapes, the adaptive controllers' first measurements
        run(prompts[:1])
    runs = interleaved([run for *_, run in plan], prompts, "cpu", repeats)
    speed = {key[:4]: r.tokens_per_s for key, r in zip(plan, runs)}
    table = Table(
        f"Draft chains by rule vs NoDraft, embedded pair, CPU, one thread, {len(prompts)} prompts x {new_tokens} "
        f"tokens, seeded, fastest of {repeats} per prompt (thread time), interleaved{note}",
        ["T", "depths", "K", "rule", "tok/s", "x NoDraft", "x stochastic", "tau", "acceptance"],
    )
    for (temperature, depths, k, rule, _), r in zip(plan, runs):
        base = speed[temperature, "-", "-", "NoDraft"]
        stochastic = speed.get((temperature, depths, k, "stochastic"))
        acceptance = "-" if r.acceptance is None else f"{r.acceptance:.2f}"
        table.add(
            temperature, depths, k, rule, f"{r.tokens_per_s:.0f}", f"{r.tokens_per_s / base:.2f}x",
            "-" if stochastic is None else f"{r.tokens_per_s / stochastic:.2f}x", f"{r.tau:.2f}", acceptance,
            data=dict(tokens_per_s=r.tokens_per_s),
        )  # fmt: skip
    return table


def coupling_acceptance(target, draft, texts: list[list[int]], verify_from: int, gumbel_draws: int) -> Table:
    """The probability that one draft token is accepted, per rule, from the target's and the draft's distributions
    at each position of ``texts`` past ``verify_from`` (exact, float64; Gumbel-max by ``gumbel_draws`` draws)."""
    table = Table(
        f"One draft's acceptance probability by rule, the models' distributions along {len(texts)} held-out texts "
        f"(top-k 0, top-p 1): the optimal rule, argmax drafts, the coupled rule as built (one uniform, inverse CDF "
        f"in vocab order) and two couplings not built",
        ["T", "positions", "optimal rule: 1 - TV", "argmax draft: p(argmax q)", "coupled (inverse CDF, vocab order)",
         "inverse CDF, descending order", f"Gumbel-max ({gumbel_draws} draws)"],
    )  # fmt: skip
    with torch.inference_mode():
        logits = [
            run_forward(model, model.new_cache(len(texts), len(texts[0])), texts).view(len(texts), len(texts[0]), -1)
            for model in (target, draft)
        ]
    target_logits, draft_logits = (x[:, verify_from:].reshape(-1, x.shape[-1]).double() for x in logits)
    generator = torch.Generator().manual_seed(0)
    for temperature in (0.7, 1.0):
        log_p, log_q = (torch.log_softmax(x / temperature, -1) for x in (target_logits, draft_logits))
        p, q = log_p.exp(), log_q.exp()
        optimal = torch.minimum(p, q).sum(-1)
        argmax = p.gather(-1, q.argmax(-1, keepdim=True)).squeeze(-1)
        vocab_order = interval_overlap(p, q, p.cumsum(-1) - p, q.cumsum(-1) - q)
        descending = interval_overlap(p, q, sorted_starts(p), sorted_starts(q))
        agree = 0.0
        for _ in range(gumbel_draws):
            g = -torch.log(-torch.log(torch.rand(p.shape, dtype=torch.float64, generator=generator).clamp_min(1e-300)))
            agree += ((log_p + g).argmax(-1) == (log_q + g).argmax(-1)).double().mean().item()
        table.add(
            temperature, p.shape[0], *[f"{x.mean().item():.3f}" for x in (optimal, argmax, vocab_order, descending)],
            f"{agree / gumbel_draws:.3f}",
        )  # fmt: skip
    return table


def interval_overlap(p: torch.Tensor, q: torch.Tensor, start_p: torch.Tensor, start_q: torch.Tensor) -> torch.Tensor:
    """``[n]``: the measure of u in [0, 1) landing on the same token in both, token k owning [start, start + mass)."""
    return (torch.minimum(start_p + p, start_q + q) - torch.maximum(start_p, start_q)).clamp(min=0).sum(-1)


def sorted_starts(p: torch.Tensor) -> torch.Tensor:
    """Where each token's interval starts when the tokens are laid out by descending probability."""
    mass, order = p.sort(-1, descending=True)
    return torch.empty_like(p).scatter_(-1, order, mass.cumsum(-1) - mass)


# ----------------------------------------------------------------------------- the script


@dataclass(frozen=True)
class Sizes:
    agreement_prompts: int
    seeds_per_prompt: int
    agreement_tokens: int
    batch: int
    texts: int  # parts 2 and 3's coupling table: held-out texts
    text_context: int | None  # of each prompt, the last tokens kept (None: all)
    text_tokens: int
    draws: int
    gumbel_draws: int
    chain_prompts: int
    chain_tokens: int
    ks: tuple[int, ...]
    repeats: int
    budget_s: float  # the GEMM cost table's time per shape


FULL = Sizes(12, 2, 210, 6, 3, None, 96, 4, 64, 6, 96, (4,), 3, 0.5)
QUICK = Sizes(2, 1, 12, 2, 2, 12, 8, 2, 4, 1, 12, (4,), 1, 0.02)


def main() -> None:
    def extra(parser):
        parser.add_argument("--parts", type=int, nargs="+", choices=(1, 2, 3), default=[1, 2, 3])
        parser.add_argument("--repeats", type=int, default=None, help="runs per (method, prompt) in part 3")
        parser.add_argument("--backend", choices=("auto", "torch"), default="auto",
                            help="parts 1 and 3: 'auto' (the CPU's C++ ops, what users get) or 'torch' (PyTorch "
                            "bodies only); part 2 measures both")  # fmt: skip
        parser.add_argument("--reference-seed-shift", type=int, default=0,
                            help="part 1 against plain sampling with shifted seeds (a check it can fail)")  # fmt: skip
        parser.add_argument("--fixed-depths", action="store_true", help="part 1 with adaptive=False")
        parser.add_argument("--batch", type=positive_int, default=None, help="part 1's batch size (1: alone)")
        parser.add_argument("--ks", type=positive_int, nargs="+", default=None, help="part 3's chain lengths")
        parser.add_argument(
            "--gemms",
            choices=list(GEMMS),
            default="shipped",
            help="parts 1 and 3: every model forward's GEMMs (an experiment: one path for every row count)",
        )

    args = bench_args(__doc__.splitlines()[0], extra)
    if args.device != "cpu":
        raise SystemExit(f"--device: this benchmark measures the CPU path, got {args.device!r}")
    if _backend.interpreter_enabled():
        raise SystemExit("TRITON_INTERPRET is set: Triton's interpreter would stand in for a GPU; run with it unset")
    cpu_threads("cpu")
    sizes = QUICK if args.quick else FULL
    repeats = args.repeats or sizes.repeats
    note = "" if args.gemms == "shipped" else f", GEMMs: {args.gemms} for every layer and row count"
    target, draft, tokenizer = load_pair()
    pool = heldout_token_ids(tokenizer)
    now = clock("cpu")
    with use_backend(args.backend):
        if 1 in args.parts:
            start = now()
            with target_gemms(args.gemms):
                agreement(target, draft, pool[: sizes.agreement_prompts], new_tokens=sizes.agreement_tokens,
                          seeds_per_prompt=sizes.seeds_per_prompt, batch=args.batch or sizes.batch,
                          reference_seed_shift=args.reference_seed_shift, adaptive=not args.fixed_depths,
                          note=note).write(args.out, "seeded_agreement")  # fmt: skip
            print(f"\n(part 1: {now() - start:.0f} s thread time)")
        if 2 in args.parts or 3 in args.parts:
            prompts = pool[: sizes.texts]
            texts = plain_texts(target, prompts, sizes.text_tokens, sizes.text_context)
            verify_from = sizes.text_context or min(map(len, prompts))
        if 2 in args.parts:
            start = now()
            row_invariance(target, texts, verify_from, k=CHAIN, siblings=3, draws=sizes.draws).write(
                args.out, "seeded_row_invariance"
            )
            linear_paths(target, (2, CHAIN + 1, 9, 17, 64)).write(args.out, "seeded_linear_paths")
            tokens, parents, _ = path_tree(texts[0][: CHAIN + 1], 3, target.config.vocab_size)
            shapes = [("decode", 1), ("chain", CHAIN + 1), (f"tree (path of {CHAIN + 1})", len(tokens)),
                      ("prefill", min(64, len(texts[0]))), ("prefill", len(texts[0]))]  # fmt: skip
            cost = invariance_cost(target, texts[0], shapes, (tokens, parents), sizes.budget_s)
            cost.write(args.out, "seeded_invariance_cost")
            print(f"\n(part 2: {now() - start:.0f} s thread time)")
        if 3 in args.parts:
            start = now()
            with target_gemms(args.gemms):
                coupled_vs_optimal(target, draft, pool[: sizes.chain_prompts], ks=tuple(args.ks or sizes.ks),
                                   new_tokens=sizes.chain_tokens, repeats=repeats, note=note).write(
                    args.out, "seeded_rules")  # fmt: skip
            coupling_acceptance(target, draft, texts, verify_from, sizes.gumbel_draws).write(
                args.out, "seeded_coupling_acceptance"
            )
            print(f"\n(part 3: {now() - start:.0f} s thread time)")


if __name__ == "__main__":
    main()
