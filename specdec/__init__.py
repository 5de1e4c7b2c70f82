"""specdec: speculative decoding with fused Triton kernels.

Layers (each imports only the ones below it): ``specdec.decoding`` (strategies and
the engine loop), ``specdec.model`` (LLaMA-style model, KV cache, checkpoint
loader), ``specdec.kernels`` (the fused ops: tensors in, tensors out) and the
optional compiled extension ``specdec._C``. Importing specdec compiles nothing
and needs no GPU.
"""

from specdec._backend import row_invariant, select_backend, set_row_invariant, use_backend

__version__ = "0.1.0"
__all__ = ["__version__", "row_invariant", "select_backend", "set_row_invariant", "use_backend"]
