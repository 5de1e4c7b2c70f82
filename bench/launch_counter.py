"""Count, on the CPU, the kernels a forward would launch on a GPU.

Run the Triton path through Triton's interpreter: every grid launch of a ``@triton.jit`` kernel is
one launch (the interpreter's own tensor shuffling inside it is not counted), and every dispatched
ATen op outside those launches is one launch unless it only makes a view or an allocation, or
reads a host value (those are ``sync_counter``'s business). Fused ops count once.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

NO_KERNEL = {  # allocations, metadata and host reads: no kernel on a GPU
    aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default, aten.new_empty.default,
    aten.new_empty_strided.default, aten.lift_fresh.default, aten.detach.default, aten.alias.default,
    aten._local_scalar_dense.default, aten.set_.source_Storage_storage_offset, aten.set_.source_Storage,
    aten.resize_.default, aten.sym_size.int, aten.sym_stride.int, aten.sym_numel.default, aten.is_nonzero.default,
}  # fmt: skip


@dataclass
class LaunchCounter(TorchDispatchMode):
    """``with LaunchCounter() as c: ...``; ``c.triton`` and ``c.aten`` count launches by kernel / op name."""

    triton: Counter = field(default_factory=Counter)
    aten: Counter = field(default_factory=Counter)

    def __post_init__(self):
        super().__init__()
        self._inside_triton = 0

    @property
    def total(self) -> int:
        return sum(self.triton.values()) + sum(self.aten.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self._inside_triton and not func.is_view and func not in NO_KERNEL:
            self.aten[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        from triton.runtime.interpreter import InterpretedFunction

        self._run = InterpretedFunction.run
        counter = self

        def run(kernel, *args, grid, warmup, **kwargs):
            if not warmup:
                counter.triton[kernel.fn.__name__] += 1
            counter._inside_triton += 1
            try:
                return counter._run(kernel, *args, grid=grid, warmup=warmup, **kwargs)
            finally:
                counter._inside_triton -= 1

        InterpretedFunction.run = run
        return super().__enter__()

    def __exit__(self, *exc):
        from triton.runtime.interpreter import InterpretedFunction

        InterpretedFunction.run = self._run
        return super().__exit__(*exc)
