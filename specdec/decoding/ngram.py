"""Model-free drafts by prompt lookup: continue the text the way it continued before.

For each request, the last n tokens of its history (prompt plus generated text)
are looked up earlier in the same history; the tokens that followed the latest
earlier occurrence become the draft. The longest n from ``max_ngram`` down to
``min_ngram`` that matches wins. Everything runs on the device, for all requests
at once, with fixed shapes: a request without a match still gets ``num_draft``
tokens (its last token repeated), which verification rejects at no risk to
exactness, so no host synchronisation is needed to size the batch.
"""

from __future__ import annotations

import torch

from specdec._transfer import to_device
from specdec.decoding.proposal import Proposal
from specdec.decoding.strategy import BaseStrategy, Prefill, StepContext, StepResult
from specdec.kernels._checks import check_tensor


def propose_ngram(
    history: torch.Tensor, lengths: torch.Tensor, num_draft: int, max_ngram: int = 3, min_ngram: int = 1
) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt-lookup drafts for a batch.

    Parameters
    ----------
    history : ``[B, S]`` int32/int64 token ids; request b's text is ``history[b, :lengths[b]]``.
    lengths : ``[B]`` int32/int64 valid lengths (each at least 1).
    num_draft : tokens to propose per request (K >= 1).
    max_ngram, min_ngram : lengths of the suffix looked up, longest first.

    Returns
    -------
    drafts ``[B, K]`` (dtype of ``history``) and ``matched [B]`` bool (a real match was found).

    Example
    -------
    >>> h = torch.tensor([[5, 6, 7, 8, 5, 6, 0, 0]])
    >>> propose_ngram(h, torch.tensor([6]), 2, max_ngram=2)[0].tolist()
    [[7, 8]]
    """
    check_tensor("history", history, dtype=(torch.int32, torch.int64), ndim=2)
    batch, width = history.shape
    check_tensor("lengths", lengths, dtype=(torch.int32, torch.int64), shape=(batch,), device=history.device)
    if not isinstance(num_draft, int) or num_draft < 1:
        raise ValueError(f"num_draft must be a positive int, got {num_draft!r}")
    if not (isinstance(min_ngram, int) and isinstance(max_ngram, int) and 1 <= min_ngram <= max_ngram):
        raise ValueError(f"need 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram}, max_ngram={max_ngram}")
    lengths = lengths.long()
    device = history.device
    # Where the draft starts in the history: the position right after the matched n-gram.
    start = torch.full((batch,), -1, dtype=torch.long, device=device)
    for n in range(max_ngram, min_ngram - 1, -1):
        if n >= width:
            continue
        found = _latest_match(history, lengths, n)
        start = torch.where(start < 0, found, start)
    matched = start >= 0
    last = (lengths - 1).clamp(min=0)
    # Unmatched requests, and drafts running past the known text, repeat the last token.
    pos = torch.where(matched, start, last).unsqueeze(1) + torch.arange(num_draft, device=device)
    pos = torch.minimum(pos, last.unsqueeze(1))
    return history.gather(1, pos), matched


def _latest_match(history: torch.Tensor, lengths: torch.Tensor, n: int) -> torch.Tensor:
    """[B] index right after the latest earlier occurrence of each request's last n tokens, or -1."""
    batch, width = history.shape
    device = history.device
    suffix_pos = (lengths - n).clamp(min=0).unsqueeze(1) + torch.arange(n, device=device)
    suffix = history.gather(1, suffix_pos)  # [B, n]
    windows = history.unfold(1, n, 1)  # [B, S-n+1, n]: window s covers s .. s+n-1
    equal = (windows == suffix.unsqueeze(1)).all(-1)
    starts = torch.arange(windows.shape[1], device=device)
    # The window must be followed by a known token, which also excludes the suffix itself.
    usable = (starts.unsqueeze(0) + n < lengths.unsqueeze(1)) & (lengths.unsqueeze(1) > n)
    candidates = torch.where(equal & usable, starts + n, torch.full_like(starts, -1))
    return candidates.max(dim=1).values


class NgramStrategy(BaseStrategy):
    """Prompt-lookup drafting for the engine: a chain of ``num_draft`` tokens per request.

    Deterministic drafts (q is one-hot), verified with the deterministic rule. No model,
    no cache: ``attach``, ``prefill``, ``join`` and ``commit`` have nothing to do.
    """

    def __init__(self, num_draft: int = 5, max_ngram: int = 3, min_ngram: int = 1):
        if not isinstance(num_draft, int) or num_draft < 1:
            raise ValueError(f"num_draft must be a positive int, got {num_draft!r}")
        if not (isinstance(min_ngram, int) and isinstance(max_ngram, int) and 1 <= min_ngram <= max_ngram):
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got min_ngram={min_ngram}, max_ngram={max_ngram}")
        self.num_draft, self.max_ngram, self.min_ngram = num_draft, max_ngram, min_ngram

    @property
    def name(self) -> str:
        return f"n-gram (K={self.num_draft}, n<={self.max_ngram})"

    @property
    def max_nodes(self) -> int:
        return self.num_draft + 1

    @property
    def max_depth(self) -> int:
        return self.num_draft

    def attach(self, target) -> None:
        pass

    def prefill(self, prefill: Prefill) -> None:
        pass

    def join(self, prefill: Prefill) -> None:
        pass

    def commit(self, result: StepResult) -> None:
        pass

    def propose(self, step: StepContext) -> Proposal:
        """A chain per request, as long as its depth and node limits allow (at most ``num_draft``)."""
        limits = zip(step.max_depth, step.max_nodes)
        sizes = [1 + min(self.num_draft, max(depth, 0), nodes - 1) for depth, nodes in limits]
        if max(sizes) == 1:  # nothing to draft (e.g. the adaptive controller chose plain decoding): no lookup
            return Proposal(to_device(step.roots, torch.int64, step.device), [[-1]] * len(sizes), rule="deterministic")
        device, width = step.device, max(len(h) for h in step.histories)
        history = to_device([h + [0] * (width - len(h)) for h in step.histories], torch.int64, device)
        lengths = to_device([len(h) for h in step.histories], torch.int64, device)
        drafts, _ = propose_ngram(history, lengths, self.num_draft, self.max_ngram, self.min_ngram)
        tokens = torch.cat((to_device(step.roots, torch.int64, device)[:, None], drafts), dim=1)  # [R, K+1]
        rows = [r * (self.num_draft + 1) + i for r, n in enumerate(sizes) for i in range(n)]
        keep = to_device(rows, torch.int64, device)
        chains = [list(range(-1, n - 1)) for n in sizes]
        return Proposal(tokens.flatten().index_select(0, keep), chains, rule="deterministic")
