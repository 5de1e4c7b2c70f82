"""The speculative decoding loop: propose -> one target forward -> verify -> compact -> emit.

``SpeculativeDecoder`` (here) checks the arguments; ``SpeculativeDecoder.engine`` gives the step API a serving
loop drives (``specdec.decoding.serving.Engine``: requests join free batch slots and leave between steps), and
``generate`` / ``stream`` are loops over such an engine; the state of an engine and its steps are
``specdec.decoding.run.DecodeRun``.

One loop serves every strategy (``specdec.decoding.strategy``): each proposes one token
tree per running request; ``NoDraft`` proposes one-node trees, which makes the loop plain
autoregressive decoding (verification then just samples the next token).

Each step:
  1. ``strategy.propose`` -> token trees (root = the last emitted token), checked against the
     per-request limits -- by default chosen per request by the adaptive controller
     (``specdec.decoding.adaptive``: 0 = plain decoding), which reads the host clock here (after the
     strategy's optional ``prepare``, work owed from earlier steps such as a deferred draft prefill)
     and after the read-back;
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

Requests that join a step get their prefill in it: their whole prompts as causal rows of the step's one forward
when every running tree is a chain, else of a forward of their own before it (``specdec.decoding.joining``), and
each last prompt token as a one-node tree whose verification samples the first token; it is read back with the
step's trees (one read-back still). After the running trees' commit, the strategy attaches its per-request state
to their slots (``Strategy.prefill`` for an engine's first requests, its ``join`` hook later; ``leave`` when
they end).

Random numbers: the uniform that decides a token is keyed on the request's seed and that token's
position (``offset`` = tokens generated so far, plus the node's depth), never on the step; drafts
verified by "sample, then compare" (every strategy's but ``DraftModelStrategy(rule="stochastic")``)
then emit plain seeded sampling's tokens whatever the depths and the batch, as far as the forward
gives a position the same logits in any batch (``specdec.kernels.uniforms``, ``tree_walk``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from specdec.decoding.adaptive import AdaptiveSpeculation
from specdec.decoding.requests import DEFAULT_EOS, Requests, encode_prompts, make_requests
from specdec.decoding.results import GenerationResult, RequestStats, StepOutput
from specdec.decoding.schedule import CacheSpec, check_pool
from specdec.decoding.serving import Engine
from specdec.decoding.strategy import NoDraft, Strategy, StrategyHooks
from specdec.model.cpu_linear import pack_ahead
from specdec.model.draft_head import DraftHead
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
        self.target, self.strategy, self.hooks = target, strategy, StrategyHooks.of(strategy)
        # A strategy that never drafts has nothing to adapt.
        if adaptive is True:
            adaptive = AdaptiveSpeculation()
        self.adaptive = adaptive if adaptive and strategy.max_depth > 0 else None
        if self.adaptive is not None:
            self.adaptive.bind(strategy.max_depth, strategy.max_nodes, self.hooks.draft_nodes, self.hooks.owed_tokens)
        models = [m for m in (target, getattr(strategy, "draft", None)) if m is not None]
        if compile:
            for model in models:
                if model._compiled_run is None:
                    model.compile_run()
        if graphs:
            for model in models:
                if model.cuda_graphs is None:
                    model.use_cuda_graphs()
        head = getattr(strategy, "head", None)  # an EAGLE head's forwards run the same GEMMs
        for owner in models + ([head] if isinstance(head, DraftHead) else []):
            pack_ahead(owner.linear_weights())  # the packs' one-off cost here, not in the first step (the controller's)
        if num_blocks is not None:
            num_blocks = as_int("num_blocks", num_blocks, low=1)
            if cache_layout != "paged":
                raise ValueError(f"num_blocks bounds a paged cache; pass cache_layout='paged' (got {cache_layout!r})")
        self.cache_spec = CacheSpec(cache_layout, block_size, num_blocks)
        self.stats: list[RequestStats] = []
        self._engine: Engine | None = None  # the engine that owns the strategy's state now

    def engine(self, *, max_batch: int, max_len: int) -> Engine:
        """A step-level engine (``Engine``: ``add_request``, ``step``, ``abort``, ``has_unfinished``) of ``max_batch``
        slots whose caches hold ``max_len`` tokens each; the target's cache is allocated now (refused with
        ``InsufficientMemoryError`` naming max_len and max_batch when it would not fit), a drafter's at the first
        step. It takes this decoder's strategy over from any earlier engine or stream."""
        return Engine(self, max_batch=max_batch, max_len=max_len)

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
        if self.cache_spec.num_blocks is not None:
            check_pool(self.cache_spec.num_blocks, self.cache_spec.block_size, req.prompts)
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
        if not any(req.max_new_tokens):  # nothing to run: no caches
            self.stats = [RequestStats(len(p), finish_reason="length") for p in req.prompts]
            yield StepOutput((), (), dict.fromkeys(range(req.batch_size), "length"))
            return
        # The last step starts with prompt + max_new - 2 tokens cached and writes one tree after them.
        widest = self.strategy.max_nodes
        max_len = max(len(p) + max(m - 2, 0) + widest for p, m in zip(req.prompts, req.max_new_tokens))
        longest, batch = max(req.max_new_tokens), req.batch_size
        drivers = f"max_new_tokens ({longest}; caches hold prompt + max_new_tokens) or the batch ({batch})"
        if self.cache_spec.num_blocks is not None:
            drivers += f", or num_blocks ({self.cache_spec.num_blocks})"
        try:
            engine = self.engine(max_batch=batch, max_len=max_len)
            self.stats = [engine.enqueue(req.one(b), b) for b in range(batch)]  # request b runs in slot b
            first = engine.step()  # every request's prefill (and a drafter's caches)
        except InsufficientMemoryError as exc:
            raise exc.blame(drivers) from None
        yield first
        while engine.has_unfinished():
            yield engine.step()
