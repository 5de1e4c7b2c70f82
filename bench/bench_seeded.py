"""Seeded sampling that speculation cannot change (issue 35), measured on the embedded pair: CPU, float32.

Three parts, each a function printing a markdown table (``--out`` saves each as markdown and JSON):

1. ``agreement``: every strategy whose drafts are verified by "sample, then compare" (n-gram, draft trees top-k
   and coupled, draft chains coupled and argmax, Medusa, EAGLE-2, EAGLE-1) generates with per-request seeds,
   adaptive depths on (the default), EOS ignored, in batches; each request is compared token for token with
   seeded ``NoDraft`` decoding it alone (plain sampling) with the same seed. Position by position up to each
   request's first divergence and after it; the share of steps that drafted says how much speculation ran.
   ``NoDraft`` in the same batches is the control: what batching alone changes.
2. ``row_invariance`` (in ``seeded_rows.py``): the target's logits of a position computed in a 1-row forward
   (incremental decode, alone) against the same position computed in a multi-row forward: the causal prefill of
   the whole text, a chain's K+1 rows and a tree's rows (on the same 1-row prefix), a batch's decode rows.
   Bitwise-equal share, max |difference|, and how often ``specdec.kernels.sample`` with the same seed and offset
   draws another token; for the C++ ops (``auto``) and the PyTorch bodies (``torch``), shipped and with one GEMM
   path for every layer and row count (``GEMMS``: the skinny kernel in passes of 8 rows, or oneDNN with a packed
   weight), which shows whether the GEMMs are what varies. Then each linear path on its own, and what one path
   for all costs.
3. ``coupled_vs_optimal``: draft chains with the coupled, stochastic (optimal rejection) and deterministic
   (argmax, the fused C++ chain) rules and NoDraft, at T 0.7 and 1.0, fixed depths and adaptive, interleaved:
   tokens/s, ratios, tau, acceptance; and ``coupling_acceptance``: the one-draft acceptance each rule has on the
   models' own distributions along held-out text, the coupled rule as built (the keyed exponential race) beside
   the Gumbel-max coupling's exact value and the inverse-CDF coupling the rule used before.

One intra-op thread; times are thread CPU time (``common.clock``), methods interleaved prompt by prompt, each
(method, prompt) keeping its fastest of ``--repeats`` runs. The CPU path only: with ``TRITON_INTERPRET=1`` the
script refuses to run (Triton's interpreter would stand in for a GPU).

    python bench/bench_seeded.py --quick               # seconds: 2 prompts, a few tokens (tests/test_bench_seeded.py)
    python bench/bench_seeded.py --out OUT             # the full run (about 10 minutes of thread time)
    python bench/bench_seeded.py --parts 1 --reference-seed-shift 1   # the agreement against other seeds: fails
    python bench/bench_seeded.py --parts 1 --batch 1 --fixed-depths   # speculation every step, nothing batched
    python bench/bench_seeded.py --parts 1 --gemms oneDNN             # one GEMM path for every row count
    python bench/bench_seeded.py --parts 1 --row-invariant            # the forward of SPECDEC_ROW_INVARIANT=1
    python bench/bench_seeded.py --parts 3 --ks 4 5                   # chains of 4 and 5
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from common import Table, bench_args, clock, cpu_path_only, positive_int
from e2e_runs import interleaved
from seeded_rows import (
    AGREEMENT_SAMPLING,
    GEMMS,
    SEED_BASE,
    invariance_cost,
    linear_paths,
    path_tree,
    race_agreement,
    row_invariance,
    run_forward,
    target_gemms,
)

from specdec import _backend, use_backend
from specdec.cli.demo import CHAIN, TREE, Run, eagle_row, first_difference, medusa_row
from specdec.decoding import DraftModelStrategy, NgramStrategy, NoDraft, SpeculativeDecoder
from specdec.kernels import SamplingParams, filtered_probs, sample, sample_probs
from specdec.kernels.uniforms import ROLE_TARGET
from specdec.testing import heldout_token_ids, load_pair

RULES = ("coupled", "stochastic", "deterministic")


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


# ----------------------------------------------------------------------------- parts 2 and 3: the texts


def plain_texts(target, prompts: list[list[int]], new_tokens: int, context: int | None) -> list[list[int]]:
    """Each prompt (its last ``context`` tokens, all of it with None) with a seeded T=1 continuation by plain
    decoding, all cut to the shortest length."""
    prompts = [p[-context:] for p in prompts] if context else prompts
    decoder = SpeculativeDecoder(target, NoDraft())
    seeds = [SEED_BASE + i for i in range(len(prompts))]
    out = decoder.generate(prompts, max_new_tokens=new_tokens, temperature=1.0, seed=seeds, eos_token_id=None).tokens
    texts = [p + t for p, t in zip(prompts, out)]
    return [t[: min(map(len, texts))] for t in texts]


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


def coupling_acceptance(target, draft, texts: list[list[int]], verify_from: int, draws: int) -> Table:
    """The probability that one draft token is accepted, per rule, from the target's and the draft's distributions
    at each position of ``texts`` past ``verify_from``, exact in float64 (the Gumbel-max coupling by
    ``race_agreement``), beside the coupled rule as built, measured with ``draws`` keys per position through the
    package's own draws (``sample`` from the target's logits, ``sample_probs`` with ``ROLE_TARGET`` from the
    draft's filtered q), and the inverse-CDF coupling the rule used before."""
    table = Table(
        f"One draft's acceptance probability by rule, the models' distributions along {len(texts)} held-out texts "
        f"(top-k 0, top-p 1): the optimal rule, argmax drafts, the coupled rule as built (the keyed exponential "
        f"race, {draws} keys per position) and its exact value, and the inverse CDF the rule used before",
        ["T", "positions", "optimal rule: 1 - TV", "argmax draft: p(argmax q)", "coupled as built (race)",
         "Gumbel-max coupling, exact", "inverse CDF, vocab order (before)"],
    )  # fmt: skip
    with torch.inference_mode():
        logits = [
            run_forward(model, model.new_cache(len(texts), len(texts[0])), texts).view(len(texts), len(texts[0]), -1)
            for model in (target, draft)
        ]
    target_logits, draft_logits = (x[:, verify_from:].reshape(-1, x.shape[-1]).double() for x in logits)
    rows = target_logits.shape[0]
    for temperature in (0.7, 1.0):
        p, q = (torch.softmax(x / temperature, -1) for x in (target_logits, draft_logits))
        optimal = torch.minimum(p, q).sum(-1)
        argmax = p.gather(-1, q.argmax(-1, keepdim=True)).squeeze(-1)
        start_p, start_q = p.cumsum(-1) - p, q.cumsum(-1) - q
        inverse_cdf = (torch.minimum(start_p + p, start_q + q) - torch.maximum(start_p, start_q)).clamp(min=0).sum(-1)
        built = 0.0
        for k in range(draws):
            params = SamplingParams.make(rows, temperature=temperature, seed=SEED_BASE + k, offset=torch.arange(rows))
            drawn = sample(target_logits.float(), params).tokens
            q_rows = filtered_probs(draft_logits.float(), params).probs
            built += (drawn == sample_probs(q_rows, params, counter=ROLE_TARGET)).double().mean().item()
        table.add(
            temperature, rows, *[f"{x.mean().item():.3f}" for x in (optimal, argmax)], f"{built / draws:.3f}",
            *[f"{x.mean().item():.3f}" for x in (race_agreement(p, q), inverse_cdf)],
        )  # fmt: skip
    return table


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
    coupling_keys: int  # part 3's coupling table: keys per position for the coupled rule as built
    chain_prompts: int
    chain_tokens: int
    ks: tuple[int, ...]
    repeats: int
    budget_s: float  # the GEMM cost table's time per shape


FULL = Sizes(12, 2, 210, 6, 3, None, 96, 4, 64, 6, 96, (4,), 3, 0.5)
QUICK = Sizes(2, 1, 12, 2, 2, 12, 8, 2, 4, 1, 12, (4,), 1, 0.02)


@contextlib.contextmanager
def row_invariant(enabled: bool):
    """The row-invariant forward inside the block where ``enabled`` (else the mode as the environment says)."""
    if enabled:
        _backend.set_row_invariant(True)
    try:
        yield
    finally:
        if enabled:
            _backend.set_row_invariant(None)


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
        parser.add_argument("--row-invariant", action="store_true",
                            help="parts 1 and 3 with the row-invariant forward (set_row_invariant)")  # fmt: skip

    args = bench_args(__doc__.splitlines()[0], extra)
    cpu_path_only(args)
    sizes = QUICK if args.quick else FULL
    repeats = args.repeats or sizes.repeats
    if args.row_invariant and args.gemms != "shipped":
        raise SystemExit("--row-invariant runs its own GEMMs: leave --gemms at 'shipped'")
    note = "" if args.gemms == "shipped" else f", GEMMs: {args.gemms} for every layer and row count"
    note += ", row-invariant forward" if args.row_invariant else ""
    target, draft, tokenizer = load_pair()
    pool = heldout_token_ids(tokenizer)
    now = clock("cpu")
    with use_backend(args.backend):
        if 1 in args.parts:
            start = now()
            with target_gemms(args.gemms), row_invariant(args.row_invariant):
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
            with target_gemms(args.gemms), row_invariant(args.row_invariant):
                coupled_vs_optimal(target, draft, pool[: sizes.chain_prompts], ks=tuple(args.ks or sizes.ks),
                                   new_tokens=sizes.chain_tokens, repeats=repeats, note=note).write(
                    args.out, "seeded_rules")  # fmt: skip
            coupling_acceptance(target, draft, texts, verify_from, sizes.coupling_keys).write(
                args.out, "seeded_coupling_acceptance"
            )
            print(f"\n(part 3: {now() - start:.0f} s thread time)")


if __name__ == "__main__":
    main()
