"""What EAGLE heads share at run time (``EagleHead``, ``Eagle3Head``): their dtype and device, the rotary rows and
the KV cache of their decoder layer, and the checks of a head forward's arguments."""

from __future__ import annotations

import torch
from torch import nn

from specdec.kernels._checks import check_tensor
from specdec.model.attention_metadata import AttentionMetadata
from specdec.model.forward_plan import INDEX_DTYPES
from specdec.model.kv_cache import KVCache
from specdec.model.llama import config_cache


class DraftHead(nn.Module):
    """Base of the EAGLE heads: a subclass defines ``config``, ``fc``, ``lm_head_weight``, ``_layer_params``,
    ``rope_inv_freq`` and ``_rotary`` (``block.RotaryRows``)."""

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    def linear_weights(self) -> list[torch.Tensor]:
        """Every linear layer's weight: fc's, each layer's (qkv, o, gate/up, down), the LM head's
        (``SpeculativeDecoder`` makes their CPU packs when it is built, as for its models)."""
        layers = [getattr(p, name)["weight"] for p in self._layer_params for name in ("qkv", "o", "gate_up", "down")]
        return [self.fc.weight, *layers, self.lm_head_weight]

    def rotary_rows(self, positions: torch.Tensor, max_position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[T, 1, D]`` of ``positions`` below ``max_position`` (the forward plan asks for them)."""
        return self._rotary(positions, max_position, self.rope_inv_freq, self.dtype)

    def new_cache(self, batch_size: int, max_len: int, **layout) -> KVCache:
        """The head's own ``KVCache`` (``layout``: layout=, block_size=, num_blocks=, as for the target's)."""
        return config_cache(self.config, batch_size, max_len, self.dtype, self.device, **layout)

    def check_forward(self, features, tokens, positions, metadata, logits_rows) -> int:
        """A head forward's argument checks (``EagleHead.forward``'s parameters); returns its row count. The
        forward plan (or the C++ op) checks the rest against the cache."""
        device, hidden = self.device, self.config.hidden_size
        check_tensor("features", features, dtype=self.dtype, ndim=2, device=device)
        num_rows = features.shape[0]
        if features.shape[1] != hidden:
            raise ValueError(f"features must have shape ({num_rows}, {hidden}), got {tuple(features.shape)}")
        check_tensor("tokens", tokens, dtype=INDEX_DTYPES, shape=(num_rows,), device=device)
        check_tensor("positions", positions, dtype=INDEX_DTYPES, shape=(num_rows,), device=device)
        if not isinstance(metadata, AttentionMetadata):
            raise TypeError(f"metadata must be an AttentionMetadata, got {type(metadata).__name__}")
        if logits_rows is not None:
            check_tensor("logits_rows", logits_rows, dtype=INDEX_DTYPES, ndim=1, device=device)
        return num_rows
