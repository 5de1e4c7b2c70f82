"""LLaMA-style model, its config, the HuggingFace checkpoint loader and the KV cache."""

from specdec.model.attention_metadata import AttentionMetadata, causal_positions, tree_positions
from specdec.model.block_allocator import BlockAllocator
from specdec.model.config import ModelConfig, RopeScaling
from specdec.model.kv_cache import KVCache
from specdec.model.llama import LlamaModel

__all__ = [
    "AttentionMetadata",
    "BlockAllocator",
    "KVCache",
    "LlamaModel",
    "ModelConfig",
    "RopeScaling",
    "causal_positions",
    "tree_positions",
]
