"""A draft model with its own KV cache that follows the committed text: what every draft-model strategy shares.

The draft's cache holds the committed text except the last committed token (length ``L - 1``
where the target holds ``L``) once it has caught up; a step's first draft forward re-feeds that
token together with the new root, so each step has the same shape whatever was accepted last
time (re-writing a cached token's K/V rewrites the same values). After verification the engine
calls ``commit`` and the cache is cut back to at most ``L' - 1``: its rollback mirrors the
target's. Tokens the cache missed (a tree's accepted nodes; a step that drafted nothing) are fed
with the next step's first draft forward, ahead of the last committed token and the root; a
longer gap -- the prompt, fed at the first step that drafts rather than at the prefill, or many
plain steps -- is fed by ``prepare`` as a forward of its own.

Subclasses (``DraftModelStrategy``, ``ParallelDraftStrategy``) write ``propose``: it starts with
``_first_rows(step)`` (the rows of the step's first forward) and leaves ``lengths`` and the cache
as that method documents.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdec._transfer import offsets_to_device, to_device
from specdec.decoding.strategy import BaseStrategy, Prefill, StepContext, StepResult
from specdec.model.attention_metadata import AttentionMetadata, causal_positions
from specdec.model.draft_forward_cpu import DraftForward

# Tokens the draft cache missed (a step that drafted nothing, a tree's accepted path) fed in the step's first draft
# forward, up to this many per request; a longer catch-up is a forward of its own.
FOLD_MISSING = 4


class DraftCacheStrategy(BaseStrategy):
    """The engine hooks of a strategy drafting with ``draft`` (a ``LlamaModel``) over a KV cache of its own.

    ``fused``: the draft's forwards run in C++ on the CPU where the extension can run them
    (``specdec.model.draft_forward_cpu.DraftForward``).
    """

    def __init__(self, draft, *, fused: bool = True):
        if not isinstance(fused, bool):
            raise TypeError(f"fused must be a bool, got {fused!r}")
        self.draft = draft
        self.fused = fused
        self.cache = None
        self.forward: DraftForward | None = None  # the draft's forwards over ``cache``, C++ or PyTorch (``prefill``)
        self.lengths: list[int] = []

    def prefill(self, prefill: Prefill) -> None:
        """Allocate the draft cache, empty: the prompts are fed at the first step that drafts (``prepare``), so a
        stream the adaptive controller decodes plainly never runs the draft."""
        self.cache = self.draft.new_cache(len(prefill.prompts), prefill.max_len, **prefill.cache_options)
        self.forward = DraftForward(self.draft, self.cache, fused=self.fused)
        self.lengths = [0] * len(prefill.prompts)  # host copy of the draft cache's committed lengths

    def join(self, prefill: Prefill) -> None:
        """Requests join empty slots of the draft cache: nothing to feed now (their prompts go in at their first
        step that drafts, as in ``prefill``)."""
        for b, prompt in enumerate(prefill.prompts):
            if prompt:
                self.lengths[b] = 0

    def leave(self, slots: Sequence[int]) -> None:
        """Free the slots' draft-cache rows (blocks, for a paged draft cache)."""
        self.cache.release(list(slots))
        for b in slots:
            self.lengths[b] = 0

    def prepare(self, step: StepContext) -> None:
        """Before a step that drafts, outside its timing (the contract's optional hook): feed what the draft cache
        missed beyond ``FOLD_MISSING`` per request -- the deferred prompt, or a long run of plain steps -- as one
        forward; shorter gaps ride in the step's first draft forward (``_first_rows``)."""
        if max(step.max_depth) <= 0 or max(step.max_nodes) <= 1:
            return
        if self.owed_tokens(step.running, _contexts(step)):
            self._catch_up(step)

    def owed_tokens(self, running: Sequence[int], contexts: Sequence[int]) -> int:
        """Tokens a step that drafts would first feed the draft in ``prepare`` (0 when the gaps ride in its first
        draft forward), for requests ``running`` whose target caches hold ``contexts`` tokens: the adaptive
        controller prices that catch-up into the choice to draft (``specdec.decoding.adaptive``)."""
        missing = self._missing(running, contexts)
        return sum(missing) if max(missing, default=0) > FOLD_MISSING else 0

    def commit(self, result: StepResult) -> None:
        """Cut the draft cache back to each request's committed length minus one; free finished slots."""
        lengths = [max(n - 1, 0) for n in result.lengths]
        self.cache.truncate(lengths)
        # A chain's forwards advanced the cache past every accepted token; tree levels (and steps that
        # drafted nothing) did not advance it: it keeps its length and the next draft catches up.
        self.lengths = [min(c, n) for c, n in zip(self.lengths, lengths)]
        if result.finished:
            self.cache.release(result.finished)

    def _first_rows(self, step) -> torch.Tensor:
        """``[R, n]`` int64: each running request's first draft forward (causal): the tokens the draft cache missed
        since its last advance (the accepted path of a tree, whose levels were cut after drafting, or the token of
        a step that drafted nothing), then its last committed token and its root. Up to ``FOLD_MISSING`` missed
        tokens ride in this forward instead of a forward of their own: a request that missed fewer than the most
        is wound back to feed cached tokens again (their K/V are written again with the same values), so every
        request feeds the same n rows. Longer catch-ups run first as their own forward. The host lengths then
        count the cache as holding all but the last two."""
        histories, missing = step.histories, self._missing(step.running, _contexts(step))
        most = max(missing)
        if most > FOLD_MISSING or any(len(h) < most + 2 for h in histories):
            self._catch_up(step)
            missing, most = [0] * len(missing), 0
        n = most + 2
        if any(m != most for m in missing):  # wind the requests that missed fewer back to the same start
            lengths = list(self.lengths)
            for b, h in zip(step.running, histories):
                lengths[b] = len(h) - n
            self.cache.truncate(lengths)
        for b, h in zip(step.running, histories):
            self.lengths[b] = len(h) - 2
        tokens = to_device([t for h in histories for t in h[-n:]], torch.int64, self.draft.device)
        return tokens.view(len(histories), n)

    def _missing(self, running: Sequence[int], contexts: Sequence[int]) -> list[int]:
        """Per running request, the committed tokens the draft cache lacks before the last two (the target's cache
        holds ``contexts`` tokens: all but the last committed one)."""
        return [c - 1 - self.lengths[b] for b, c in zip(running, contexts)]

    def _catch_up(self, step) -> None:
        """Feed the tokens committed since the draft cache's last advance as a forward of their own, so the cache
        again holds all but the last two."""
        device = self.draft.device
        missing = [h[self.lengths[b] : len(h) - 2] for b, h in zip(step.running, step.histories)]
        if not any(missing):
            return
        counts = step.full_counts([len(m) for m in missing])
        q_offsets = offsets_to_device(counts, device)
        self.cache.reserve(counts)
        tokens = to_device([t for m in missing for t in m], torch.int64, device)
        positions = causal_positions(q_offsets, self.cache.seq_lens, tokens.numel())
        self.draft(tokens, positions, AttentionMetadata(q_offsets), self.cache, logits_rows=_no_rows(device))
        self.cache.advance(counts)
        for b, m in zip(step.running, missing):
            self.lengths[b] += len(m)


def _contexts(step: StepContext) -> list[int]:
    """Tokens each running request's target cache holds: all its committed text but the last token."""
    return [len(h) - 1 for h in step.histories]


def _no_rows(device: torch.device) -> torch.Tensor:
    return torch.zeros(0, dtype=torch.int64, device=device)
