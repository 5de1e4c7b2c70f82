"""Speculative decoding: strategies and the engine loop (propose, verify, compact, emit).

``SpeculativeDecoder(target, strategy)`` runs batched generation; the strategy is
``None`` (plain autoregressive decoding), ``DraftModelStrategy`` (a draft model's chain
or token tree) or ``NgramStrategy`` (prompt lookup).
"""

from specdec.decoding.draft_model import DraftModelStrategy
from specdec.decoding.engine import (
    GenerationResult,
    RequestStats,
    SpeculativeDecoder,
    StepOutput,
    check_same_vocabulary,
)
from specdec.decoding.ngram import NgramStrategy, propose_ngram

__all__ = [
    "DraftModelStrategy",
    "GenerationResult",
    "NgramStrategy",
    "RequestStats",
    "SpeculativeDecoder",
    "StepOutput",
    "check_same_vocabulary",
    "propose_ngram",
]
