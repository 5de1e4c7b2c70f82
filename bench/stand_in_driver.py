"""A Triton driver for an NVIDIA GPU that is not here: Triton's own dispatch runs, nothing is launched.

With its launches captured (``tuning.capture_launches``) a call stops where specdec hands its launch to
Triton. On a GPU each launch then goes through Triton's JIT: its binder specialises every argument, its
cache finds the compiled kernel, it checks the globals the kernel read and passes the arguments to the
driver's launcher. That is host time too, and it is per launch. Under this driver it runs as it would
on a GPU host: kernels compile for sm_90 with the ptxas in Triton's wheel (as ``compile_target`` does),
and the launcher records the launch (calling the launch hooks around it, as a GPU's does) where a GPU's
would pack the arguments and call ``cuLaunchKernel``.
What a GPU adds is that launcher: its Python wrapper, the C packing of the arguments and the driver call.

    with stand_in_driver() as launches:   # in a process without TRITON_INTERPRET
        kernel[grid](*args)               # compiled for sm_90 once, then dispatched by Triton; not run
    launches                              # [Launch(kernel name, grid, ..., the kernel's arguments)]

``triton_bodies()`` makes specdec's ops take their Triton bodies for CPU tensors meanwhile.

Triton's ``driver`` keeps the active driver in ``_active`` (3.6 to 3.9); the default one cannot be made
without a GPU, so the previous value is restored as it was.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import NamedTuple

ARCH = 90
# What Triton asks of the device: the shared memory a block may use and the threads a block may have (an H100/H200).
SHARED_BYTES, THREADS = 232448, 1024


class Launch(NamedTuple):
    """What reached the launcher: the compiled kernel (its function handle and packed metadata identify it)
    and the kernel's arguments, constexprs included, as Triton passes them."""

    kernel: str
    grid: tuple[int, int, int]
    stream: int
    function: object
    metadata: object
    args: tuple


class _Utils:
    def load_binary(self, name, kernel, shared, device):
        return 1, object(), 0, 0, THREADS  # module, function (a handle of its own), registers, spills, threads

    def unload_module(self, module):
        pass

    def get_device_properties(self, device):
        return {"max_shared_mem": SHARED_BYTES, "max_threads_per_block": THREADS}


class StandInDriver:
    """Triton's driver interface for an absent sm_90 device; ``launches`` lists what reached its launcher."""

    def __init__(self):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", ARCH, 32)
        self.utils = _Utils()
        self.launches: list[Launch] = []
        record = self.launches

        class Launcher:
            def __init__(self, src, metadata):
                self.name = src.fn.__name__

            def __call__(self, grid_x, grid_y, grid_z, stream, function, metadata, hook_metadata, enter, leave, *args):
                if enter is not None:  # the launch hooks, as a GPU launcher calls them
                    enter(hook_metadata)
                record.append(Launch(self.name, (grid_x, grid_y, grid_z), stream, function, metadata, args))
                if leave is not None:
                    leave(hook_metadata)

        self.launcher_cls = Launcher

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_device_capability(self, device=None):
        return divmod(ARCH, 10)


@contextlib.contextmanager
def stand_in_driver() -> Iterator[list[Launch]]:
    """Make a ``StandInDriver`` Triton's active driver inside the block; yields its list of launches."""
    from specdec import _backend

    if _backend.interpreter_enabled():
        raise RuntimeError("stand_in_driver needs a process without TRITON_INTERPRET (the kernels are interpreted)")
    from triton.runtime import driver

    stand_in = StandInDriver()
    previous = driver._active
    driver.set_active(stand_in)
    try:
        yield stand_in.launches
    finally:
        driver._active = previous


@contextlib.contextmanager
def triton_bodies() -> Iterator[None]:
    """Every specdec op takes its Triton body inside the block, for CPU tensors too: ``select_backend`` gives, and
    decides as, its answer for CUDA inputs (``use_backend`` refuses CPU tensors without the interpreter)."""
    from specdec import _backend

    select = _backend.select_backend
    _backend.select_backend = lambda *tensors: _backend.backend_for(on_cuda=True)  # (its scan of the inputs left out)
    try:
        yield
    finally:
        _backend.select_backend = select
