"""Part 2 of ``bench_seeded.py``: the forward's row invariance.

A position's logits from a 1-row forward against the same position in multi-row forwards (prefill, batch decode, a
chain, a tree), what that does to seeded draws, each CPU linear path on its own, and what one GEMM path for every
layer and row count costs. ``GEMMS`` and ``target_gemms`` also serve parts 1 and 3 (``--gemms``), ``run_forward``
part 3's coupling table.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from common import Table, measure_many_us

from specdec import use_backend
from specdec.decoding.proposal import tree_metadata_on
from specdec.kernels import SamplingParams, filtered_probs, sample
from specdec.model import block, cpu_linear, llama
from specdec.model.attention_metadata import AttentionMetadata, causal_positions, tree_positions

SEED_BASE = 2**40 + 17  # request seeds use both 32-bit words of the key (every part's)
AGREEMENT_SAMPLING = {"T=1.0": dict(temperature=1.0), "T=0.7 top-p 0.9": dict(temperature=0.7, top_p=0.9)}
SKINNY_PASS = 8  # rows per pass of the extension's skinny kernel (csrc/skinny_linear_cpu.cpp, kMaxRows)


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
    every weight and row count (the library runs up to 128 rows on the skinny kernel instead)."""
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


def race_agreement(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """float64 ``[n]``: the probability that the exponential race with shared clocks (``argmax_i w_i / E_i``, how
    ``sample`` and ``sample_probs`` draw) picks the same token from row n of ``p`` and of ``q``, exactly.

    Token i wins both races when every other clock E_j exceeds E_i max(p_j / p_i, q_j / q_i), with probability
    1 / sum_j max(p_j / p_i, q_j / q_i) = 1 / (A_i / p_i + B_i / q_i), A_i the mass of p on the tokens whose
    ratio q_j / p_j is at most q_i / p_i and B_i the mass of q on the rest: one sort by the ratio per row."""
    p, q = p.double(), q.double()
    order = torch.where(p > 0, q / p, float("inf")).argsort(-1)
    p, q = p.gather(-1, order), q.gather(-1, order)
    a, b = p.cumsum(-1), q.sum(-1, keepdim=True) - q.cumsum(-1)
    both = (p > 0) & (q > 0)
    return torch.where(both, 1 / (a / torch.where(both, p, 1.0) + b / torch.where(both, q, 1.0)), 0.0).sum(-1)


def flip_probability(one: torch.Tensor, multi: torch.Tensor, sampling: dict) -> torch.Tensor:
    """float64 ``[n]``: the probability over the seeds that ``sample``'s race over the two rows' filtered
    distributions (``filtered_probs``: the sampler's own filter) gives different tokens."""
    params = SamplingParams.make(one.shape[0], **sampling)
    return 1 - race_agreement(*(filtered_probs(x, params).probs for x in (one, multi)))


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
