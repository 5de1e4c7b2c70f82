"""LLaMA-style model, its config, the checkpoint loader, the KV cache, the draft heads and the parallel draft."""

from specdec.model.attention_metadata import AttentionMetadata, causal_positions, tree_positions
from specdec.model.block_allocator import BlockAllocator
from specdec.model.config import ModelConfig, RopeScaling
from specdec.model.eagle import EagleHead
from specdec.model.eagle3 import Eagle3Head
from specdec.model.kv_cache import KVCache
from specdec.model.llama import LlamaModel
from specdec.model.medusa import MedusaHeads
from specdec.model.paged_blocks import PagedBlocks
from specdec.model.parallel_draft import ParallelDraft
from specdec.model.parallel_eagle import ParallelEagleHead

__all__ = [
    "AttentionMetadata",
    "BlockAllocator",
    "Eagle3Head",
    "EagleHead",
    "KVCache",
    "LlamaModel",
    "MedusaHeads",
    "ModelConfig",
    "PagedBlocks",
    "ParallelDraft",
    "ParallelEagleHead",
    "RopeScaling",
    "causal_positions",
    "tree_positions",
]
