"""The step API a serving loop drives: requests join and leave between steps (continuous batching).

``Engine`` (from ``SpeculativeDecoder.engine(max_batch=, max_len=)``) holds ``max_batch`` batch slots whose
caches hold ``max_len`` tokens each, allocated once. ``add_request`` queues a request; each ``step`` first admits
queued requests into free slots (first come, first served; with a bounded paged pool only while the pool holds
their prompts beside the running requests' next tokens, and never past a paused request), runs their prefill
forward and samples their first token, then runs one speculative step of the requests already running, and
reads both back at once: one host synchronisation per step whatever joins. Finished and aborted requests free
their slots for the next step's admissions. ``SpeculativeDecoder.generate`` and ``stream`` are loops over an
engine whose slots are their batch.

Each request's tokens depend on its own prompt, sampling parameters and seed only: greedy requests get what
they would alone, and so do seeded sampled ones, joining at any step (with the stochastic draft rule, whose
tokens depend on the depths drafted, only at fixed sizes, ``adaptive=False``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable

import torch

from specdec.decoding.requests import Request, encode_prompts
from specdec.decoding.results import RequestStats, StepOutput
from specdec.decoding.run import DecodeRun
from specdec.validation import InsufficientMemoryError, as_int


class Engine:
    """A step-level engine over a ``SpeculativeDecoder`` (see the module docstring).

    Parameters
    ----------
    decoder : the ``SpeculativeDecoder`` (target, strategy, cache layout, adaptive controller) to run.
    max_batch : batch slots (requests that run at once; more wait in a queue).
    max_len : tokens each slot's KV caches hold: a request needs its prompt, ``max_new_tokens - 2`` and one
        tree of the strategy's ``max_nodes`` (``add_request`` refuses one that needs more).

    One engine drives a decoder's strategy and controller at a time: a later engine (or a ``stream`` /
    ``generate`` call) on the same decoder takes them over, and the earlier engine refuses to step. Call it
    from one thread (``add_request`` and ``abort`` between steps).

    Example
    -------
    >>> from specdec.decoding import NgramStrategy, SpeculativeDecoder
    >>> from specdec.model import LlamaModel, ModelConfig
    >>> config = ModelConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=1,
    ...                      num_heads=2, num_kv_heads=1, head_dim=16)
    >>> target = LlamaModel(config).requires_grad_(False)         # random weights
    >>> engine = SpeculativeDecoder(target, NgramStrategy(num_draft=3)).engine(max_batch=2, max_len=64)
    >>> first = engine.add_request([1, 2, 3, 1, 2], max_new_tokens=5)
    >>> out = engine.step()                                       # its prefill: the first token
    >>> later = engine.add_request([4, 5], max_new_tokens=3, request_id="b")
    >>> texts = {first: list(out.tokens[0])}
    >>> while engine.has_unfinished():
    ...     out = engine.step()
    ...     for request, tokens in zip(out.requests, out.tokens):
    ...         texts.setdefault(request, []).extend(tokens)
    >>> {request: len(tokens) for request, tokens in texts.items()}
    {0: 5, 'b': 3}
    """

    def __init__(self, decoder, *, max_batch: int, max_len: int):
        self.max_batch = as_int("max_batch", max_batch, low=1)
        self.max_len = as_int("max_len", max_len, low=decoder.strategy.max_nodes + 1)
        self.decoder = decoder
        try:
            self._run = DecodeRun(
                decoder.target, decoder.strategy, decoder.hooks, batch_size=self.max_batch, max_len=self.max_len,
                cache_spec=decoder.cache_spec, adaptive=decoder.adaptive,
            )  # fmt: skip
        except InsufficientMemoryError as exc:
            drivers = "max_len or max_batch" + ("" if decoder.cache_spec.num_blocks is None else " (or num_blocks)")
            raise exc.blame(drivers) from None
        decoder._engine = self  # the strategy's and the controller's state is this engine's from now on
        self._waiting: deque[tuple[Hashable, Request]] = deque()
        self._slot_of: dict[Hashable, int] = {}  # requests holding a slot (running or paused)
        self._id_of: list[Hashable | None] = [None] * self.max_batch
        self._stats: dict[Hashable, RequestStats] = {}  # every unfinished request's (waiting ones included)
        self._reports: dict[Hashable, str] = {}  # endings the next step reports (aborts, 0-token requests)
        self._next_id = 0

    # ---- the serving API ------------------------------------------------------------------------------

    def add_request(self, prompt, *, request_id: Hashable | None = None, tokenizer=None, **sampling) -> Hashable:
        """Queue a request; returns its id (``request_id``, else the next unused int from 0).

        ``prompt``: token ids (or a string with ``tokenizer``). ``sampling``: ``SpeculativeDecoder.stream``'s
        per-request arguments as single values (max_new_tokens, temperature, top_k, top_p, seed -- None draws
        one --, eos_token_id, allow_beyond_max_positions), checked as it checks them (TypeError / ValueError
        naming the argument); ValueError too for a request this engine's ``max_len`` cannot hold, or an id
        already in use. The request joins at the first ``step`` with a free slot.
        """
        self._check_current()
        if request_id is None:
            while self._next_id in self._stats or self._next_id in self._reports:
                self._next_id += 1
            request_id = self._next_id
        elif not isinstance(request_id, Hashable):
            raise TypeError(f"request_id must be hashable (an int or a str), got {type(request_id).__name__}")
        if request_id in self._stats or request_id in self._reports:
            raise ValueError(f"request_id {request_id!r} is already in use by an unfinished request")
        prompts = encode_prompts([prompt], tokenizer)
        request = self.decoder.validate(prompts, **sampling).one(0)
        needed = len(request.prompt) + max(request.max_new_tokens - 2, 0) + self.decoder.strategy.max_nodes
        if needed > self.max_len:
            raise ValueError(
                f"the prompt ({len(request.prompt)} tokens) and max_new_tokens ({request.max_new_tokens}) need "
                f"{needed} cached tokens with a {self.decoder.strategy.max_nodes}-node tree, beyond this engine's "
                f"max_len ({self.max_len}); lower max_new_tokens or build the engine with a larger max_len"
            )
        self.enqueue(request, request_id)
        return request_id

    @torch.inference_mode()
    def step(self) -> StepOutput:
        """Admit what fits, run one step; ``StepOutput`` with request ids, their new tokens and the endings
        (``FINISH_REASONS``, 'abort' included) since the last step. Nothing to run: an empty output. It runs in
        inference mode whatever the caller's: with autograd recording, CPU forwards would leave their packed GEMM
        kernels for ``F.linear`` (``specdec.model.cpu_linear``) and run about half as fast."""
        self._check_current()
        run = self._run
        joining = self._admit()
        out = run.step(joining) if joining or run.occupied() else StepOutput((), (), {})
        requests = tuple(self._id_of[b] for b in out.requests)
        finished, self._reports = self._reports, {}
        for slot, why in out.finished.items():
            request_id = self._id_of[slot]
            finished[request_id] = why
            self._id_of[slot] = None
            del self._slot_of[request_id], self._stats[request_id]
        return StepOutput(requests, out.tokens, finished)

    @torch.inference_mode()  # it frees cache and drafter state that steps made in inference mode
    def abort(self, request_id: Hashable) -> bool:
        """End an unfinished request now (its slot and blocks free for the next step, which reports it 'abort');
        False when no unfinished request has this id (it finished, was aborted, or never came)."""
        self._check_current()
        if request_id in self._slot_of:
            slot = self._slot_of.pop(request_id)
            self._run.abort(slot)
            self._id_of[slot] = None
        else:
            waiting = [i for i, (queued, _) in enumerate(self._waiting) if queued == request_id]
            if not waiting:
                return False
            del self._waiting[waiting[0]]
        self._stats.pop(request_id).finish_reason = "abort"
        self._reports[request_id] = "abort"
        return True

    def has_unfinished(self) -> bool:
        """Some request waits or runs, or an ending is still to be reported by ``step``."""
        return bool(self._waiting or self._slot_of or self._reports)

    def stats(self, request_id: Hashable) -> RequestStats:
        """The ``RequestStats`` of an unfinished request: one object, updated in place until it ends."""
        if request_id not in self._stats:
            raise KeyError(f"no unfinished request has request_id {request_id!r}")
        return self._stats[request_id]

    @property
    def num_waiting(self) -> int:
        """Requests queued for a slot."""
        return len(self._waiting)

    # ---- internals ----------------------------------------------------------------------------------

    def enqueue(self, request: Request, request_id: Hashable) -> RequestStats:
        """Queue a validated request (``add_request`` without the checks; ``SpeculativeDecoder.stream`` validates
        its batch at once); a request of 0 new tokens ends at once ('length', reported by the next step)."""
        stats = RequestStats(len(request.prompt))
        if request.max_new_tokens == 0:
            stats.finish_reason = self._reports[request_id] = "length"
        else:
            self._stats[request_id] = stats
            self._waiting.append((request_id, request))
        return stats

    def _admit(self) -> list[tuple[int, Request, RequestStats]]:
        """Queued requests that join this step, each with its slot (the lowest free first), in queue order."""
        run = self._run
        if not self._waiting or (self.decoder.hooks.join is None and run.occupied()):
            return []  # a strategy that cannot join a running batch is served whole batches
        free, joining, prompts = run.free_slots(), [], []
        while self._waiting and len(joining) < len(free):
            request_id, request = self._waiting[0]
            if not run.admits(prompts + [request.prompt]):
                break  # first come, first served: a later request does not overtake this one
            self._waiting.popleft()
            slot = free[len(joining)]
            self._slot_of[request_id], self._id_of[slot] = slot, request_id
            prompts.append(request.prompt)
            joining.append((slot, request, self._stats[request_id]))
        return joining

    def _check_current(self) -> None:
        if self.decoder._engine is not self:
            raise RuntimeError(
                "this engine's decoder runs another engine (a later engine(), stream() or generate() call took over "
                "its strategy's state); build one engine per decoder at a time"
            )
