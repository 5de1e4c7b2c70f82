"""LLaMA-style model, its config, the HuggingFace checkpoint loader and the KV cache."""

from specdec.model.kv_cache import BlockAllocator, KVCache

__all__ = ["BlockAllocator", "KVCache"]
