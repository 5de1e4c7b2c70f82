"""Backend selection: which implementation of an op runs for given tensors.

Rules:
  * CUDA tensors run the Triton kernel (the PyTorch reference if Triton is missing);
  * CPU tensors run the PyTorch reference, or the C++ op where one exists;
  * with ``TRITON_INTERPRET=1`` CPU tensors run the Triton kernels through Triton's
    interpreter, which is how kernels are tested on machines without a GPU.

``SPECDEC_BACKEND=triton|torch`` (or the ``use_backend`` context manager, which
wins over the variable) forces one path; ``auto`` or unset applies the rules. The
variable is read once, at the first op call (a read of the environment on every call
is host time each op would pay); ``use_backend`` switches within a process.
Nothing here compiles code or touches a GPU at import time.

``SPECDEC_ROW_INVARIANT=1`` (or ``set_row_invariant(True)``, which wins over the variable) makes the CPU's float32
forward row-invariant: a row's logits are the same bits in a forward of any number of rows (a decode step, a
chain's or a tree's verification, a batch), so a seeded request's tokens never depend on its drafter or its batch.
Every linear layer then runs the extension's skinny-GEMM kernel in one summation order per row, and attention
the extension's kernel one query row at a time over exactly the positions that row sees (``cpu_linear``,
``kernels.cpu_attention``); slower than the default choice of paths. It needs the extension (an error names the
variable otherwise) and covers eager forwards: ``torch.compile`` graphs, autograd and Triton's interpreter keep
their own paths.

Triton older than ``MIN_TRITON`` counts as missing: its kernels are refused (forcing
them raises an error naming the installed and the required version) and every op runs
its PyTorch path. Versions from 3.6 to 3.9 are tested; newer ones are used as they come.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import re
import threading

import torch

BACKEND_ENV = "SPECDEC_BACKEND"
BACKENDS = ("auto", "triton", "torch")
ROW_INVARIANT_ENV = "SPECDEC_ROW_INVARIANT"
MIN_TRITON = (3, 6)  # the oldest Triton the kernels support (torch 2.10 and 2.11 wheels pin 3.6)
TESTED_TRITON = "3.6 to 3.9"

_forced = threading.local()
_env_backend: str | None = None  # SPECDEC_BACKEND as read at the first op call
_row_invariant: bool | None = None  # set_row_invariant's choice; None follows the variable
_env_row_invariant: bool | None = None  # the variable as last read (None: read it at the next forward)


def interpreter_enabled() -> bool:
    """True when Triton kernels run on the CPU through Triton's interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def triton_status() -> tuple[bool, str]:
    """(usable, version or the reason it is not): importable and not older than MIN_TRITON."""
    try:
        triton = importlib.import_module("triton")
    except Exception as exc:  # ImportError, or a broken install raising anything
        return False, f"triton does not import: {exc}"
    version = getattr(triton, "__version__", "unknown")
    if version_tuple(version) < MIN_TRITON:
        required = ".".join(map(str, MIN_TRITON))
        return False, (
            f"triton {version} is installed but specdec's kernels need triton >= {required} (tested: "
            f"{TESTED_TRITON}); the PyTorch paths are used instead (pip install 'triton>={required}')"
        )
    return True, version


def version_tuple(version: str) -> tuple[int, int]:
    """(major, minor) of a version string such as '3.6.0' or '3.9.0+git1234'; (0, 0) if unreadable."""
    found = re.match(r"(\d+)\.(\d+)", version)
    return (int(found.group(1)), int(found.group(2))) if found else (0, 0)


@functools.cache
def extension_status() -> tuple[object | None, str]:
    """(the loaded ``specdec._C`` module or None, a description or the reason)."""
    if os.environ.get("SPECDEC_DISABLE_EXTENSION", "0") not in ("", "0"):
        return None, "disabled by SPECDEC_DISABLE_EXTENSION"
    try:
        module = importlib.import_module("specdec._C")
    except ImportError as exc:
        return None, f"specdec._C is not built ({exc}); run `pip install --no-build-isolation -e .`"
    has_cuda = torch._C._dispatch_has_kernel_for_dispatch_key("specdec::tree_metadata", "CUDA")
    return module, "CPU and CUDA" if has_cuda else "CPU only"


def extension_has_op(name: str, dispatch_key: str | None = "CPU", arguments: tuple[str, ...] = ()) -> bool:
    """The loaded extension defines ``specdec::name`` with a kernel for ``dispatch_key`` (None: any, e.g. an op defined
    with its one function) and every argument named in ``arguments`` (an extension built before the op, or the
    argument, was added has not: then its callers take their PyTorch paths)."""
    if extension_status()[0] is None or not hasattr(torch.ops.specdec, name):
        return False
    qualified = f"specdec::{name}"
    if dispatch_key is not None and not torch._C._dispatch_has_kernel_for_dispatch_key(qualified, dispatch_key):
        return False
    names = {a.name for a in getattr(torch.ops.specdec, name).default._schema.arguments}
    return all(a in names for a in arguments)


@functools.cache
def extension_function(name: str):
    """The extension module's plain CPython function ``name`` (the adaptive controller's host loops: arguments and
    results are Python objects, no dispatcher), or None where the extension, or that function, is not built."""
    return getattr(extension_status()[0], name, None)


def extension_has_cuda() -> bool:
    return extension_has_op("tree_metadata", "CUDA")


def forced_backend() -> str:
    """The backend forced by ``use_backend`` or ``SPECDEC_BACKEND`` ('auto' if none; the variable read once)."""
    global _env_backend
    name = getattr(_forced, "name", None)
    if name:
        return name
    if _env_backend is None:
        name = os.environ.get(BACKEND_ENV, "auto") or "auto"
        if name not in BACKENDS:
            raise ValueError(f"{BACKEND_ENV} must be one of {BACKENDS}, got {name!r}")
        _env_backend = name
    return _env_backend


@contextlib.contextmanager
def use_backend(name: str):
    """Force ``name`` ('triton', 'torch' or 'auto') for ops called inside the block."""
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    previous = getattr(_forced, "name", None)
    _forced.name = name
    try:
        yield
    finally:
        _forced.name = previous


def set_row_invariant(enabled: bool | None) -> None:
    """Turn the row-invariant CPU forward (the module docstring) on or off for later forwards; ``None`` follows
    ``SPECDEC_ROW_INVARIANT`` again, read anew at the next forward."""
    global _row_invariant, _env_row_invariant
    _row_invariant = None if enabled is None else bool(enabled)
    _env_row_invariant = None


def row_invariant() -> bool:
    """``set_row_invariant``'s choice, else ``SPECDEC_ROW_INVARIANT`` (``1`` on; ``0``, empty or unset off; anything
    else refused with an error naming it), read once and kept until ``set_row_invariant`` is called."""
    global _env_row_invariant
    if _row_invariant is not None:
        return _row_invariant
    if _env_row_invariant is None:
        value = os.environ.get(ROW_INVARIANT_ENV, "").strip()
        if value not in ("", "0", "1"):
            raise ValueError(f"{ROW_INVARIANT_ENV} must be 1 (on) or 0 (off, as when unset), got {value!r}")
        _env_row_invariant = value == "1"
    return _env_row_invariant


def select_backend(*tensors: torch.Tensor) -> str:
    """'triton' or 'torch' for an op whose inputs are ``tensors``."""
    for t in tensors:
        if t is not None and t.is_cuda:
            return backend_for(True)
    return backend_for(False)


def backend_for(on_cuda: bool) -> str:
    """``select_backend``'s answer for inputs on CUDA (``on_cuda``) or on the CPU."""
    triton_ok, why = triton_status()
    forced = forced_backend()
    if forced == "torch":
        return "torch"
    if forced == "triton":
        if not triton_ok:
            raise RuntimeError(f"the triton backend was forced but {why}")
        if not on_cuda and not interpreter_enabled():
            raise RuntimeError(
                "the triton backend was forced for CPU tensors; set TRITON_INTERPRET=1 "
                "before importing specdec to run Triton kernels on the CPU"
            )
        return "triton"
    if on_cuda:
        return "triton" if triton_ok else "torch"
    return "triton" if (triton_ok and interpreter_enabled()) else "torch"


def backend_report() -> list[tuple[str, bool, str]]:
    """(backend, available, detail) for every backend, for ``python -m specdec info``."""
    triton_ok, triton_detail = triton_status()
    cuda_ok = torch.cuda.is_available()
    module, ext_detail = extension_status()
    rows = []
    if not triton_ok:
        rows.append(("triton (GPU)", False, triton_detail))
    elif not cuda_ok:
        rows.append(("triton (GPU)", False, "no CUDA device visible to torch"))
    else:
        rows.append(("triton (GPU)", True, f"triton {triton_detail} on {torch.cuda.get_device_name()}"))
    if not triton_ok:
        rows.append(("triton interpreter (CPU)", False, triton_detail))
    elif interpreter_enabled():
        rows.append(("triton interpreter (CPU)", True, "TRITON_INTERPRET=1 is set"))
    else:
        rows.append(("triton interpreter (CPU)", False, "available; set TRITON_INTERPRET=1 to use it"))
    rows.append(("extension specdec._C (CPU)", module is not None, ext_detail))
    if module is None:
        rows.append(("extension specdec._C (CUDA)", False, ext_detail))
    elif extension_has_cuda():
        rows.append(("extension specdec._C (CUDA)", True, "built with CUDA sources"))
    else:
        rows.append(
            ("extension specdec._C (CUDA)", False, "built without CUDA (no CUDA torch or no nvcc at build time)")
        )
    rows.append(("pytorch reference", True, f"torch {torch.__version__}"))
    return rows
