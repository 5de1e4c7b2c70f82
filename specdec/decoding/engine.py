"""The speculative decoding loop: propose -> one target forward -> verify -> compact -> emit.

One loop serves every strategy (``specdec.decoding.strategy``): each proposes one token
tree per running request; ``NoDraft`` proposes one-node trees, which makes the loop plain
autoregressive decoding (verification then just samples the next token).

Each step:
  1. ``strategy.propose`` -> token trees (root = the last emitted token), checked against the
     per-request limits -- by default chosen per request by the adaptive controller
     (``specdec.decoding.adaptive``: 0 = plain decoding), which reads the host clock here and after
     the read-back;
  2. one target forward over every node of every running request, the tree mask built from
     the host-known tree shapes and copied without waiting;
  3. ``verify``: accepted path, emitted tokens, invalid rows -- the argmax-only greedy path
     when every running request has temperature 0 (a host fact), else exact sampling with
     per-request ``SamplingParams``; op bodies called directly (the trees were checked on the host);
  4. ``KVCache.compact``: the accepted nodes' K/V move next to the prefix;
  5. the step's one host synchronisation (``_transfer.read_back``, marked ``HOST SYNC`` below):
     emitted tokens and counts come back to stream them and to decide who finishes; everything
     sent to the device goes through ``specdec._transfer.to_device`` (pinned, non-blocking);
  6. ``strategy.commit`` with what was accepted.

Nothing else in a step reads a device value: the forward's plan, the cache's capacity and
every size come from host data (tested by counting, on the CPU, every operation that would
synchronise on a GPU), and the same code runs on both.

A bounded paged target cache (``num_blocks``) is shared on demand, each step planned first:
``specdec.decoding.schedule`` (trees shrink, requests pause and resume, nothing generated is lost).

The prefill is the same with the whole prompts as causal rows, and each request's last prompt
token as a one-node tree whose verification samples the first token.

Random numbers: verification uses ``(seed, offset = tokens generated so far)``; a
request's tokens therefore depend on its own seed only, not on the batch -- with fixed sizes
(``adaptive=False``). The adaptive controller's depths depend on measured times, and sampled
tokens on the depths: still exactly distributed, no longer reproducible token for token.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

import torch

from specdec._transfer import offsets_to_device, read_back, to_device
from specdec.decoding.adaptive import AdaptiveSpeculation
from specdec.decoding.proposal import Proposal, check_proposal, device_tree_metadata, tree_metadata_on
from specdec.decoding.requests import DEFAULT_EOS, Requests, encode_prompts, make_requests
from specdec.decoding.results import GenerationResult, RequestStats, StepOutput
from specdec.decoding.schedule import SharedPool, check_pool
from specdec.decoding.strategy import NoDraft, Prefill, StepContext, StepResult, Strategy
from specdec.decoding.verification import verify
from specdec.kernels import TreeVerifyResult
from specdec.kernels.sampling_params import SamplingParams
from specdec.model.attention_metadata import AttentionMetadata, causal_positions, tree_positions
from specdec.validation import InsufficientMemoryError, as_int


class SpeculativeDecoder:
    """Batched speculative (or, with ``strategy=None``, plain) decoding with a target model.

    Parameters
    ----------
    target : a ``LlamaModel``.
    strategy : a ``Strategy`` (``DraftModelStrategy``, ``NgramStrategy``, ...); None means ``NoDraft()``.
    cache_layout, block_size : the KV caches' layout ("contiguous" or "paged") and page size.
    num_blocks : paged only: the target cache's pool in blocks, shared on demand (``specdec.decoding.schedule``:
        trees shrink, requests pause and resume, one that can never fit ends 'cache'); it must hold every
        prompt plus one token at once. None: the worst case (a draft model's cache always takes that).
    compile : run the target's (and a ``DraftModelStrategy``'s draft's) planned forwards through
        ``torch.compile(fullgraph=True)`` (``LlamaModel.compile_run``; the models are changed in place).
        Opt-in: the first steps pay the compilation.
    adaptive : True (the default): choose each request's draft depth every step (0 = plain decoding) from
        measured step times and acceptance (``specdec.decoding.adaptive``); an ``AdaptiveSpeculation`` to
        set its options; False: always the strategy's own sizes (within the tokens left).
        ``RequestStats.chosen_depths`` shows the depths allowed per step either way.
    graphs : replay the target's (and a draft's) CUDA forwards of up to 512 rows from CUDA graphs
        (``LlamaModel.use_cuda_graphs``; models changed in place): one replay per forward, captured on
        first use per row bucket. CUDA only. Opt-in: each stream captures its buckets again (a new
        cache), which costs a little on short generations, and it is not yet the default while the
        GPU check that compares replays with eager forwards on real hardware is owed.

    Example
    -------
    >>> from specdec.decoding import NgramStrategy
    >>> from specdec.model import LlamaModel, ModelConfig
    >>> config = ModelConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=1,
    ...                      num_heads=2, num_kv_heads=1, head_dim=16)
    >>> target = LlamaModel(config).requires_grad_(False)         # random weights
    >>> decoder = SpeculativeDecoder(target, NgramStrategy(num_draft=3))
    >>> result = decoder.generate([[1, 2, 3, 1, 2]], max_new_tokens=10)
    >>> len(result.tokens[0]), result.stats[0].generated, result.stats[0].tau >= 1
    (10, 10, True)
    """

    def __init__(
        self,
        target,
        strategy: Strategy | None = None,
        *,
        cache_layout: str = "contiguous",
        block_size: int = 16,
        num_blocks: int | None = None,
        compile: bool = False,
        graphs: bool = False,
        adaptive: bool | AdaptiveSpeculation = True,
    ):
        strategy = NoDraft() if strategy is None else strategy
        if not isinstance(strategy, Strategy):
            raise TypeError(
                f"strategy must implement the Strategy protocol (name, max_nodes, max_depth, attach, prefill, "
                f"propose, commit; see specdec.decoding.strategy), got {type(strategy).__name__}"
            )
        if not isinstance(strategy.max_nodes, int) or strategy.max_nodes < 1:
            raise ValueError(f"strategy.max_nodes must be an int >= 1, got {strategy.max_nodes!r}")
        if not isinstance(adaptive, (bool, AdaptiveSpeculation)):
            raise TypeError(f"adaptive must be a bool or an AdaptiveSpeculation, got {type(adaptive).__name__}")
        strategy.attach(target)
        self.target, self.strategy = target, strategy
        # A strategy that never drafts has nothing to adapt.
        if adaptive is True:
            adaptive = AdaptiveSpeculation()
        self.adaptive = adaptive if adaptive and strategy.max_depth > 0 else None
        if self.adaptive is not None:
            self.adaptive.bind(strategy.max_depth, strategy.max_nodes, getattr(strategy, "draft_nodes", None))
        models = [m for m in (target, getattr(strategy, "draft", None)) if m is not None]
        if compile:
            for model in models:
                if model._compiled_run is None:
                    model.compile_run()
        if graphs:
            for model in models:
                if model.cuda_graphs is None:
                    model.use_cuda_graphs()
        self.cache_options = {"layout": cache_layout, "block_size": block_size}
        if num_blocks is not None:
            num_blocks = as_int("num_blocks", num_blocks, low=1)
            if cache_layout != "paged":
                raise ValueError(f"num_blocks bounds a paged cache; pass cache_layout='paged' (got {cache_layout!r})")
        self.num_blocks = num_blocks
        self.stats: list[RequestStats] = []

    def generate(self, prompts, *, tokenizer=None, **sampling) -> GenerationResult:
        """Run to completion; prompts are token-id sequences, or strings with ``tokenizer``."""
        ids = encode_prompts(prompts, tokenizer)
        outputs: list[list[int]] = [[] for _ in ids]
        for step in self.stream(ids, **sampling):
            for request, tokens in zip(step.requests, step.tokens):
                outputs[request].extend(tokens)
        text = None if tokenizer is None else [tokenizer.decode(t) for t in outputs]
        return GenerationResult(outputs, self.stats, text)

    def validate(self, prompts, *, allow_beyond_max_positions: bool = False, **sampling) -> Requests:
        """Check ``stream``'s arguments without running anything (``stream`` calls it first).

        Raises TypeError / ValueError naming the argument (``make_requests`` lists the ranges),
        including for a prompt plus ``max_new_tokens`` beyond the target's
        ``max_position_embeddings`` unless ``allow_beyond_max_positions`` is True.
        """
        if not isinstance(allow_beyond_max_positions, bool):
            raise TypeError(f"allow_beyond_max_positions must be a bool, got {allow_beyond_max_positions!r}")
        config = self.target.config
        max_positions = None if allow_beyond_max_positions else config.max_position_embeddings
        req = make_requests(
            prompts, vocab_size=config.vocab_size, config_eos=config.eos_token_ids, max_positions=max_positions,
            **sampling,
        )  # fmt: skip
        if self.num_blocks is not None:
            check_pool(self.num_blocks, self.cache_options["block_size"], req.prompts)
        return req

    @torch.inference_mode()
    def stream(
        self,
        prompts: Sequence[Sequence[int] | torch.Tensor],
        *,
        max_new_tokens: int | Sequence[int] = 64,
        temperature: float | Sequence[float] = 0.0,
        top_k: int | Sequence[int] = 0,
        top_p: float | Sequence[float] = 1.0,
        seed: int | Sequence[int] | None = None,
        eos_token_id: int | Sequence[int] | None | str = DEFAULT_EOS,
        allow_beyond_max_positions: bool = False,
    ) -> Iterator[StepOutput]:
        """Yield one ``StepOutput`` per target forward; ``self.stats`` is updated as it goes.

        Sampling arguments are one value or one per prompt: max_new_tokens int >= 0; temperature
        0 (greedy) or >= 1e-30 (smaller ones are refused: 1/T and logits/T must stay finite in
        float32); top_k int in [0, vocab] (0 = off); top_p in (0, 1]; seed (int: request b gets
        seed + b; None: drawn from torch's generator); eos_token_id (None: never stop early).
        A prompt plus max_new_tokens beyond the target's max_position_embeddings is refused
        unless ``allow_beyond_max_positions=True``. ``validate`` checks all of this before
        anything runs (TypeError / ValueError naming the argument).

        The KV caches are allocated up front for prompt + max_new_tokens (plus one tree); caches
        that would not fit in the memory available are refused with
        ``specdec.validation.InsufficientMemoryError`` (a ValueError) naming max_new_tokens.
        Each request ends with a reason from ``FINISH_REASONS``: 'eos', 'length', 'invalid', or
        'cache' (a bounded paged pool, ``num_blocks``, that could not hold it even alone).
        """
        req = self.validate(
            prompts, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
            eos_token_id=eos_token_id, allow_beyond_max_positions=allow_beyond_max_positions,
        )  # fmt: skip
        self.stats = [RequestStats(len(p)) for p in req.prompts]
        running = [b for b in range(req.batch_size) if req.max_new_tokens[b] > 0]
        done = {b: "length" for b in range(req.batch_size) if req.max_new_tokens[b] == 0}
        for b in done:
            self.stats[b].finish_reason = "length"
        if not running:
            yield StepOutput((), (), done)
            return
        try:
            run = _Run(self, req, running)
            first = run.prefill()
        except InsufficientMemoryError as exc:
            longest, batch = max(req.max_new_tokens), req.batch_size
            drivers = f"max_new_tokens ({longest}; caches hold prompt + max_new_tokens) or the batch ({batch})"
            if self.num_blocks is not None:
                drivers += f", or num_blocks ({self.num_blocks})"
            raise exc.blame(drivers) from None
        yield StepOutput(first.requests, first.tokens, {**done, **first.finished})  # 0-token requests end here
        while run.running or (run.pool is not None and run.pool.paused):
            yield run.step()


class _Run:
    """State of one ``stream`` call: the caches, the texts, who is still running."""

    def __init__(self, decoder: SpeculativeDecoder, req: Requests, running: list[int]):
        self.decoder, self.req, self.running = decoder, req, running
        self.target, self.strategy, self.stats = decoder.target, decoder.strategy, decoder.stats
        self.device = self.target.device
        # The last step starts with prompt + max_new - 2 tokens cached and writes one tree after them.
        widest = self.strategy.max_nodes
        self.max_len = max(len(p) + max(m - 2, 0) + widest for p, m in zip(req.prompts, req.max_new_tokens))
        pool = {} if decoder.num_blocks is None else {"num_blocks": decoder.num_blocks}
        self.cache = self.target.new_cache(req.batch_size, self.max_len, **decoder.cache_options, **pool)
        self.pool = None if self.cache.pages is None else SharedPool(self.target, self.cache, self.strategy.max_nodes)
        self.budgets: list[int] = []  # nodes each running request's next tree may have (``_schedule``)
        self.params = req.sampling_params(self.device)  # [B]; each step selects the running rows
        self._rows: tuple[list[int], torch.Tensor, SamplingParams] | None = None  # see _running
        self.texts = [list(p) for p in req.prompts]
        self.generated = [0] * req.batch_size
        self.adaptive = decoder.adaptive
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
        self.strategy.prefill(Prefill(prompts, self.max_len, self.decoder.cache_options, hidden, q_offsets))
        roots = Proposal(tokens.index_select(0, last_rows), [[-1]] * len(running), rule="deterministic")
        last_hidden = hidden.index_select(0, last_rows)
        node_offsets = offsets_to_device([1] * len(running), self.device)
        return self._verify_and_emit(logits, last_hidden, roots, node_offsets, self._running_params(), commit=None)

    def step(self) -> StepOutput:
        ended = self._schedule()
        if not self.running:  # every request left ended with 'cache'
            return StepOutput((), (), ended)
        context = self._context()
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
        commit = "chains" if chains else "trees"
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

        ``commit``: "trees" moves the accepted nodes' K/V next to the prefix; "chains" (every tree a
        chain, a host fact) has nothing to move and only advances the lengths; None for the prefill,
        whose ``advance`` already committed its prompts. ``ended``: requests that finished before the
        step ran (out of cache), reported with this step's finished ones.
        """
        greedy = all(self.req.temperature[b] <= 0 for b in self.running)
        result = verify(logits, proposal, node_offsets, params, greedy=greedy, chains=commit == "chains")
        if commit is not None:
            self._commit_accepted(result, chains=commit == "chains")
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
        if commit is not None and self.adaptive is not None:
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
