"""LLaMA-style model, its config, the HuggingFace checkpoint loader and the KV cache."""
