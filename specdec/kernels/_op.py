"""One registration pattern for every op: a ``torch.library`` custom op over two bodies.

Each op module writes a Triton launcher and a PyTorch body with the same positional
signature (tensors and host scalars in, outputs preallocated by the caller and written
in place, nothing returned) and declares the op once with ``register_op``:

    _op = register_op("rms_norm", mutates_args=("out",), triton=_rms_norm_triton, torch=_rms_norm_torch)
    def _(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor) -> None:
        ...   # the schema: annotated signature, body unused

The registered op (``torch.ops.specdec.<name>``) picks a body per call from the device of
its first tensor argument (``specdec._backend.select_backend``); its fake implementation
does nothing (outputs are preallocated), so torch.compile, ``opcheck`` and CUDA-graph
capture all see one opaque op. A hot path that chose the backend once for a whole step
(the model's forward plan) calls ``op.body(backend)`` directly and skips the dispatcher.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from specdec import _backend


@dataclass(frozen=True)
class RegisteredOp:
    """A registered op: ``op`` goes through the dispatcher, ``triton`` / ``torch`` are its bodies."""

    name: str
    op: Callable[..., None]
    triton: Callable[..., None]
    torch: Callable[..., None]

    def __call__(self, *args) -> None:
        self.op(*args)

    def body(self, backend: str) -> Callable[..., None]:
        """The body for ``backend`` ('triton' or 'torch'), to call without dispatch or checks."""
        return self.triton if backend == "triton" else self.torch

    def run(self, *args) -> None:
        """Eager: the body ``select_backend`` picks, called directly (the dispatcher's Python
        overhead is tens of microseconds per call on the CPU). Inside ``torch.compile``: the
        registered op, so the graph holds one opaque call."""
        if _torch.compiler.is_compiling():
            self.op(*args)
            return
        device_tensor = args[0]  # (every op's first argument is a tensor but a few; those search)
        if not isinstance(device_tensor, _torch.Tensor):
            device_tensor = next(a for a in args if isinstance(a, _torch.Tensor))
        (self.triton if _backend.select_backend(device_tensor) == "triton" else self.torch)(*args)


def register_op(
    name: str, *, mutates_args: Sequence[str], triton: Callable[..., None], torch: Callable[..., None]
) -> Callable[[Callable[..., None]], RegisteredOp]:
    """Decorator over the op's schema function (see the module docstring); returns a ``RegisteredOp``."""
    triton_body, torch_body = triton, torch

    def declare(schema: Callable[..., None]) -> RegisteredOp:
        @functools.wraps(schema)  # custom_op reads the schema from the wrapped signature
        def dispatch(*args):
            device_tensor = next(a for a in args if isinstance(a, _torch.Tensor))
            body = triton_body if _backend.select_backend(device_tensor) == "triton" else torch_body
            body(*args)

        op = _torch.library.custom_op(f"specdec::{name}", mutates_args=tuple(mutates_args))(dispatch)
        op.register_fake(lambda *args: None)
        return RegisteredOp(name, op, triton_body, torch_body)

    return declare


_torch = torch  # (the keyword argument ``torch`` shadows the module inside register_op)
