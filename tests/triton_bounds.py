"""Bounds checking for Triton kernels run by Triton's interpreter (TRITON_INTERPRET=1).

Inside ``with check_bounds():`` every pointer a kernel builds remembers the tensor argument
it was derived from, and every load and store checks the address of EVERY lane, masked
lanes included, against that tensor's bytes. An active lane outside stops the kernel at
once, before the interpreter dereferences it (``OutOfBounds``, re-raised by the interpreter
as its ``InterpreterError``); masked lanes outside are collected and reported together when
the launch returns (the interpreter never dereferences them). Messages name the kernel, the
argument, the offending element offsets and whether active lanes were involved.

Why masked lanes too: on a GPU a masked lane issues no access, but the interpreter's own
loads do not dereference masked lanes either, so checking only active lanes would miss a
masked load from an empty tensor (a null pointer), and a masked lane that points past a
buffer is one mask bug away from a real out-of-bounds read. specdec's kernels keep every
lane inside its buffer (clamped indices), so this check is strict.

Pointers are tracked through the interpreter's builder: the base pointer of each tensor
argument is tagged when the launch converts it, and every builder operation that returns
a pointer inherits the tag of its pointer operand(s) (pointer arithmetic, splat, broadcast,
reshape, select). A load or store through a pointer without a tag fails as well.
"""

from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass

import numpy as np
import triton.language as tl
import triton.runtime.interpreter as interpreter

_TAG = "specdec.bounds"


class OutOfBounds(AssertionError):
    """A kernel lane addressed memory outside the tensor its pointer came from."""


@dataclass(frozen=True)
class _Extent:
    kernel: str
    name: str
    lo: int  # first byte of the tensor's elements
    hi: int  # one past the last byte (lo == hi for an empty tensor)
    numel: int


def _extent(kernel: str, name: str, t) -> _Extent:
    start = t.data_ptr()
    if t.numel() == 0:
        return _Extent(kernel, name, start, start, 0)
    span = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride())) + 1
    return _Extent(kernel, name, start, start + span * t.element_size(), t.numel())


def _pointer_extents(values) -> tuple[_Extent, ...]:
    found: list[_Extent] = []
    for v in values:
        if isinstance(v, interpreter.TensorHandle):
            for e in v.attr.get(_TAG, ()):
                if e not in found:
                    found.append(e)
    return tuple(found)


def _check(ptrs, mask, access: str, masked_only: list[str]) -> None:
    """Raise for active lanes outside; append a message to ``masked_only`` for masked ones."""
    extents = ptrs.attr.get(_TAG)
    if not extents:
        raise OutOfBounds(f"{access} through a pointer that no tensor argument produced")
    addr = np.asarray(ptrs.data, dtype=np.uint64)
    size = max(1, ptrs.get_element_ty().primitive_bitwidth // 8)
    inside = np.zeros(addr.shape, dtype=bool)
    for e in extents:
        inside |= (addr >= e.lo) & (addr + size <= e.hi)
    if inside.all():
        return
    outside = ~inside
    active = outside & np.broadcast_to(np.asarray(mask.data, dtype=bool), addr.shape)
    e = extents[0]
    offsets = ((addr[outside].astype(np.int64) - e.lo) // size).tolist()
    lanes = "active lanes" if active.any() else "masked lanes only"
    message = (
        f"{e.kernel}: {access} through {e.name} ({e.numel} elements) reaches element offsets "
        f"{sorted(set(offsets))[:8]} ({int(outside.sum())} lanes outside, {lanes})"
    )
    if active.any():
        raise OutOfBounds(message)
    if message not in masked_only:
        masked_only.append(message)


@contextlib.contextmanager
def check_bounds(masked_lanes: bool = True):
    """Check every load and store of every interpreted Triton launch inside the block.

    ``masked_lanes=False`` checks active lanes only (what a GPU would actually touch).
    """
    builder = interpreter.interpreter_builder
    original_cvt = interpreter._implicit_cvt
    original_call = interpreter.GridExecutor.__call__
    names: dict[tuple, str] = {}  # tensor identity -> argument name(s), for the launch in progress
    kernel = [""]
    masked_only: list[str] = []

    def launch(self, *args, **kwargs):
        names.clear()
        masked_only.clear()
        kernel[0] = self.fn.__name__
        for name, value in [*zip(self.arg_names, args), *kwargs.items()]:
            if hasattr(value, "data_ptr"):
                key = (value.data_ptr(), tuple(value.shape), tuple(value.stride()), value.dtype)
                names[key] = f"{names[key]} (also {name})" if key in names else name
        original_call(self, *args, **kwargs)
        if masked_only and masked_lanes:
            raise OutOfBounds("; ".join(masked_only))

    def convert(arg):
        out = original_cvt(arg)
        if hasattr(arg, "data_ptr"):
            key = (arg.data_ptr(), tuple(arg.shape), tuple(arg.stride()), arg.dtype)
            out.handle.attr[_TAG] = (_extent(kernel[0], names.get(key, "?"), arg),)
        return out

    def propagate(method):
        @functools.wraps(method)
        def wrapped(*args, **kwargs):
            out = method(*args, **kwargs)
            if isinstance(out, interpreter.TensorHandle) and isinstance(out.dtype, tl.pointer_type):
                extents = _pointer_extents([*args, *kwargs.values()])
                if extents and _TAG not in out.attr:
                    out.attr[_TAG] = extents
            return out

        return wrapped

    def checked_load(ptrs, mask, other, *rest):
        _check(ptrs, mask, "load", masked_only)
        return original_load(ptrs, mask, other, *rest)

    def checked_store(ptrs, value, mask, *rest):
        _check(ptrs, mask, "store", masked_only)
        return original_store(ptrs, value, mask, *rest)

    def checked_atomic(rmw_op, ptrs, value, mask, *rest):
        _check(ptrs, mask, "atomic", masked_only)
        return original_atomic(rmw_op, ptrs, value, mask, *rest)

    original_load, original_store = builder.create_masked_load, builder.create_masked_store
    original_atomic = builder.create_atomic_rmw
    checked = {"create_masked_load": checked_load, "create_masked_store": checked_store,
               "create_atomic_rmw": checked_atomic}  # fmt: skip
    patched = [n for n in dir(type(builder)) if n.startswith("create_") and n not in (*checked, "create_load",
               "create_store")]  # fmt: skip
    for n in patched:
        setattr(builder, n, propagate(getattr(builder, n)))
    for n, method in checked.items():
        setattr(builder, n, method)
    interpreter._implicit_cvt = convert
    interpreter.GridExecutor.__call__ = launch
    try:
        yield
    finally:
        interpreter.GridExecutor.__call__ = original_call
        interpreter._implicit_cvt = original_cvt
        for n in [*patched, *checked]:
            delattr(builder, n)


def bounds_checked():
    """``check_bounds()`` when Triton runs interpreted (TRITON_INTERPRET=1); compiled kernels cannot be
    checked this way, so elsewhere this is a no-op."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return check_bounds()
    return contextlib.nullcontext()
