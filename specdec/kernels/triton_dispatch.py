"""Launching a compiled Triton kernel again without redoing Triton's per-launch bookkeeping.

``kernel[grid](*args)`` is Triton's JIT dispatch. On every launch it reads its knobs, asks the driver
for the device and the stream, specialises every argument (its binder), turns the specialisation into a
cache key, finds the compiled kernel, compares each global the kernel read with the copy it made at
compile time, builds the launch hooks' metadata and calls the compiled kernel's launcher. For specdec's
kernels that costs more host time than specdec's own code around the launch, and a verification call makes
three launches (``bench/bench_host_time.py --dispatch`` measures it without a GPU; bench/RESULTS.md).

``launch`` keeps Triton's binder, the part that decides which compiled kernel a launch needs, for the first
launch of each launch key, and skips it for later ones. The key is made from the launch in one C call
(``specdec._C.launch_key``; a Python loop where the extension is not built): each positional argument (a
tensor's dtype and whether its address is a multiple of 16, an int's value, a float, a bool, a string or None
by type and value), then the meta-parameters and the launch options by name and value. Equal keys mean equal
specialisations in Triton's binder (the key is exact for tensors and finer for ints, so a new shape runs the
binder once; a launch without a key, an argument of another type, runs it every time). A launch whose
specialisation is new goes through ``kernel[grid]``, which compiles or finds the kernel; what it returns is
kept under (device, specialisation, options, the knobs that change a compile), and under the launch key with
the constexpr values Triton's binder places after the arguments. Later launches call that kernel's launcher
directly, with the arguments Triton would pass and no hook metadata. Triton's own path runs instead when a
launch hook or a pre-run hook is attached (profilers), for the interpreter's kernels, and when the installed
Triton lacks what this relies on (its per-device binder, the compiled kernel's launcher; Triton 3.6 to 3.9
have them). What is skipped is the check that a kernel's globals did not change since its compile: specdec's
kernels read module constants only.

``SPECDEC_FAST_LAUNCH=0`` keeps every launch on Triton's own path (``1`` or unset: this one; anything else
is refused, naming the variable).
"""

from __future__ import annotations

import functools
import os

import torch

from specdec import _backend
from specdec.kernels._triton import triton

FAST_LAUNCH_ENV = "SPECDEC_FAST_LAUNCH"
_enabled: bool | None = None  # the variable as read at the first launch
# id(kernel) -> {(device, specialisation, options, knobs): Triton's compiled kernel}; kernels are module-level and
# live as long as the process, and hashing a JITFunction hashes its source
_compiled: dict[int, dict[tuple, object]] = {}
# id(kernel) -> {(device, launch key, knobs): (Triton's compiled kernel, the constexpr values after the arguments)}
_keyed: dict[int, dict[tuple, tuple]] = {}
MAX_KEYS = 1024  # launch keys kept per kernel (an int's every value is a key of its own); more start over

if triton is not None:
    from triton import knobs
    from triton.runtime import driver


def fast_launch_enabled() -> bool:
    """``SPECDEC_FAST_LAUNCH``, read once: ``1``, empty or unset on; ``0`` off; anything else refused."""
    global _enabled
    if _enabled is None:
        value = os.environ.get(FAST_LAUNCH_ENV, "").strip()
        if value not in ("", "0", "1"):
            raise ValueError(f"{FAST_LAUNCH_ENV} must be 1 (on, as when unset) or 0 (off), got {value!r}")
        _enabled = value != "0"
    return _enabled


def launch(kernel, grid: tuple, args: tuple, meta: dict, config: dict) -> None:
    """``kernel[grid](*args, **meta, **config)``, through the compiled kernel's launcher once Triton has launched the
    same specialisation (the module docstring says when Triton's own path runs instead)."""
    caches = getattr(kernel, "device_caches", None)  # (the interpreter's kernels have none)
    if caches is None or not fast_launch_enabled() or _hooked(kernel):
        kernel[grid](*args, **meta, **config)
        return
    active = driver.active
    device = active.get_current_device()
    compile_knobs = (kernel.debug, knobs.runtime.debug, knobs.compilation.instrumentation_mode,
                     getattr(knobs.compilation, "fpsan_homomorphic_casts", None))  # fmt: skip
    x, y, z = (*grid, 1, 1)[:3]
    launch_key = _launch_key()(args, meta, config)
    if launch_key is not None:
        launch_key = (device, launch_key, compile_knobs)
        entry = _keyed.get(id(kernel), {}).get(launch_key)
        if entry is not None:
            compiled, constexprs = entry
            compiled.run(x, y, z, active.get_current_stream(device), compiled.function, compiled.packed_metadata,
                         None, None, None, *args, *constexprs)  # fmt: skip
            return
    try:
        bound, specialization, options = caches[device][4](*args, **meta, **config)  # Triton's binder for the device
    except Exception:  # a Triton laid out otherwise, or arguments its binder refuses: its own path decides
        kernel[grid](*args, **meta, **config)
        return
    key = (device, tuple(specialization), tuple(options.items()), compile_knobs)
    compiled = _compiled.get(id(kernel), {}).get(key)
    if compiled is None:
        compiled = kernel[grid](*args, **meta, **config)  # compiles, or finds Triton's kernel, and launches it
        if all(hasattr(compiled, name) for name in ("run", "function", "packed_metadata")):
            _compiled.setdefault(id(kernel), {})[key] = compiled
            _keep(kernel, launch_key, compiled, bound, len(args))
        return
    _keep(kernel, launch_key, compiled, bound, len(args))
    compiled.run(x, y, z, active.get_current_stream(device), compiled.function, compiled.packed_metadata,
                 None, None, None, *bound.values())  # fmt: skip


def _keep(kernel, launch_key, compiled, bound: dict, n_args: int) -> None:
    """Keep ``compiled`` and the values Triton passes after the arguments (the constexprs, in the kernel's order)
    under the launch key."""
    if launch_key is None:
        return
    keyed = _keyed.setdefault(id(kernel), {})
    if len(keyed) >= MAX_KEYS:
        keyed.clear()
    keyed[launch_key] = (compiled, tuple(bound.values())[n_args:])


@functools.cache
def _launch_key():
    """The extension's ``launch_key`` or, where it is not built, ``python_launch_key``."""
    return _backend.extension_function("launch_key") or python_launch_key


def python_launch_key(args: tuple, meta: dict, config: dict) -> tuple | None:
    """``specdec._C.launch_key`` in Python (a tuple, not bytes): a key that determines Triton's specialisation of every
    argument, with the meta-parameters and options, or None for an argument of another type."""
    parts = []
    for arg in args:
        kind = type(arg)
        if kind is int:
            parts.append(arg)
        elif isinstance(arg, torch.Tensor):
            parts.append(arg.dtype if arg.data_ptr() % 16 == 0 else (arg.dtype,))  # (aligned or not)
        elif kind is float or kind is bool or kind is str or arg is None:
            parts.append((kind, arg))
        else:
            return None
    return tuple(parts), tuple(meta.items()), tuple(config.items())


def _hooked(kernel) -> bool:
    """A hook Triton's own dispatch would call is attached: launch hooks (a chain with calls, or a callable),
    the kernel's pre-run hooks, or the stage-inspection hook that changes its cache key."""
    enter, leave = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
    return bool(
        getattr(enter, "calls", enter)
        or getattr(leave, "calls", leave)
        or kernel.pre_run_hooks
        or getattr(knobs.runtime, "add_stages_inspection_hook", None)
    )
