"""The fused ops: tensors in, tensors out, no knowledge of models.

Each module holds one op in a fixed order: Triton kernel(s), launcher, registered custom op
(``_op.register_op``: Triton and PyTorch bodies alike, a fake implementation), public
function, readable PyTorch reference. CUDA tensors run the Triton kernels, CPU tensors the
PyTorch bodies (or the C++ op), and TRITON_INTERPRET=1 runs the Triton kernels on the CPU (see
``specdec._backend``). Sampling and verification share their stages: ``top_k_top_p``,
``target_stats``, ``tree_walk`` (where the acceptance rules are derived), ``final_sample``
and ``verification`` (the pipeline).

One entry point per op, plus the registered op. The public function checks every argument (errors
name it). The verification, sampling and attention ops take ``check=False`` for a hot path whose
inputs are valid by construction or were checked on the host: no check at all, ``out``'s included;
the host bounds a checked call derives from the values (``max_draft_len``, ``max_depth``,
``tree_attention``'s ``plan``) are then required, and each docstring says what else must hold
(contiguous index tensors). It calls the body for the tensors' device without the dispatcher (the
registered op inside ``torch.compile``). ``tree_attention``'s ``check_bounds`` is narrower: whether a
checked call also checks index values (a synchronisation on CUDA). The layer ops (norms, rotary,
SiLU, K/V writes) take no such keyword: a model's forward calls their registered op's bodies
(``<op>_op.body(backend)`` or ``<op>_op.run``, see ``_op``); the registered op is also what
``torch.compile``, ``opcheck`` and CUDA graphs see.
"""

from specdec.kernels.filtered_probs import FilteredProbs, filtered_probs
from specdec.kernels.kv_append import kv_append
from specdec.kernels.kv_compact import kv_compact
from specdec.kernels.rms_norm import add_rms_norm, rms_norm
from specdec.kernels.rotary import apply_rotary
from specdec.kernels.sample_probs import sample_probs
from specdec.kernels.sampling import SampleResult, sample
from specdec.kernels.sampling_params import RULES, SamplingParams
from specdec.kernels.silu_mul import silu_mul
from specdec.kernels.tree_attention import AttentionPlan, plan_attention, tree_attention
from specdec.kernels.tree_metadata import TreeMetadata, build_tree_metadata, pack_mask_rows, unpack_mask_rows
from specdec.kernels.uniforms import counter_uniform
from specdec.kernels.verify_chain import ChainVerifyResult, verify_chain
from specdec.kernels.verify_greedy import verify_chain_greedy, verify_tree_greedy
from specdec.kernels.verify_tree import TreeVerifyResult, verify_tree

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
