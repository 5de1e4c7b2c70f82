"""One ``SpeculativeDecoder.stream`` call's state and its steps (the loop itself is described in
``specdec.decoding.engine``): the caches, the texts, who is still running; the prefill, then per step
propose -> one target forward -> verify -> commit -> the one read-back -> emit.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass

import torch

from specdec._transfer import offsets_to_device, read_back, to_device
from specdec.decoding.adaptive import AdaptiveSpeculation
from specdec.decoding.proposal import Proposal, check_proposal, device_tree_metadata, tree_metadata_on
from specdec.decoding.requests import Requests
from specdec.decoding.results import RequestStats, StepOutput
from specdec.decoding.schedule import SharedPool
from specdec.decoding.strategy import Prefill, StepContext, StepResult, Strategy, StrategyHooks
from specdec.decoding.verification import verify
from specdec.kernels import TreeVerifyResult
from specdec.kernels.sampling_params import SamplingParams
from specdec.model.attention_metadata import AttentionMetadata, causal_positions, tree_positions


@dataclass(frozen=True)
class CacheSpec:
    """The target KV cache a ``stream`` call allocates: its layout ("contiguous" or "paged"), page size, and for a
    paged cache the pool in blocks (None: the worst case)."""

    layout: str = "contiguous"
    block_size: int = 16
    num_blocks: int | None = None

    @property
    def options(self) -> dict:
        """``new_cache``'s ``layout=`` / ``block_size=`` (what ``Prefill.cache_options`` hands a drafter)."""
        return {"layout": self.layout, "block_size": self.block_size}


class CommitMode(enum.Enum):
    """How a verified step's accepted nodes become the prefix in the target's cache."""

    PREFILL = "prefill"  # nothing to do: the prefill's ``advance`` already committed its prompts
    CHAINS = "chains"  # every tree a chain (a host fact): the accepted rows are in place, the lengths advance
    TREES = "trees"  # the accepted nodes' K/V move next to the prefix


class DecodeRun:
    """State of one ``stream`` call: the caches, the texts, who is still running.

    ``stats``: one ``RequestStats`` per request, updated as the run goes; ``adaptive``: the controller choosing
    draft depths, or None.
    """

    def __init__(self, target, strategy: Strategy, hooks: StrategyHooks, req: Requests, running: list[int], *,
                 cache_spec: CacheSpec, stats: list[RequestStats], adaptive: AdaptiveSpeculation | None):  # fmt: skip
        self.req, self.running = req, running
        self.target, self.strategy, self.hooks, self.stats = target, strategy, hooks, stats
        self.cache_spec = cache_spec
        self.device = self.target.device
        # The last step starts with prompt + max_new - 2 tokens cached and writes one tree after them.
        widest = self.strategy.max_nodes
        self.max_len = max(len(p) + max(m - 2, 0) + widest for p, m in zip(req.prompts, req.max_new_tokens))
        pool = {} if cache_spec.num_blocks is None else {"num_blocks": cache_spec.num_blocks}
        self.cache = self.target.new_cache(req.batch_size, self.max_len, **cache_spec.options, **pool)
        self.pool = None if self.cache.pages is None else SharedPool(self.target, self.cache, self.strategy.max_nodes)
        self.budgets: list[int] = []  # nodes each running request's next tree may have (``_schedule``)
        self.params = req.sampling_params(self.device)  # [B]; each step selects the running rows
        self._rows: tuple[list[int], torch.Tensor, SamplingParams] | None = None  # see _running
        self.texts = [list(p) for p in req.prompts]
        self.generated = [0] * req.batch_size
        self.adaptive = adaptive
        self._contexts: list[int] = []  # the adaptive controller's: cached tokens per running request this step
        if self.adaptive is not None:
            self.adaptive.start()

    def prefill(self) -> StepOutput:
        """One ragged causal forward over the prompts; verify each last prompt token as a one-node tree."""
        req, running = self.req, self.running
        active = set(running)
        prompts = [p if b in active else [] for b, p in enumerate(req.prompts)]
        counts = [len(p) for p in prompts]
        tokens = to_device([t for p in prompts for t in p], torch.int64, self.device)
        q_offsets = offsets_to_device(counts, self.device)
        self.cache.reserve(counts)
        positions = causal_positions(q_offsets, self.cache.seq_lens, tokens.numel())
        ends = list(itertools.accumulate(counts))
        last_rows = to_device([ends[b] - 1 for b in running], torch.int64, self.device)
        logits, hidden = self.target(tokens, positions, AttentionMetadata(q_offsets), self.cache, logits_rows=last_rows)
        self.cache.advance(counts)
        self.strategy.prefill(Prefill(prompts, self.max_len, self.cache_spec.options, hidden, q_offsets))
        roots = Proposal(tokens.index_select(0, last_rows), [[-1]] * len(running), rule="deterministic")
        last_hidden = hidden.index_select(0, last_rows)
        node_offsets = offsets_to_device([1] * len(running), self.device)
        params = self._running_params()
        return self._verify_and_emit(logits, last_hidden, roots, node_offsets, params, commit=CommitMode.PREFILL)

    def step(self) -> StepOutput:
        ended = self._schedule()
        if not self.running:  # every request left ended with 'cache'
            return StepOutput((), (), ended)
        context = self._context()
        self.hooks.prepare(context)  # work owed from earlier steps: not this step's cost
        if self.adaptive is not None:
            self.adaptive.restart_clock()
        proposal = self.strategy.propose(context)
        check_proposal(proposal, self.strategy.name, len(self.running), context.max_nodes, context.max_depth)
        # One target forward over every node of every running request.
        counts = context.full_counts(proposal.counts)
        q_offsets = offsets_to_device(counts, self.device)
        self.cache.reserve(counts)
        num_nodes = sum(counts)
        # Chains (plain decoding, draft chains, n-gram) need no mask: causal attention is the same thing.
        chains = proposal.on_host and all(tree == list(range(-1, len(tree) - 1)) for tree in proposal.parents)
        all_running = len(self.running) == self.req.batch_size  # then the trees' offsets are the forward's
        node_offsets = q_offsets if all_running else offsets_to_device(proposal.counts, self.device)
        if chains:
            positions = causal_positions(q_offsets, self.cache.seq_lens, num_nodes, per_request=_uniform(counts))
            metadata = AttentionMetadata(q_offsets)
        else:
            if proposal.on_host:
                depth, mask = tree_metadata_on(proposal.parents, self.device)
            else:  # shapes chosen on the device (EAGLE-2): the mask is built there
                depth, mask = device_tree_metadata(proposal.parents, node_offsets)
            positions = tree_positions(q_offsets, self.cache.seq_lens, depth)
            metadata = AttentionMetadata(q_offsets, mask)
        logits, hidden = self.target(proposal.tokens, positions, metadata, self.cache)
        commit = CommitMode.CHAINS if chains else CommitMode.TREES
        return self._verify_and_emit(logits, hidden, proposal, node_offsets, context.params, commit=commit, ended=ended)

    def _schedule(self) -> dict[int, str]:
        """Fit the step in the target's cache (pausing, resuming, tree budgets); the requests ended 'cache'."""
        if self.pool is None:
            self.budgets = [self.strategy.max_nodes] * len(self.running)
            return {}
        plan = self.pool.plan(self.running, self.texts, self.stats)
        self.running, self.budgets = plan.running, plan.max_nodes
        return {b: "cache" for b in plan.out_of_cache}

    # ---- verification and bookkeeping --------------------------------------------------------------

    def _verify_and_emit(self, logits, hidden, proposal: Proposal, node_offsets, params, *, commit, ended=None):
        """Verify the running requests' trees, commit the accepted K/V, read back, emit, tell the strategy.

        ``commit``: how the accepted nodes become the prefix (``CommitMode``). ``ended``: requests that
        finished before the step ran (out of cache), reported with this step's finished ones.
        """
        greedy = all(self.req.temperature[b] <= 0 for b in self.running)
        chains = commit is CommitMode.CHAINS
        result = verify(logits, proposal, node_offsets, params, greedy=greedy, chains=chains)
        if commit is not CommitMode.PREFILL:
            self._commit_accepted(result, chains=chains)
        packed = torch.cat((result.output_tokens, result.num_accepted[:, None], result.invalid[:, None].int()), dim=1)
        rows = read_back(packed)  # HOST SYNC: the step's one read-back, to stream and decide termination
        running = self.running
        output = self._emit(rows, proposal.counts, proposal.depths, ended or {})
        self.strategy.commit(
            StepResult(
                running=running,
                lengths=[len(t) - 1 for t in self.texts],
                finished=list(output.finished),
                accepted=[row[-2] for row in rows],
                accepted_path=result.accepted_path,
                hidden=hidden,
                node_offsets=node_offsets,
            )
        )
        if commit is not CommitMode.PREFILL and self.adaptive is not None:
            accepted = [None if row[-1] else row[-2] for row in rows]
            self.adaptive.observe(running, proposal.counts, proposal.depths, accepted, self._contexts)
        return output

    def _commit_accepted(self, result: TreeVerifyResult, *, chains: bool) -> None:
        """Commit each running request's accepted nodes in the target's cache (finished slots stay as they are)."""
        every = len(self.running) == self.req.batch_size
        if chains:  # the accepted nodes are the first num_accepted + 1 rows already: advance
            counts = result.num_accepted + 1
            if not every:
                counts = torch.zeros(self.req.batch_size, dtype=torch.int32, device=self.device).index_copy_(
                    0, self._running()[0], counts
                )
            self.cache.advance(counts)
            return
        path = result.accepted_path
        if not every:
            path = torch.full((self.req.batch_size, path.shape[1]), -1, dtype=torch.int32, device=self.device)
            path.index_copy_(0, self._running()[0], result.accepted_path)
        self.cache.compact(path, check=False)

    def _emit(
        self, rows: list[list[int]], counts: list[int], tree_depths: list[int], ended: dict[int, str]
    ) -> StepOutput:
        """Append each running request's tokens, update its stats, retire finished requests.

        ``counts``, ``tree_depths``: each tree's nodes and depth (a bound for trees shaped on the device,
        whose deepest drafted level then counts as drafted in ``drafted_at``); ``ended``: requests the
        step's schedule already ended ('cache')."""
        requests, tokens, finished = [], [], dict(ended)
        for b, row, nodes, depth in zip(self.running, rows, counts, tree_depths):
            accepted, bad = row[-2], bool(row[-1])
            stats = self.stats[b]
            stats.target_forwards += 1
            if bad:
                finished[b] = "invalid"
                continue
            stats.count_tree(nodes - 1, depth, accepted)
            out = []
            for t in row[: accepted + 1]:
                out.append(t)
                self.texts[b].append(t)
                self.generated[b] += 1
                if t in self.req.eos:
                    finished[b] = "eos"
                    break
                if self.generated[b] >= self.req.max_new_tokens[b]:
                    finished[b] = "length"
                    break
            stats.generated = self.generated[b]
            requests.append(b)
            tokens.append(tuple(out))
        for b, why in finished.items():
            self.stats[b].finish_reason = why
        self.running = [b for b in self.running if b not in finished]
        if finished:
            self.cache.release(list(finished))
        # The host knows every committed length exactly: bounds tighten, pages free, no device read.
        self.cache.known_lengths([len(t) - 1 if b in self.running else 0 for b, t in enumerate(self.texts)])
        return StepOutput(tuple(requests), tuple(tokens), finished)

    def _context(self) -> StepContext:
        running, strategy = self.running, self.strategy
        left = [self.req.max_new_tokens[b] - self.generated[b] - 1 for b in running]  # tokens a tree may draft
        if self.adaptive is None:
            max_depth, max_nodes = left, [strategy.max_nodes] * len(running)
            chosen = [max(0, min(d, strategy.max_depth)) for d in left]
        else:
            self._contexts = [len(self.texts[b]) - 1 for b in running]  # tokens the target has cached
            max_depth = chosen = self.adaptive.choose(running, left, self._contexts)
            max_nodes = [strategy.max_nodes if d > 0 else 1 for d in chosen]
        for b, d in zip(running, chosen):
            self.stats[b].chosen_depths.append(d)
        return StepContext(
            running=running,
            batch_size=self.req.batch_size,
            roots=[self.texts[b][-1] for b in running],
            previous=[self.texts[b][-2] for b in running],
            histories=[self.texts[b] for b in running],
            max_depth=max_depth,
            max_nodes=[min(n, budget) for n, budget in zip(max_nodes, self.budgets)],  # within the pool
            params=self._running_params(),
            greedy=all(self.req.temperature[b] <= 0 for b in running),
            device=self.device,
        )

    def _running(self) -> tuple[torch.Tensor, SamplingParams]:
        """int64 ``[R]`` device indices of the running requests and their sampling parameters' rows,
        sent again only when the running set changes (a request finished)."""
        if self._rows is None or self._rows[0] != self.running:
            rows = to_device(self.running, torch.int64, self.device)
            self._rows = (list(self.running), rows, self.params.select(rows))
        return self._rows[1], self._rows[2]

    def _running_params(self) -> SamplingParams:
        """The running requests' sampling parameters; offset = tokens generated so far (sent each step)."""
        offset = to_device([self.generated[b] for b in self.running], torch.int64, self.device)
        return self._running()[1]._replace(offset=offset)


def _uniform(counts: list[int]) -> int | None:
    """The rows every request sends when they all send the same number (a host fact the ops use), else None."""
    return counts[0] if len(set(counts)) == 1 else None
