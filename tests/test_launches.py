"""Kernel launches per decoder layer, counted on the CPU with the Triton path interpreted (``launch_counter``)."""


import pytest
from count_launches import TREE_16, forward_launches, per_layer
from helpers import tiny_config

from specdec._backend import interpreter_enabled

pytestmark = pytest.mark.skipif(not interpreter_enabled(), reason="counts the interpreted Triton path (CPU)")
CONFIG = tiny_config(num_heads=4, num_kv_heads=2)
# One fused op per step of the block: (add +) RMSNorm x 2, QKV / o / gate-up / down GEMMs, RoPE on q and k,
# the K/V write, attention, SwiGLU. (On a GPU a split context adds one merge launch to the attention: 11.)
PER_LAYER = {
    "_rms_norm_kernel": 2, "linear": 4, "_rotary_kernel": 1, "kv_append_kernel": 1, "tree_attention_kernel": 1,
    "_silu_mul_kernel": 1,
}  # fmt: skip


@pytest.mark.parametrize("parents", [[-1], list(range(-1, 5)), TREE_16], ids=["decode", "chain", "tree"])
@pytest.mark.parametrize("batch", [1, 3])
def test_a_decoder_layer_launches_ten_kernels(parents, batch):
    layer = per_layer(CONFIG, parents, batch)
    assert dict(layer) == PER_LAYER, f"per layer: {dict(layer)}"
    assert sum(layer.values()) <= 12


def test_a_forward_launches_its_layers_plus_three():
    # embedding, the first layer's RMSNorm (later ones are fused with the residual add), the logits GEMM
    counter = forward_launches(CONFIG, [-1, 0, 0, 1], batch=2)
    assert counter.total == CONFIG.num_layers * sum(PER_LAYER.values()) + 3, dict(counter.triton + counter.aten)
