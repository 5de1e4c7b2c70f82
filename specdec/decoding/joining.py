"""Requests joining a running engine: where their prompts' rows go in a step's target forward.

A step whose running trees are all chains (plain decoding, draft chains, n-gram: a host fact) runs the joining
prompts as more causal rows of its one forward, so the weights stream once for both; a step with tree masks runs
them in a prefill forward of their own first, since its mask covers the trees. Either way each prompt's last token
is then verified as a one-node tree, which samples the request's first token.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import NamedTuple

import torch

from specdec._transfer import offsets_to_device, to_device
from specdec.model.attention_metadata import AttentionMetadata, causal_positions


@dataclass(frozen=True)
class Joining:
    """The requests joining this step: their slots (in the order they joined) and, per slot of the engine, the
    prompt (``[]`` for every slot that is not joining)."""

    slots: list[int]
    prompts: list[list[int]]

    @property
    def counts(self) -> list[int]:
        """Prompt rows per slot."""
        return [len(p) for p in self.prompts]

    def tokens(self) -> list[int]:
        """Every prompt token, slot after slot."""
        return [t for p in self.prompts for t in p]


@dataclass(frozen=True)
class MergedRows:
    """Where the rows of one forward over the running trees and the joining prompts lie (slot after slot, as the
    cache's ``q_offsets`` want them). The forward's input is ``cat(tree tokens, prompt tokens)[gather]``.

    counts       rows per slot (a running request's tree nodes, a joining request's prompt, else 0)
    gather       per forward row, its index in ``cat(tree tokens, prompt tokens)``
    tree_rows    the forward rows of the trees' nodes, in the trees' order (running slots ascending)
    prompt_rows  the forward rows of the prompts, slot after slot
    last_rows    the forward row of each joining prompt's last token, in ``Joining.slots`` order
    """

    counts: list[int]
    gather: list[int]
    tree_rows: list[int]
    prompt_rows: list[int]
    last_rows: list[int]


def merged_rows(running: list[int], tree_counts: list[int], joining: Joining) -> MergedRows:
    """The layout of one forward over ``running``'s trees (``tree_counts`` nodes each, running slots ascending) and
    ``joining``'s prompts.

    >>> rows = merged_rows([0, 2], [2, 1], Joining([1], [[], [7, 8, 9], []]))
    >>> rows.counts, rows.gather, rows.tree_rows, rows.prompt_rows, rows.last_rows
    ([2, 3, 1], [0, 1, 3, 4, 5, 2], [0, 1, 5], [2, 3, 4], [4])
    """
    counts = joining.counts
    trees = dict(zip(running, tree_counts))
    both = sorted(set(trees) & set(joining.slots))
    if both:
        raise ValueError(f"a slot cannot run a tree and join in the same step: slots {both}")
    for b, n in trees.items():
        counts[b] = n
    num_tree = sum(tree_counts)
    next_tree, next_prompt = 0, num_tree
    gather, tree_rows, prompt_rows, last_of = [], [], [], {}
    for b, (start, n) in enumerate(zip(itertools.accumulate([0] + counts), counts)):
        rows = range(start, start + n)
        if b in trees:
            gather.extend(range(next_tree, next_tree + n))
            tree_rows.extend(rows)
            next_tree += n
        elif n:
            gather.extend(range(next_prompt, next_prompt + n))
            prompt_rows.extend(rows)
            next_prompt += n
            last_of[b] = start + n - 1
    return MergedRows(counts, gather, tree_rows, prompt_rows, [last_of[b] for b in joining.slots])


class PromptOutputs(NamedTuple):
    """What a forward gave the joining prompts: per joining request (``Joining.slots`` order) the ``logits``, token
    and ``last_hidden`` features of its last prompt row; every prompt row's ``hidden`` features, slot after slot,
    and their ``q_offsets`` ``[B+1]`` (a ``Prefill``'s)."""

    logits: torch.Tensor
    last_tokens: torch.Tensor
    last_hidden: torch.Tensor
    hidden: torch.Tensor
    q_offsets: torch.Tensor


def prompt_forward(target, cache, joining: Joining, keep_hidden: bool = False) -> PromptOutputs:
    """The joining prompts' own ragged causal forward over ``target``, committed in ``cache``. ``keep_hidden``: the
    features outlive another target forward (a tree step's), which may reuse a CUDA graph's output memory: a copy."""
    counts, device = joining.counts, target.device
    tokens = to_device(joining.tokens(), torch.int64, device)
    q_offsets = offsets_to_device(counts, device)
    cache.reserve(counts)
    positions = causal_positions(q_offsets, cache.seq_lens, tokens.numel())
    ends = list(itertools.accumulate(counts))
    last_rows = to_device([ends[b] - 1 for b in joining.slots], torch.int64, device)
    logits, hidden = target(tokens, positions, AttentionMetadata(q_offsets), cache, logits_rows=last_rows)
    cache.advance(counts)
    last_tokens, last_hidden = tokens.index_select(0, last_rows), hidden.index_select(0, last_rows)
    return PromptOutputs(logits, last_tokens, last_hidden, hidden.clone() if keep_hidden else hidden, q_offsets)


def merged_inputs(rows: MergedRows, tree_tokens: torch.Tensor, joining: Joining) -> tuple[torch.Tensor, torch.Tensor]:
    """The merged forward's tokens and its ``logits_rows``: the trees' nodes, then each prompt's last row."""
    device = tree_tokens.device
    prompts = to_device(joining.tokens(), torch.int64, device)
    tokens = torch.cat((tree_tokens, prompts)).index_select(0, to_device(rows.gather, torch.int64, device))
    return tokens, to_device(rows.tree_rows + rows.last_rows, torch.int64, device)


def split_outputs(rows: MergedRows, tokens, logits_rows, logits, hidden, joining: Joining):
    """The merged forward's outputs split: the trees' ``(logits, hidden)``, and the prompts' ``PromptOutputs``."""
    trees = len(rows.tree_rows)
    last = logits_rows[trees:]
    device = hidden.device
    prompt_hidden = hidden.index_select(0, to_device(rows.prompt_rows, torch.int64, device))
    last_tokens, last_hidden = tokens.index_select(0, last), hidden.index_select(0, last)
    prompts = PromptOutputs(
        logits[trees:], last_tokens, last_hidden, prompt_hidden, offsets_to_device(joining.counts, device)
    )
    return (logits[:trees], hidden.index_select(0, logits_rows[:trees])), prompts
