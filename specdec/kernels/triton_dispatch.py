"""Launching a compiled Triton kernel again without redoing Triton's per-launch bookkeeping.

``kernel[grid](*args)`` is Triton's JIT dispatch. On every launch it reads its knobs, asks the driver
for the device and the stream, specialises every argument (its binder), turns the specialisation into a
cache key, finds the compiled kernel, compares each global the kernel read with the copy it made at
compile time, builds the launch hooks' metadata and calls the compiled kernel's launcher. For specdec's
kernels that costs more host time than specdec's own code around the launch, and a verification call makes
three launches (``bench/bench_host_time.py --dispatch`` measures it without a GPU; bench/RESULTS.md).

``launch`` keeps the part that decides which compiled kernel a launch needs, Triton's own binder, so the
specialisation is exactly Triton's. The first launch of a specialisation goes through ``kernel[grid]``,
which compiles or finds the kernel, and what it returns is kept under (device, specialisation, launch
options, the knobs that change a compile). Later launches call that kernel's launcher directly, with
the arguments Triton would pass and no hook metadata. Triton's own path runs instead when a launch hook
or a pre-run hook is attached (profilers), for the interpreter's kernels, and when the installed Triton
lacks what this relies on (its per-device binder, the compiled kernel's launcher; Triton 3.6 to 3.9 have
them). What is skipped is the check that a kernel's globals did not change since its compile:
specdec's kernels read module constants only.

``SPECDEC_FAST_LAUNCH=0`` keeps every launch on Triton's own path (``1`` or unset: this one; anything else
is refused, naming the variable).
"""

from __future__ import annotations

import os

from specdec.kernels._triton import triton

FAST_LAUNCH_ENV = "SPECDEC_FAST_LAUNCH"
_enabled: bool | None = None  # the variable as read at the first launch
# id(kernel) -> {(device, specialisation, options, knobs): Triton's compiled kernel}; kernels are module-level and
# live as long as the process, and hashing a JITFunction hashes its source
_compiled: dict[int, dict[tuple, object]] = {}

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
    try:
        bound, specialization, options = caches[device][4](*args, **meta, **config)  # Triton's binder for the device
    except Exception:  # a Triton laid out otherwise, or arguments its binder refuses: its own path decides
        kernel[grid](*args, **meta, **config)
        return
    compile_knobs = (kernel.debug, knobs.runtime.debug, knobs.compilation.instrumentation_mode,
                     getattr(knobs.compilation, "fpsan_homomorphic_casts", None))  # fmt: skip
    key = (device, tuple(specialization), tuple(options.items()), compile_knobs)
    known = _compiled.get(id(kernel))
    compiled = None if known is None else known.get(key)
    if compiled is None:
        compiled = kernel[grid](*args, **meta, **config)  # compiles, or finds Triton's kernel, and launches it
        if all(hasattr(compiled, name) for name in ("run", "function", "packed_metadata")):
            _compiled.setdefault(id(kernel), {})[key] = compiled
        return
    x, y, z = (*grid, 1, 1)[:3]
    compiled.run(x, y, z, active.get_current_stream(device), compiled.function, compiled.packed_metadata,
                 None, None, None, *bound.values())  # fmt: skip


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
