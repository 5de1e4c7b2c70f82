"""HuggingFace checkpoint names <-> the model's fused projections.

On disk (and in transformers) every layer has separate ``self_attn.{q,k,v}_proj`` and
``mlp.{gate,up}_proj`` linear layers. The model holds one ``self_attn.qkv_proj`` (weight
``cat(q, k, v)`` along the output dimension, bias likewise when the config has one) and one
``mlp.gate_up_proj`` (``cat(gate, up)``), so each is a single GEMM; the forward splits the
outputs with views. Loading fuses the checkpoint's tensors, ``split`` gives them back under
their HuggingFace names (views, no copy), and ``checkpoint_shapes`` says which tensors a
checkpoint must hold, with their shapes, for the loader to check by name.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from specdec.model.config import ModelConfig

# fused module -> the checkpoint's modules, in the order their outputs are concatenated
FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}


def part_sizes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Output rows of each part of each fused module (q, k, v; gate, up)."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    return {
        "self_attn.qkv_proj": (q, kv, kv),
        "mlp.gate_up_proj": (config.intermediate_size, config.intermediate_size),
    }


def checkpoint_shapes(model_shapes: Mapping[str, tuple[int, ...]], config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor name -> shape, from the model's own parameter names and shapes.

    Example
    -------
    >>> config = ModelConfig(vocab_size=8, hidden_size=4, intermediate_size=6, num_layers=1, num_heads=2,
    ...                      num_kv_heads=1, head_dim=2)
    >>> shapes = checkpoint_shapes({"model.layers.0.self_attn.qkv_proj.weight": (8, 4)}, config)
    >>> for name, shape in shapes.items():
    ...     print(name, shape)
    model.layers.0.self_attn.q_proj.weight (4, 4)
    model.layers.0.self_attn.k_proj.weight (2, 4)
    model.layers.0.self_attn.v_proj.weight (2, 4)
    """
    sizes = part_sizes(config)
    out = {}
    for name, shape in model_shapes.items():
        fused = _fused_part(name)
        if fused is None:
            out[name] = tuple(shape)
            continue
        prefix, module, suffix = fused
        for part, rows in zip(FUSED[module], sizes[module]):
            out[prefix + part + suffix] = (rows, *tuple(shape)[1:])
    return out


def fuse(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HuggingFace-named tensors -> the model's names: each fused module's parts concatenated (rows)."""
    out = dict(tensors)
    for name in list(out):
        for module, parts in FUSED.items():
            first = f".{parts[0]}."
            if first not in name:
                continue
            start = name.index(first) + 1
            prefix, suffix = name[:start], name[start + len(parts[0]) :]
            names = [prefix + part + suffix for part in parts]
            if all(n in out for n in names):
                out[prefix + module + suffix] = torch.cat([out.pop(n) for n in names], dim=0)
    return out


def split(state: Mapping[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """The model's tensors under the checkpoint's names: fused ones split into views of their rows."""
    sizes = part_sizes(config)
    out = {}
    for name, tensor in state.items():
        fused = _fused_part(name)
        if fused is None:
            out[name] = tensor
            continue
        prefix, module, suffix = fused
        for part, view in zip(FUSED[module], tensor.split(sizes[module], dim=0)):
            out[prefix + part + suffix] = view
    return out


def _fused_part(name: str) -> tuple[str, str, str] | None:
    """(prefix, fused module, suffix) when ``name`` is a parameter of a fused module, else None."""
    for module in FUSED:
        marker = f".{module}."
        if marker in name:
            start = name.index(marker) + 1
            return name[:start], module, name[start + len(module) :]
    return None
