"""The speculative decoding loop: propose -> one target forward -> verify -> compact -> emit.

One loop serves every strategy. A strategy (draft-model chain or tree, n-gram)
proposes one token tree per running request; ``strategy=None`` proposes nothing,
which makes the loop plain autoregressive decoding (one-node trees: the
verification op then just samples the next token).

Each step:
  1. ``strategy.propose`` -> token trees (root = the last emitted token);
  2. one target forward over every node of every running request, the tree mask
     from the host-known tree shapes (``build_tree_metadata`` on the CPU, copied
     without waiting);
  3. ``verify_tree``: accepted path, emitted tokens, invalid rows -- greedy or
     exact sampling with per-request temperature / top-k / top-p / seed;
  4. ``KVCache.compact``: the accepted nodes' K/V move next to the prefix;
  5. the step's one host synchronisation (marked ``HOST SYNC`` below): emitted
     tokens and counts come back to stream them and to decide who finishes;
     everything the next step sends to the device goes through pinned buffers.

Random numbers: verification uses ``(seed, offset = tokens generated so far)``; a
request's tokens therefore depend on its own seed only, not on the batch.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from specdec.decoding.proposal import Proposal, depths, tree_metadata_on
from specdec.decoding.requests import DEFAULT_EOS, Requests, make_requests, offsets_on, to_device
from specdec.kernels import SamplingParams, sample, verify_tree
from specdec.model.attention_metadata import AttentionMetadata, causal_positions, tree_positions


@dataclass
class RequestStats:
    """Per-request counters; ``tau`` is the mean number of tokens per target forward."""

    prompt_tokens: int
    generated: int = 0
    target_forwards: int = 0
    drafted: int = 0
    accepted: int = 0
    drafted_at: list[int] = field(default_factory=list)  # position j reached with a draft to test
    accepted_at: list[int] = field(default_factory=list)  # ... and that draft was accepted
    finish_reason: str | None = None

    @property
    def tau(self) -> float:
        return self.generated / self.target_forwards if self.target_forwards else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    def acceptance_by_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)]


@dataclass(frozen=True)
class StepOutput:
    """Tokens emitted in one step: request ``requests[i]`` produced ``tokens[i]`` (a tuple).

    ``finished`` maps each request that ended this step to why: 'eos' (its EOS token is the
    last of its tokens), 'length' (reached max_new_tokens) or 'invalid' (its target logits had
    no valid token: NaN / all -inf; nothing emitted for it this step).
    """

    requests: tuple[int, ...]
    tokens: tuple[tuple[int, ...], ...]
    finished: dict[int, str] = field(default_factory=dict)


@dataclass(frozen=True)
class GenerationResult:
    tokens: list[list[int]]
    stats: list[RequestStats]
    text: list[str] | None = None


@dataclass(frozen=True)
class StepContext:
    """What a strategy sees when proposing (host lists are per running request)."""

    running: list[int]
    batch_size: int
    roots: list[int]  # last emitted token, the tree root
    previous: list[int]  # the token before it (the last one the target has cached)
    histories: list[list[int]]  # prompt + generated text
    max_depth: list[int]  # longest path a tree may have: remaining tokens - 1
    params: dict[str, torch.Tensor]  # temperature, top_k, top_p, seed: [R] device tensors
    offset: torch.Tensor  # [R] int64: tokens generated so far
    greedy: bool = False  # every running request has temperature 0 (known on the host)

    def full_counts(self, per_request: int | Sequence[int]) -> list[int]:
        """Rows per batch slot: ``per_request`` for running requests (in running order), 0 elsewhere."""
        counts = [0] * self.batch_size
        values = [per_request] * len(self.running) if isinstance(per_request, int) else list(per_request)
        for b, c in zip(self.running, values):
            counts[b] = c
        return counts


class SpeculativeDecoder:
    """Batched speculative (or, with ``strategy=None``, plain) decoding with a target model.

    Parameters
    ----------
    target : a ``LlamaModel``.
    strategy : None, ``DraftModelStrategy`` (chain or tree) or ``NgramStrategy``.
    cache_layout, block_size : the KV caches' layout ("contiguous" or "paged") and page size.

    Example
    -------
    >>> decoder = SpeculativeDecoder(target, DraftModelStrategy(draft, branching=(1,) * 5))
    >>> result = decoder.generate([[1, 2, 3]], max_new_tokens=64)
    >>> result.tokens[0], result.stats[0].tau
    """

    def __init__(self, target, strategy=None, *, cache_layout: str = "contiguous", block_size: int = 16):
        draft = getattr(strategy, "draft", None)
        if draft is not None:
            check_same_vocabulary(target, draft)
        self.target, self.strategy = target, strategy
        self.cache_options = {"layout": cache_layout, "block_size": block_size}
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
    ) -> Iterator[StepOutput]:
        """Yield one ``StepOutput`` per target forward; ``self.stats`` is updated as it goes.

        Sampling arguments are one value or one per prompt: max_new_tokens >= 0, temperature
        >= 0 (0 = greedy), top_k >= 0 (0 = off), top_p in (0, 1], seed (int: request b gets
        seed + b; None: drawn from torch's generator), eos_token_id (None: never stop early).
        """
        target = self.target
        req = make_requests(
            prompts, vocab_size=target.config.vocab_size, config_eos=target.config.eos_token_ids,
            max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
            seed=seed, eos_token_id=eos_token_id,
        )  # fmt: skip
        self.stats = [RequestStats(len(p)) for p in req.prompts]
        running = [b for b in range(req.batch_size) if req.max_new_tokens[b] > 0]
        done = {b: "length" for b in range(req.batch_size) if req.max_new_tokens[b] == 0}
        for b in done:
            self.stats[b].finish_reason = "length"
        if not running:
            yield StepOutput((), (), done)
            return
        run = _Run(self, req, running)
        first = run.prefill()
        yield StepOutput(first.requests, first.tokens, {**done, **first.finished})  # 0-token requests end here
        while run.running:
            yield run.step()


class _Run:
    """State of one ``stream`` call: the caches, the texts, who is still running."""

    def __init__(self, decoder: SpeculativeDecoder, req: Requests, running: list[int]):
        self.decoder, self.req, self.running = decoder, req, running
        self.target, self.strategy, self.stats = decoder.target, decoder.strategy, decoder.stats
        self.device = self.target.device
        widest = 1 if self.strategy is None else self.strategy.max_nodes
        # The last step starts with prompt + max_new - 2 tokens cached and writes one tree after them.
        self.max_len = max(len(p) + max(m - 2, 0) + widest for p, m in zip(req.prompts, req.max_new_tokens))
        self.cache = self.target.new_cache(req.batch_size, self.max_len, **decoder.cache_options)
        self.params = req.device_params(self.device)
        self.texts = [list(p) for p in req.prompts]
        self.generated = [0] * req.batch_size

    def prefill(self) -> StepOutput:
        """One ragged causal forward over the prompts; sample each request's first token."""
        req, running = self.req, self.running
        active = set(running)
        counts = [len(p) if b in active else 0 for b, p in enumerate(req.prompts)]
        tokens = to_device([t for b in running for t in req.prompts[b]], torch.int64, self.device)
        q_offsets = offsets_on(counts, self.device)
        self.cache.reserve(counts)
        positions = causal_positions(q_offsets, self.cache.seq_lens, tokens.numel())
        last_rows = q_offsets[1:].long() - 1
        rows = last_rows[to_device(running, torch.int64, self.device)]
        logits, _ = self.target(tokens, positions, AttentionMetadata(q_offsets), self.cache, logits_rows=rows)
        self.cache.advance(counts)
        if self.strategy is not None:
            prompts = [p if b in active else p[:1] for b, p in enumerate(req.prompts)]
            self.strategy.prefill(prompts, self.max_len, self.decoder.cache_options)
        params = self._running_params()
        new, invalid = sample(logits, SamplingParams(**params, offset=self._offset()))
        host = torch.stack((new.long(), invalid.long()), dim=1).cpu()  # HOST SYNC (the prefill step's one)
        return self._emit([(int(t), 0, bool(bad), 0, 0) for t, bad in host.tolist()])

    def step(self) -> StepOutput:
        params = self._running_params()
        context = StepContext(
            running=self.running,
            batch_size=self.req.batch_size,
            roots=[self.texts[b][-1] for b in self.running],
            previous=[self.texts[b][-2] for b in self.running],
            histories=[self.texts[b] for b in self.running],
            max_depth=[self.req.max_new_tokens[b] - self.generated[b] - 1 for b in self.running],
            params=params,
            offset=self._offset(),
            greedy=all(self.req.temperature[b] <= 0 for b in self.running),
        )
        if self.strategy is None:
            proposal = Proposal(to_device(context.roots, torch.int64, self.device), [[-1]] * len(self.running))
        else:
            proposal = self.strategy.propose(context)
        # One target forward over every node of every running request.
        depth, mask = tree_metadata_on(proposal.parents, self.device)
        counts = context.full_counts(proposal.counts)
        q_offsets = offsets_on(counts, self.device)
        self.cache.reserve(counts)
        positions = tree_positions(q_offsets, self.cache.seq_lens, depth)
        # Chains (plain decoding, draft chains, n-gram) need no mask: causal attention is the same thing.
        chains = all(tree == list(range(-1, len(tree) - 1)) for tree in proposal.parents)
        metadata = AttentionMetadata(q_offsets, None if chains else mask)
        logits, _ = self.target(proposal.tokens, positions, metadata, self.cache)
        # Verify all trees at once, then commit the accepted paths' K/V.
        parents = to_device([p for tree in proposal.parents for p in tree], torch.int32, self.device)
        max_depth = proposal.max_depth()
        result = verify_tree(
            logits, proposal.tokens.to(torch.int32), parents, offsets_on(proposal.counts, self.device),
            SamplingParams(**params, offset=context.offset),
            rule="deterministic" if proposal.child_probs is None else "stochastic",  # children sampled from q or not
            draft_probs=proposal.child_probs, max_depth=max_depth,
        )  # fmt: skip
        path = torch.full((self.req.batch_size, max_depth + 1), -1, dtype=torch.int32, device=self.device)
        path[to_device(self.running, torch.int64, self.device)] = result.accepted_path
        self.cache.compact(path)
        host = torch.cat(  # HOST SYNC: the step's one read-back, to stream and decide termination
            (result.output_tokens.long(), result.num_accepted.long()[:, None], result.invalid.long()[:, None]), dim=1
        ).cpu()
        emitted = []
        for row, drafted, tree in zip(host.tolist(), proposal.num_drafted, proposal.parents):
            accepted, bad = row[-2], bool(row[-1])
            emitted.append((row[: accepted + 1], accepted, bad, drafted, max(depths(tree))))
        return self._emit(emitted)

    # ---- bookkeeping -----------------------------------------------------------------------------

    def _emit(self, rows: list[tuple]) -> StepOutput:
        """Append each running request's tokens, update its stats, retire finished requests."""
        requests, tokens, finished = [], [], {}
        for b, (new, accepted, bad, drafted, depth) in zip(self.running, rows):
            stats = self.stats[b]
            stats.target_forwards += 1
            if bad:
                finished[b] = "invalid"
                continue
            new = [new] if isinstance(new, int) else new
            stats.drafted += drafted
            stats.accepted += accepted
            _grow(stats.drafted_at, depth)
            _grow(stats.accepted_at, depth)
            for j in range(depth):
                stats.drafted_at[j] += accepted >= j
                stats.accepted_at[j] += accepted > j
            out = []
            for t in new:
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
        done = list(finished)
        if done:
            self.cache.release(done)
        # The host knows every committed length exactly: bounds tighten, pages free, no device read.
        self.cache.known_lengths([len(t) - 1 if b in self.running else 0 for b, t in enumerate(self.texts)])
        if self.strategy is not None:
            self.strategy.commit([len(t) - 1 for t in self.texts], done)
        return StepOutput(tuple(requests), tuple(tokens), finished)

    def _running_params(self) -> dict[str, torch.Tensor]:
        rows = to_device(self.running, torch.int64, self.device)
        return {name: value.index_select(0, rows) for name, value in self.params.items()}

    def _offset(self) -> torch.Tensor:
        return to_device([self.generated[b] for b in self.running], torch.int64, self.device)


def check_same_vocabulary(target, draft, target_tokenizer=None, draft_tokenizer=None) -> None:
    """Refuse a draft whose vocabulary (size, or tokenizer when both are given) differs from the target's."""
    vt, vd = target.config.vocab_size, draft.config.vocab_size
    if vt != vd:
        raise ValueError(f"draft and target must share a vocabulary: target has {vt} tokens, draft has {vd}")
    if target_tokenizer is not None and draft_tokenizer is not None:
        if target_tokenizer.get_vocab() != draft_tokenizer.get_vocab():
            raise ValueError("draft and target tokenizers differ (their token-to-id maps are not the same)")


def encode_prompts(prompts, tokenizer) -> list:
    """Token ids as given, or strings encoded with a ``tokenizers.Tokenizer``."""
    if isinstance(prompts, (str, bytes)):
        raise TypeError("prompts must be a list of prompts, not a single string")
    out = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if tokenizer is None:
                raise ValueError(f"prompts[{i}] is text: pass tokenizer= to encode it")
            p = tokenizer.encode(p).ids
        out.append(p)
    return out


def _grow(values: list[int], size: int) -> None:
    values.extend([0] * (size - len(values)))
