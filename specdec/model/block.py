"""The LLaMA decoder block run under a forward's plan: what ``LlamaModel`` and the draft heads share.

Per layer, op bodies chosen once (``forward_plan.LAYER_OPS``), no checks, no dispatch:

    x_in  = RMSNorm(residual)                         (layer 0; later layers get it fused below)
    q,k,v = x_in @ W_qkv                              one GEMM, heads as views
    q,k   = RoPE(q, k)                                one op on the Triton path; 4 on the PyTorch path
    cache[layer] <- k, v                              the K/V write (the plan's rows / kv_append)
    a     = tree_attention(q, cache[layer])
    residual += a @ W_o;  x = RMSNorm(residual)       add_rms_norm: one op
    x     = silu(x @ W_gate) * (x @ W_up)             one GEMM, silu_mul
    residual += x @ W_down;  x_in = RMSNorm(residual) add_rms_norm with the next layer's (or the final) norm

Weights are read from the modules' ``_parameters`` dicts (``LayerParams``): always the current
tensors (loading swaps entries, not dicts), without the cost of an ``nn.Module`` attribute
lookup (a forward would make a hundred).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from specdec.kernels.rotary import rotary_table, rotate
from specdec.model.cpu_linear import linear_for
from specdec.model.forward_plan import LAYER_OPS, ForwardPlan, write_kv


class LayerParams(NamedTuple):
    """One decoder layer's modules' ``_parameters`` dicts (``["weight"]``, ``["bias"]``)."""

    input_norm: dict
    qkv: dict
    o: dict
    post_norm: dict
    gate_up: dict
    down: dict


def layer_params(layers) -> list[LayerParams]:
    """``LayerParams`` of each ``DecoderLayer`` (modules are looked up once, here)."""
    return [
        LayerParams(*(m._parameters for m in (
            layer.input_layernorm, layer.self_attn.qkv_proj, layer.self_attn.o_proj,
            layer.post_attention_layernorm, layer.mlp.gate_up_proj, layer.mlp.down_proj,
        )))  # fmt: skip
        for layer in layers
    ]


class RotaryRows:
    """RoPE's cos / sin for a forward's positions, gathered from a table kept per model (``rotary_table``;
    rebuilt when a larger bound, another ``inv_freq`` or dtype comes): one op per forward."""

    def __init__(self):
        self._inv_freq, self._table = None, None

    def __call__(self, positions, max_position: int, inv_freq, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin ``[T, 1, D]`` of ``positions``, all below the host bound ``max_position``."""
        rows = self.table(max_position, inv_freq, dtype).index_select(0, positions)
        return rows[:, 0], rows[:, 1]

    def table(self, max_position: int, inv_freq, dtype) -> torch.Tensor:
        """The ``[P, 2, 1, D]`` table (``rotary_table``) of at least positions 0 .. ``max_position`` - 1."""
        table = self._table
        if self._inv_freq is not inv_freq or table.shape[0] < max_position or table.dtype != dtype:
            table = self._table = rotary_table(max_position, inv_freq, dtype)
            self._inv_freq = inv_freq
        return table


def run_layers(
    layers: list[LayerParams],
    residual: torch.Tensor,
    plan: ForwardPlan,
    config,
    inv_freq: torch.Tensor,
    *,
    first_norm: bool = True,
    final_norm: dict | None = None,
    first_input: torch.Tensor | None = None,
    taps: tuple[int, ...] = (),
    tapped: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run ``residual [T, hidden]`` (updated in place: the residual stream) through ``layers`` under ``plan``.

    ``first_norm``: layer 0 normalises its input (EAGLE's layer 0 does not). ``first_input``: layer 0's
    attention input, given by the caller in place of its (normalised) residual (EAGLE-3's ``[T, 2 * hidden]``).
    ``taps``: layers whose incoming residual stream is copied into ``tapped [T, len(taps) * hidden]`` (slot i
    for ``taps[i]``) as the loop reaches them (EAGLE-3 reads the target's low, middle and high layers). Returns
    RMSNorm of the last residual with ``final_norm``'s weight, or, without one, the residual stream itself.
    """
    compiling = torch.compiler.is_compiling()
    ops = LAYER_OPS[plan.backend, compiling]
    T, H, Hkv, D, eps = residual.shape[0], config.num_heads, config.num_kv_heads, config.head_dim, config.rms_norm_eps
    normed = torch.empty_like(residual)  # each norm's output, consumed by the next GEMM
    attn = residual.new_empty(T, H, D)
    act = residual.new_empty(T, config.intermediate_size)
    if first_norm and first_input is None:
        ops.rms_norm(residual, layers[0].input_norm["weight"], eps, normed)
    x_in = first_input if first_input is not None else normed if first_norm else residual
    cache = plan.cache
    linear = linear_for(residual)  # multi-row CPU forwards: packed oneDNN GEMMs
    width = residual.shape[1]
    for l, p in enumerate(layers):
        for slot, layer in enumerate(taps):
            if layer == l:  # the stream entering layer l: copied before the layer adds to it in place
                tapped[:, slot * width : (slot + 1) * width].copy_(residual)
        qkv = linear(x_in, p.qkv["weight"], p.qkv["bias"]).view(T, H + 2 * Hkv, D)  # heads: q | k | v
        qk, v = qkv.split_with_sizes((H + Hkv, Hkv), dim=1)
        if plan.rotary is None:  # Triton: rotate q and k in place, as views of the projection
            q, k = qk.split_with_sizes((H, Hkv), dim=1)
            ops.rotary(q, k, plan.positions, inv_freq)
        else:  # PyTorch: q and k rotate as one [T, Hq + Hkv, D] view, with the plan's cos / sin
            q, k = rotate(qk, *plan.rotary).split_with_sizes((H, Hkv), dim=1)
        # per-layer views made once by the cache; inside torch.compile the cache enters as one tensor
        k_cache, v_cache = (cache.data[l, 0], cache.data[l, 1]) if compiling else cache.views[l]
        write_kv(ops, plan, l, k, v, compiling)
        ops.attention(q, k_cache, v_cache, *plan.attention_args, attn, None)
        o = linear(attn.view(T, H * D), p.o["weight"], p.o["bias"])
        ops.add_rms_norm(o, residual, p.post_norm["weight"], eps, normed)  # residual += o
        gate_up = linear(normed, p.gate_up["weight"], p.gate_up["bias"])
        ops.silu_mul(gate_up, act)
        down = linear(act, p.down["weight"], p.down["bias"])
        norm = layers[l + 1].input_norm if l + 1 < len(layers) else final_norm
        if norm is None:  # the last layer, no final norm
            residual += down
            return residual
        ops.add_rms_norm(down, residual, norm["weight"], eps, normed)  # the next layer's input, or the final norm
        x_in = normed
    return normed
