"""Speculative decoding: the strategy contract, the strategies, and the engine loop.

``SpeculativeDecoder(target, strategy)`` runs batched generation with any ``Strategy``
(``specdec.decoding.strategy``: the contract and how to add a drafter): ``NoDraft`` (plain
autoregressive decoding; also what ``strategy=None`` means), ``DraftModelStrategy`` (a draft
model's chain or token tree) or ``NgramStrategy`` (prompt lookup). By default the decoder adapts
each request's draft depth every step (``AdaptiveSpeculation``, ``specdec.decoding.adaptive``).
"""

from specdec.decoding.adaptive import AdaptiveSpeculation
from specdec.decoding.draft_model import DraftModelStrategy
from specdec.decoding.engine import SpeculativeDecoder
from specdec.decoding.ngram import NgramStrategy, propose_ngram
from specdec.decoding.proposal import Proposal
from specdec.decoding.requests import FINISH_REASONS
from specdec.decoding.results import GenerationResult, RequestStats, StepOutput
from specdec.decoding.strategy import (
    NoDraft,
    Prefill,
    StepContext,
    StepResult,
    Strategy,
    check_same_vocabulary,
)

__all__ = [
    "AdaptiveSpeculation",
    "FINISH_REASONS",
    "DraftModelStrategy",
    "GenerationResult",
    "NgramStrategy",
    "NoDraft",
    "Prefill",
    "Proposal",
    "RequestStats",
    "SpeculativeDecoder",
    "StepContext",
    "StepOutput",
    "StepResult",
    "Strategy",
    "check_same_vocabulary",
    "propose_ngram",
]
