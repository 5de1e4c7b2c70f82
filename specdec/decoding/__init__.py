"""Speculative decoding strategies and the engine loop (propose, verify, compact, emit)."""
