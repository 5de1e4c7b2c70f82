"""Triton when a supported version is installed; stand-ins otherwise, so the kernel modules still import.

Without a usable Triton (missing, or older than ``specdec._backend.MIN_TRITON``) ``select_backend``
always picks the PyTorch paths, so the kernels defined with ``jit`` are never launched; the
stand-in ``tl`` only has to let their signatures (``BLOCK: tl.constexpr``) be evaluated. An old
Triton is refused here, at the import of the kernel modules, with a warning that names the
installed and the required versions.
"""

import warnings

from specdec import _backend

_usable, _detail = _backend.triton_status()
if _usable:
    import triton
    import triton.language as tl
else:
    if not _detail.startswith("triton does not import"):
        warnings.warn(f"specdec: {_detail}", RuntimeWarning, stacklevel=2)
    triton = None

    class tl:  # noqa: N801  (stands in for triton.language)
        constexpr = int


if triton is not None:

    class _Constant(tl.constexpr):
        """A ``tl.constexpr`` that compares with another of its kind as a plain value. Before every launch Triton
        compares each global a kernel reads with the copy it made at compile time, and ``constexpr``'s own ``!=``
        builds a new constexpr each time (bench/RESULTS.md, "Host time of the public ops")."""

        def __ne__(self, other):
            if type(other) is _Constant:
                return self.value != other.value
            return super().__ne__(other)


def constant(value):
    """A module-level constant kernels may read (Triton's JIT reads only constexpr globals)."""
    return _Constant(value) if triton is not None else value


# Sentinel for "no index" in min-reductions over int32 indices (any real index is smaller).
INT32_MAX = constant(2147483647)


def jit(fn=None, *, do_not_specialize=()):
    """``triton.jit`` (compiled, or interpreted under TRITON_INTERPRET=1), or the plain function.

    ``do_not_specialize``: integer arguments the JIT must not turn into constants when they equal 1
    (code folded around such a constant can break a Triton version's compiler)."""
    if fn is None:
        return lambda f: jit(f, do_not_specialize=do_not_specialize)
    if triton is None:
        return fn
    return triton.jit(fn, do_not_specialize=list(do_not_specialize)) if do_not_specialize else triton.jit(fn)


def next_power_of_2(n: int) -> int:
    """``triton.next_power_of_2`` on the host (the smallest power of two >= n, 0 for 0): Triton's is a
    constexpr function whose host calls cost microseconds, and launchers call it on every launch."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints, on the host (as ``next_power_of_2``)."""
    return -(-a // b)
