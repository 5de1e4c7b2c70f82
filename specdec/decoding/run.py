"""One engine's state and its steps (the loop itself is described in ``specdec.decoding.engine``): the caches, the
batch slots and the texts of the requests in them; per step, for the running requests propose -> one target forward
(with the joining requests' prompts, ``specdec.decoding.joining``) -> verify -> commit, then the step's one
read-back -> emit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec._transfer import offsets_to_device, read_back, to_device
from specdec.decoding.adaptive import AdaptiveSpeculation
from specdec.decoding.joining import Joining, PromptOutputs, merged_inputs, merged_rows, prompt_forward, split_outputs
from specdec.decoding.proposal import Proposal, check_proposal, device_tree_metadata, tree_metadata_on
from specdec.decoding.requests import Request
from specdec.decoding.results import RequestStats, StepOutput
from specdec.decoding.schedule import CacheSpec, SharedPool
from specdec.decoding.strategy import Prefill, StepContext, StepResult, Strategy, StrategyHooks
from specdec.decoding.verification import verify
from specdec.kernels import TreeVerifyResult
from specdec.kernels.sampling_params import SamplingParams
from specdec.model.attention_metadata import AttentionMetadata, causal_positions, tree_positions


@dataclass(frozen=True)
class Verified:
    """One verified batch of trees in a step, read back with the step's other one (the joining requests' first
    tokens, and the running requests' trees). Per-tree lists follow ``slots``.

    slots          the slots whose trees were verified
    result         verification's output, ``[R, ...]`` device tensors
    counts, depths each tree's nodes (root included) and depth (a bound for trees shaped on the device)
    hidden         [N, H] device: the target's features of the verified nodes (``Strategy``'s contract, item 4)
    node_offsets   [R+1] int32 device: tree r's rows of ``hidden``
    prefill        the joining requests' ``Prefill`` (their part only), which the strategy gets before its commit
    """

    slots: list[int]
    result: TreeVerifyResult
    counts: list[int]
    depths: list[int]
    hidden: torch.Tensor
    node_offsets: torch.Tensor
    prefill: Prefill | None = None

    def packed(self) -> torch.Tensor:
        """``[R * (W + 2)]`` int32: per tree its emitted tokens (``W`` columns, -1 padded), accepted count and
        invalid flag, flattened so one read-back carries every part of the step."""
        r = self.result
        return torch.cat((r.output_tokens, r.num_accepted[:, None], r.invalid[:, None].int()), dim=1).flatten()

    @property
    def width(self) -> int:
        """Read-back values per tree: its emitted-token columns, accepted count and invalid flag."""
        return self.result.output_tokens.shape[1] + 2

    def rows(self, flat: list[int], start: int) -> list[list[int]]:
        """This part's per-tree rows of the step's read-back ``flat``, where they begin at ``start``."""
        width = self.width
        return [flat[start + i * width : start + (i + 1) * width] for i in range(len(self.slots))]


class DecodeRun:
    """The state of one engine: ``batch_size`` slots of up to ``max_len`` cached tokens each, and its steps.

    It speaks slots (0 .. batch_size - 1); ``specdec.decoding.engine.Engine`` maps request ids to them and decides
    who joins. A slot holds a running request, a paused one (bounded paged pool) or nothing. ``stats[b]``: the
    ``RequestStats`` of slot b's request, updated as the run goes; ``adaptive``: the controller choosing draft
    depths, or None.
    """

    def __init__(self, target, strategy: Strategy, hooks: StrategyHooks, *, batch_size: int, max_len: int,
                 cache_spec: CacheSpec, adaptive: AdaptiveSpeculation | None):  # fmt: skip
        self.target, self.strategy, self.hooks = target, strategy, hooks
        self.feature_layers = getattr(strategy, "feature_layers", None)  # the features the strategy reads
        self.batch_size, self.max_len, self.cache_spec = batch_size, max_len, cache_spec
        self.device = self.target.device
        pool = {} if cache_spec.num_blocks is None else {"num_blocks": cache_spec.num_blocks}
        self.cache = self.target.new_cache(batch_size, max_len, **cache_spec.options, **pool)
        self.pool = None if self.cache.pages is None else SharedPool(self.target, self.cache, self.strategy.max_nodes)
        self.slots: list[Request | None] = [None] * batch_size
        self.stats: list[RequestStats | None] = [None] * batch_size
        self.texts: list[list[int]] = [[] for _ in range(batch_size)]  # prompt + generated, per slot
        self.generated = [0] * batch_size
        self.running: list[int] = []  # slots that run the next step, ascending
        self.budgets: list[int] = []  # nodes each running request's next tree may have (``_schedule``)
        self.started = False  # the strategy's ``prefill`` ran: its per-slot state exists
        self._params: SamplingParams | None = None  # [B] per slot; sent again when requests join
        self._rows: tuple[list[int], torch.Tensor, SamplingParams] | None = None  # see _running
        self.adaptive = adaptive
        self._contexts: list[int] = []  # the adaptive controller's: cached tokens per running request this step
        if self.adaptive is not None:
            self.adaptive.start()

    # ---- who may join ---------------------------------------------------------------------------

    def occupied(self) -> bool:
        """Some slot holds a request (running or paused)."""
        return any(s is not None for s in self.slots)

    def free_slots(self) -> list[int]:
        return [b for b, s in enumerate(self.slots) if s is None]

    def admits(self, prompts: list[list[int]]) -> bool:
        """The target's cache can take these prompts now, beside the running requests' next roots: always, but
        for a bounded paged pool (whose paused requests resume first)."""
        if self.cache_spec.num_blocks is None:
            return True
        pages = self.cache.pages
        if self.pool.paused:
            return False
        roots = sum(pages.short(b, len(self.texts[b])) for b in self.running)  # blocks the running roots need
        wanted = sum(pages.needed(len(p) + 1) for p in prompts)
        return roots + wanted <= pages.num_free

    # ---- a step --------------------------------------------------------------------------------------

    def step(self, joining: list[tuple[int, Request, RequestStats]] = ()) -> StepOutput:
        """One step: the joining requests' (slot, request, stats) prefill and first token, the running requests'
        trees; one read-back for both. Returns slots in ``StepOutput`` (the engine maps them to request ids)."""
        if self.target.feature_layers != self.feature_layers:  # another decoder on this target read other features
            self.target.output_layer_features(self.feature_layers)
        admitted = self._admit(joining) if joining else None
        ended = self._schedule()
        if self.running:
            decoded, joined = self._decode(admitted)
        else:
            decoded, joined = None, self._prefill(admitted) if admitted else None
        parts = [part for part in (decoded, joined) if part is not None]
        if not parts:  # every request left ended with 'cache'
            self._leave(list(ended))
            return StepOutput((), (), ended)
        packed = [part.packed() for part in parts]
        flat = read_back(packed[0] if len(packed) == 1 else torch.cat(packed))  # HOST SYNC: the step's one read-back
        rows, start = [], 0
        for part in parts:
            rows.append(part.rows(flat, start))
            start += part.width * len(part.slots)
        output = self._emit(parts, rows, ended)
        lengths = [len(t) - 1 if t else 0 for t in self.texts]
        for part, part_rows in zip(parts, rows):
            if part.prefill is not None:  # after the running trees' commit: a strategy's caches have no step open
                self._attach(part.prefill)
            self.strategy.commit(
                StepResult(
                    running=part.slots,
                    lengths=lengths,
                    finished=list(output.finished),
                    accepted=[row[-2] for row in part_rows],
                    accepted_path=part.result.accepted_path,
                    hidden=part.hidden,
                    node_offsets=part.node_offsets,
                )
            )
        self._leave(list(output.finished))
        if decoded is not None and self.adaptive is not None:
            accepted = [None if row[-1] else row[-2] for row in rows[0]]
            if admitted is not None:  # the step also ran prompts: no sample of what its trees cost
                self.adaptive.untimed()
            self.adaptive.observe(decoded.slots, decoded.counts, decoded.depths, accepted, self._contexts)
        return output

    def abort(self, slot: int) -> None:
        """End slot ``slot``'s request between steps: its blocks and the strategy's state for it are freed."""
        self.running = [b for b in self.running if b != slot]
        if self.pool is not None and slot in self.pool.paused:
            self.pool.paused.remove(slot)
        self.cache.release([slot])
        self._leave([slot])

    def _admit(self, joining: list[tuple[int, Request, RequestStats]]) -> Joining:
        """The joining requests take their slots; their prompts' blocks are reserved before the schedule plans the
        running requests' step around them."""
        for b, request, stats in joining:
            self.slots[b], self.stats[b] = request, stats
            self.texts[b], self.generated[b] = list(request.prompt), 0
        self._params = None  # the new slots' sampling parameters go up with the next selection
        slots = [b for b, _, _ in joining]
        prompts = {b: list(request.prompt) for b, request, _ in joining}  # copies: the texts grow before ``_attach``
        admitted = Joining(slots, [prompts.get(b, []) for b in range(self.batch_size)])
        self.cache.reserve(admitted.counts)
        if self.adaptive is not None:
            self.adaptive.forget(slots)
        return admitted

    def _prefill(self, joining: Joining, prompts: PromptOutputs | None = None) -> Verified:
        """Verify each joining prompt's last token as a one-node tree, which samples the first token; ``prompts``: the
        merged forward's outputs for them, else they run a forward of their own first."""
        if prompts is None:
            prompts = prompt_forward(self.target, self.cache, joining)
        slots = joining.slots
        roots = Proposal(prompts.last_tokens, [[-1]] * len(slots), rule="deterministic")
        node_offsets = offsets_to_device([1] * len(slots), self.device)
        params = self._slot_params().select(to_device(slots, torch.int64, self.device))  # offset 0: nothing generated
        greedy = all(self.slots[b].temperature <= 0 for b in slots)
        result = verify(prompts.logits, roots, node_offsets, params, greedy=greedy)
        prefill = Prefill(joining.prompts, self.max_len, self.cache_spec.options, prompts.hidden, prompts.q_offsets)
        return Verified(slots, result, [1] * len(slots), [0] * len(slots), prompts.last_hidden, node_offsets, prefill)

    def _attach(self, prefill: Prefill) -> None:
        """The strategy sets the joined requests' state up from their prompts' features."""
        if self.started and self.hooks.join is not None:
            self.hooks.join(prefill)
        else:  # the first requests (or, for a strategy served whole batches, a new batch): state for every slot
            self.strategy.prefill(prefill)
            self.started = True

    def _decode(self, joining: Joining | None) -> tuple[Verified, Verified | None]:
        """The running requests' trees: propose, one target forward over every node, verify, commit in the cache;
        the joining requests' prompts ride in that forward when every tree is a chain, else run first on their own.
        Returns the trees' part and the joining requests' part (or None)."""
        context = self._context()
        self.hooks.prepare(context)  # work owed from earlier steps: not this step's cost
        if self.adaptive is not None:
            self.adaptive.restart_clock()
        proposal = self.strategy.propose(context)
        check_proposal(proposal, self.strategy.name, len(self.running), context.max_nodes, context.max_depth)
        # Chains (plain decoding, draft chains, n-gram) need no mask: causal attention is the same thing.
        chains = proposal.on_host and all(tree == list(range(-1, len(tree) - 1)) for tree in proposal.parents)
        # One target forward over every node of every running request, and in a step of chains the joining prompts.
        joined = merged = logits_rows = None
        tokens, counts = proposal.tokens, context.full_counts(proposal.counts)
        if joining is not None and chains:
            merged = merged_rows(self.running, proposal.counts, joining)
            (tokens, logits_rows), counts = merged_inputs(merged, tokens, joining), merged.counts
        elif joining is not None:  # the tree mask covers the trees only: the prompts run a forward of their own
            joined = self._prefill(joining, prompt_forward(self.target, self.cache, joining, keep_hidden=True))
        q_offsets = offsets_to_device(counts, self.device)
        self.cache.reserve(counts)
        num_nodes = sum(counts)
        all_running = len(self.running) == self.batch_size  # then the trees' offsets are the forward's
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
        logits, hidden = self.target(tokens, positions, metadata, self.cache, logits_rows=logits_rows)
        if merged is not None:
            (logits, hidden), prompts = split_outputs(merged, tokens, logits_rows, logits, hidden, joining)
            joined = self._prefill(joining, prompts)
        greedy = all(self.slots[b].temperature <= 0 for b in self.running)
        result = verify(logits, proposal, node_offsets, context.params, greedy=greedy, chains=chains)
        self._commit_accepted(result, chains, None if merged is None else joining.counts)
        return Verified(list(self.running), result, proposal.counts, proposal.depths, hidden, node_offsets), joined

    def _schedule(self) -> dict[int, str]:
        """Fit the step in the target's cache (pausing, resuming, tree budgets); the requests ended 'cache'."""
        if self.pool is None:
            self.budgets = [self.strategy.max_nodes] * len(self.running)
            return {}
        plan = self.pool.plan(self.running, self.texts, self.stats)
        self.running, self.budgets = plan.running, plan.max_nodes
        return {b: "cache" for b in plan.out_of_cache}

    # ---- verification and bookkeeping --------------------------------------------------------------

    def _commit_accepted(self, result: TreeVerifyResult, chains: bool, prompts: list[int] | None = None) -> None:
        """Commit each running request's accepted nodes in the target's cache: for ``chains`` (every tree a chain, a
        host fact) the accepted rows are in place and the lengths advance, else the accepted nodes' K/V move next to
        the prefix. Other slots stay as they are, but for ``prompts``: rows per slot of joining prompts a chains
        step's forward wrote, which become their prefix."""
        every = len(self.running) == self.batch_size
        if chains:  # the accepted nodes are the first num_accepted + 1 rows already: advance
            counts = result.num_accepted + 1
            if not every:
                if prompts is None:
                    base = torch.zeros(self.batch_size, dtype=torch.int32, device=self.device)
                else:
                    base = to_device(prompts, torch.int32, self.device)
                counts = base.index_copy_(0, self._running()[0], counts)
            self.cache.advance(counts)
            return
        path = result.accepted_path
        if not every:
            path = torch.full((self.batch_size, path.shape[1]), -1, dtype=torch.int32, device=self.device)
            path.index_copy_(0, self._running()[0], result.accepted_path)
        self.cache.compact(path, check=False)

    def _emit(self, parts: list[Verified], rows: list[list[list[int]]], ended: dict[int, str]) -> StepOutput:
        """Append each verified request's tokens, update its stats, retire finished requests.

        ``rows``: per part, per tree, the read-back row; ``ended``: requests the step's schedule already ended
        ('cache'). Trees shaped on the device count their depth bound as drafted in ``drafted_at``."""
        requests, tokens, finished = [], [], dict(ended)
        for part, part_rows in zip(parts, rows):
            for b, row, nodes, depth in zip(part.slots, part_rows, part.counts, part.depths):
                accepted, bad = row[-2], bool(row[-1])
                stats, limit, eos = self.stats[b], self.slots[b].max_new_tokens, self.slots[b].eos
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
                    if t in eos:
                        finished[b] = "eos"
                        break
                    if self.generated[b] >= limit:
                        finished[b] = "length"
                        break
                stats.generated = self.generated[b]
                requests.append(b)
                tokens.append(tuple(out))
        for b, why in finished.items():
            self.stats[b].finish_reason = why
        self.running = sorted(b for part in parts for b in part.slots if b not in finished)
        if finished:
            self.cache.release(list(finished))
        # The host knows every committed length exactly: bounds tighten, pages free, no device read.
        running = set(self.running)
        self.cache.known_lengths([len(t) - 1 if b in running else 0 for b, t in enumerate(self.texts)])
        return StepOutput(tuple(requests), tuple(tokens), finished)

    def _leave(self, slots: list[int]) -> None:
        """The requests in ``slots`` ended: the strategy frees their state, the slots become free."""
        if not slots:
            return
        self.hooks.leave(slots)
        for b in slots:
            self.slots[b], self.stats[b], self.texts[b], self.generated[b] = None, None, [], 0

    def _context(self) -> StepContext:
        running, strategy = self.running, self.strategy
        left = [self.slots[b].max_new_tokens - self.generated[b] - 1 for b in running]  # tokens a tree may draft
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
            batch_size=self.batch_size,
            roots=[self.texts[b][-1] for b in running],
            previous=[self.texts[b][-2] for b in running],
            histories=[self.texts[b] for b in running],
            max_depth=max_depth,
            max_nodes=[min(n, budget) for n, budget in zip(max_nodes, self.budgets)],  # within the pool
            params=self._running_params(),
            greedy=all(self.slots[b].temperature <= 0 for b in running),
            device=self.device,
        )

    def _slot_params(self) -> SamplingParams:
        """Every slot's sampling parameters, ``[B]`` device tensors (free slots: greedy), offset 0; sent again
        after requests joined."""
        if self._params is None:
            idle = Request([], 0, 0.0, 0, 1.0, 0, frozenset())
            requests = [idle if s is None else s for s in self.slots]
            self._params = SamplingParams(
                to_device([r.temperature for r in requests], torch.float32, self.device),
                to_device([r.top_k for r in requests], torch.int32, self.device),
                to_device([r.top_p for r in requests], torch.float32, self.device),
                to_device([r.seed for r in requests], torch.int64, self.device),
                to_device([0] * self.batch_size, torch.int64, self.device),
            )
            self._rows = None
        return self._params

    def _running(self) -> tuple[torch.Tensor, SamplingParams]:
        """int64 ``[R]`` device indices of the running requests and their sampling parameters' rows,
        sent again only when the running set changes (a request finished or joined)."""
        params = self._slot_params()
        if self._rows is None or self._rows[0] != self.running:
            rows = to_device(self.running, torch.int64, self.device)
            self._rows = (list(self.running), rows, params.select(rows))
        return self._rows[1], self._rows[2]

    def _running_params(self) -> SamplingParams:
        """The running requests' sampling parameters; offset = tokens generated so far (sent each step)."""
        offset = to_device([self.generated[b] for b in self.running], torch.int64, self.device)
        return self._running()[1]._replace(offset=offset)


def _uniform(counts: list[int]) -> int | None:
    """The rows every request sends when they all send the same number (a host fact the ops use), else None."""
    return counts[0] if len(set(counts)) == 1 else None
