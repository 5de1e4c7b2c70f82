"""The fused ops: tensors in, tensors out, no knowledge of models.

Each module holds one op in a fixed order: Triton kernel(s), launcher, registered custom op
(``_op.register_op``: Triton and PyTorch bodies alike, a fake implementation), public
function, readable PyTorch reference. CUDA tensors run the Triton kernels, CPU tensors the
PyTorch bodies (or the C++ op), and TRITON_INTERPRET=1 runs the Triton kernels on the CPU (see
``specdec._backend``). Sampling and verification share their stages: ``top_k_top_p``,
``target_stats``, ``tree_walk`` (where the acceptance rules are derived), ``final_sample``
and ``verification`` (the pipeline).
"""

from specdec.kernels.filtered_probs import FilteredProbs, filtered_probs
from specdec.kernels.kv_append import kv_append
from specdec.kernels.kv_compact import kv_compact
from specdec.kernels.rms_norm import add_rms_norm, rms_norm
from specdec.kernels.rotary import apply_rotary
from specdec.kernels.sample_probs import sample_probs
from specdec.kernels.sampling import SampleResult, run_sample, sample
from specdec.kernels.sampling_params import RULES, SamplingParams
from specdec.kernels.silu_mul import silu_mul
from specdec.kernels.tree_attention import AttentionPlan, plan_attention, run_attention, tree_attention
from specdec.kernels.tree_metadata import TreeMetadata, build_tree_metadata, pack_mask_rows, unpack_mask_rows
from specdec.kernels.uniforms import counter_uniform
from specdec.kernels.verify_chain import ChainVerifyResult, run_verify_chain, verify_chain
from specdec.kernels.verify_greedy import (
    run_verify_chain_greedy,
    run_verify_tree_greedy,
    verify_chain_greedy,
    verify_tree_greedy,
)
from specdec.kernels.verify_tree import TreeVerifyResult, run_verify_tree, verify_tree

__all__ = [
    "AttentionPlan",
    "RULES",
    "ChainVerifyResult",
    "FilteredProbs",
    "SampleResult",
    "SamplingParams",
    "TreeMetadata",
    "TreeVerifyResult",
    "add_rms_norm",
    "apply_rotary",
    "build_tree_metadata",
    "counter_uniform",
    "filtered_probs",
    "kv_append",
    "kv_compact",
    "pack_mask_rows",
    "plan_attention",
    "rms_norm",
    "run_attention",
    "run_sample",
    "run_verify_chain",
    "run_verify_chain_greedy",
    "run_verify_tree",
    "run_verify_tree_greedy",
    "sample",
    "sample_probs",
    "silu_mul",
    "tree_attention",
    "unpack_mask_rows",
    "verify_chain",
    "verify_chain_greedy",
    "verify_tree",
    "verify_tree_greedy",
]
