"""Sharing a bounded paged KV cache among the requests: tree budgets, pausing and resuming.

When the target's paged pool is smaller than the worst case (``SpeculativeDecoder(num_blocks=...)``),
the engine plans each step before anything is drafted, from host data only (the pool's block
lists and each request's exact cached length), so planning adds no device synchronisation:

1. Every running request needs room for at least its root (one token). While the pool cannot
   give that to all of them, the running request in the highest slot is paused: its blocks go
   back to the pool and it waits, keeping every token it generated. A request that cannot get a
   block with nothing else running (the whole pool its own) can never grow: it ends with finish
   reason 'cache'.
2. Paused requests resume, lowest slot first, while the pool holds each one's cached prefix plus
   its root beside what the running requests need (not in a step that had to pause one, unless
   nothing else runs); the engine recomputes the prefix (one causal forward) before the step. A
   paused request whose prefix and root exceed the whole pool ends with 'cache'.
3. The blocks left over become tree budgets, in slot order: each tree gets as many nodes as fit,
   up to the strategy's ``max_nodes``. A smaller tree only drafts less; what is emitted is
   distributed exactly as before.

Every step that runs emits at least one token per running request, so the plan always makes
progress; random numbers depend on tokens generated, not on steps, so a paused request's tokens
are the ones it would have produced without pausing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdec._transfer import offsets_to_device, to_device
from specdec.decoding.results import RequestStats
from specdec.model.attention_metadata import AttentionMetadata, causal_positions
from specdec.model.kv_cache import KVCache
from specdec.model.paged_blocks import PagedBlocks


@dataclass(frozen=True)
class CacheSpec:
    """The target KV cache an engine allocates: its layout ("contiguous" or "paged"), page size, and for a paged
    cache the pool in blocks (None: the worst case)."""

    layout: str = "contiguous"
    block_size: int = 16
    num_blocks: int | None = None

    @property
    def options(self) -> dict:
        """``new_cache``'s ``layout=`` / ``block_size=`` (what ``Prefill.cache_options`` hands a drafter)."""
        return {"layout": self.layout, "block_size": self.block_size}


@dataclass(frozen=True)
class StepPlan:
    """Who runs the next step, and how large a tree each may propose.

    running        slots that run the step, ascending (resumed ones included)
    max_nodes      per running request: nodes its tree may have (>= 1)
    resume         paused slots to recompute (their cached prefix) before the step
    pause          running slots to pause now (release their blocks)
    out_of_cache   slots that end with finish reason 'cache' (release their blocks)
    """

    running: list[int]
    max_nodes: list[int]
    resume: list[int]
    pause: list[int]
    out_of_cache: list[int]


def check_pool(num_blocks: int, block_size: int, prompts: list[list[int]]) -> None:
    """Refuse a pool that cannot hold every prompt and its first token at once (the prefill runs them all)."""
    needed = sum(-(-(len(p) + 1) // block_size) for p in prompts)
    if needed > num_blocks:
        raise ValueError(
            f"num_blocks ({num_blocks}) is too small: every prompt and its first token must fit at once, "
            f"{needed} blocks of {block_size} tokens in all; raise num_blocks or send a smaller batch"
        )


def plan_step(
    pages: PagedBlocks, lengths: list[int], running: list[int], paused: list[int], max_nodes: int
) -> StepPlan:
    """Plan one step (see the module docstring); nothing is allocated or freed here.

    ``lengths[b]`` is the number of tokens request ``b`` has cached while running (prompt +
    generated - 1), which a paused request gets back on resuming. Paused requests hold no blocks.
    """
    running, paused = sorted(running), sorted(paused)
    free = pages.num_free
    need = {b: pages.short(b, lengths[b] + 1) for b in running}  # blocks for one more token each
    pause, out = [], []
    while sum(need.values()) > free:
        victim = running.pop()
        free += len(pages.blocks[victim])
        del need[victim]
        (pause if running else out).append(victim)
    resume = []
    for b in paused:
        cost = pages.needed(lengths[b] + 1)  # the prefix to recompute and the root
        if cost > pages.num_blocks:
            out.append(b)
        elif (not pause or not running) and cost <= free - sum(need.values()):
            resume.append(b)
            need[b] = cost
        else:
            break  # keep the order: a later slot does not overtake this one
    running = sorted(running + resume)
    spare = free - sum(need.values())
    budgets = []
    for b in running:
        held = len(pages.blocks[b])
        room = (held + need[b] + spare) * pages.block_size - lengths[b]
        nodes = min(max_nodes, room)
        spare -= pages.needed(lengths[b] + nodes) - held - need[b]
        budgets.append(nodes)
    return StepPlan(running, budgets, resume, pause, out)


class SharedPool:
    """The engine's side of a bounded paged target cache: applies each step's plan.

    ``paused`` lists the requests waiting for blocks (slots ascending). ``plan`` releases the
    blocks of paused and ended requests, recomputes resumed requests' prefixes (one causal forward
    of the target, no logits) and counts pauses in each request's ``RequestStats.preemptions``.
    """

    def __init__(self, target, cache: KVCache, max_nodes: int):
        self.target, self.cache, self.max_nodes = target, cache, max_nodes
        self.paused: list[int] = []

    def plan(self, running: list[int], texts: list[list[int]], stats: list[RequestStats]) -> StepPlan:
        """Plan the next step of ``running`` (``texts[b]``: prompt + generated) and make the cache ready for it."""
        lengths = [len(t) - 1 for t in texts]
        plan = plan_step(self.cache.pages, lengths, running, self.paused, self.max_nodes)
        if plan.pause or plan.out_of_cache:
            self.cache.release(plan.pause + plan.out_of_cache)
        for b in plan.pause:
            stats[b].preemptions += 1
        for b in plan.out_of_cache:
            stats[b].finish_reason = "cache"
        gone = set(plan.resume) | set(plan.out_of_cache)
        self.paused = sorted([b for b in self.paused if b not in gone] + plan.pause)
        if plan.resume:
            self._recompute(plan.resume, texts)
        return plan

    def _recompute(self, requests: list[int], texts: list[list[int]]) -> None:
        """Write the resumed requests' cached prefixes (all but the last token) with one causal forward."""
        device, resumed = self.target.device, set(requests)
        counts = [len(t) - 1 if b in resumed else 0 for b, t in enumerate(texts)]
        tokens = to_device([t for b in sorted(resumed) for t in texts[b][:-1]], torch.int64, device)
        q_offsets = offsets_to_device(counts, device)
        self.cache.reserve(counts)
        positions = causal_positions(q_offsets, self.cache.seq_lens, tokens.numel())
        no_rows = torch.zeros(0, dtype=torch.int64, device=device)
        self.target(tokens, positions, AttentionMetadata(q_offsets), self.cache, logits_rows=no_rows)
        self.cache.advance(counts)
