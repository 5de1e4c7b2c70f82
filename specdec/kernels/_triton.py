"""Triton when it is installed; stand-ins otherwise, so the kernel modules still import.

Without Triton ``select_backend`` always picks the PyTorch references, so the kernels
defined with ``jit`` are never launched; the stand-in ``tl`` only has to let their
signatures (``BLOCK: tl.constexpr``) be evaluated.
"""

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

    class tl:  # noqa: N801  (stands in for triton.language)
        constexpr = int


# Sentinel for "no index" in min-reductions over int32 indices (any real index is smaller).
INT32_MAX = tl.constexpr(2147483647) if triton is not None else 2147483647


def jit(fn):
    """``triton.jit`` (compiled, or interpreted under TRITON_INTERPRET=1), or the plain function."""
    return triton.jit(fn) if triton is not None else fn
