"""Speculative decoding: the strategy contract, the strategies, and the engine loop.

``SpeculativeDecoder(target, strategy)`` runs batched generation with any ``Strategy``
(``specdec.decoding.strategy``: the contract and how to add a drafter): ``NoDraft`` (plain
autoregressive decoding; also what ``strategy=None`` means), ``DraftModelStrategy`` (a draft
model's chain or token tree), ``ParallelDraftStrategy`` (a parallel draft model's chain or best-first
tree, one draft forward per step), ``ParallelEagleStrategy`` (the same shapes from one forward of a parallel EAGLE
head), ``MedusaStrategy`` (Medusa heads on the target, a static tree),
``EagleStrategy`` (an EAGLE or EAGLE-3 head's static or dynamic tree) or ``NgramStrategy`` (prompt lookup).
``StaticTree`` turns top-k index paths into a tree. By default the decoder adapts each request's
draft depth every step (``AdaptiveSpeculation``, ``specdec.decoding.adaptive``).
``SpeculativeDecoder.engine`` gives the step API a serving loop drives (``Engine``, ``specdec.decoding.serving``:
requests join and leave a running batch between steps).
"""

from specdec.decoding.adaptive import AdaptiveSpeculation
from specdec.decoding.draft_model import DraftModelStrategy
from specdec.decoding.eagle import EagleStrategy
from specdec.decoding.engine import SpeculativeDecoder
from specdec.decoding.medusa import MedusaStrategy
from specdec.decoding.ngram import NgramStrategy, propose_ngram
from specdec.decoding.parallel_draft import ParallelDraftStrategy
from specdec.decoding.parallel_eagle import ParallelEagleStrategy
from specdec.decoding.proposal import DeviceTrees, Proposal
from specdec.decoding.requests import FINISH_REASONS
from specdec.decoding.results import GenerationResult, RequestStats, StepOutput
from specdec.decoding.serving import Engine
from specdec.decoding.static_tree import StaticTree
from specdec.decoding.strategy import (
    BaseStrategy,
    NoDraft,
    Prefill,
    StepContext,
    StepResult,
    Strategy,
    check_same_vocabulary,
)

__all__ = [
    "AdaptiveSpeculation",
    "BaseStrategy",
    "FINISH_REASONS",
    "DeviceTrees",
    "DraftModelStrategy",
    "EagleStrategy",
    "Engine",
    "GenerationResult",
    "MedusaStrategy",
    "NgramStrategy",
    "NoDraft",
    "ParallelDraftStrategy",
    "ParallelEagleStrategy",
    "Prefill",
    "Proposal",
    "RequestStats",
    "SpeculativeDecoder",
    "StaticTree",
    "StepContext",
    "StepOutput",
    "StepResult",
    "Strategy",
    "check_same_vocabulary",
    "propose_ngram",
]
