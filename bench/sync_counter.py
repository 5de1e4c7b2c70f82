"""Count, on the CPU, the operations that would make the host wait for a GPU.

A CPU run cannot stall, so ``SyncCounter`` counts what would: every dispatched ATen op that needs a
device value on the host (``_local_scalar_dense`` behind ``item`` / ``bool`` / ``int``, ``nonzero``,
``masked_select``, ``unique``, ``repeat_interleave`` without ``output_size``, indexing with a bool
mask), device -> host copies that block, and the reads that bypass dispatch on the CPU
(``Tensor.tolist`` / ``item`` / ``__bool__`` / ``__int__`` / ``__float__`` / ``__index__`` / ``numpy`` /
``cpu``, patched). Uploads that would block (pageable ``torch.tensor(..., device=)``, ``.to(device)``
without ``non_blocking``) are counted when specdec code makes them outside ``specdec._transfer``,
whose pinned non-blocking copy is the sanctioned way up.

Reads of host data that never was on a device look the same on the CPU, so the step must not make
those either (it keeps host data in Python lists); that is what makes the CPU count the GPU count.
Patched reads are counted when specdec code makes them (torch's own Python and Triton's interpreter
are not the step's code); dispatched ops wherever they come from.
"""

from __future__ import annotations

import sys
import traceback
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

SYNC_OPS = {
    aten._local_scalar_dense.default,
    aten.nonzero.default,
    aten.masked_select.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
    aten.equal.default,  # torch.equal returns a host bool
    aten.is_nonzero.default,
}
INDEX_OPS = {aten.index.Tensor, aten.index_put_.default, aten.index_put.default, aten._index_put_impl_.default}
READS = ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu")


@dataclass
class SyncCounter(TorchDispatchMode):
    """``with SyncCounter() as c: ...`` then ``c.events``: (what, where) of each would-be synchronisation."""

    events: list[tuple[str, str]] = field(default_factory=list)

    def __post_init__(self):
        super().__init__()
        self._depth = 0  # inside a patched read: its own dispatched scalar read is the same event
        self._saved = {}

    # ---- dispatched ops -------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self._depth and _syncs(func, args, kwargs):
            self._record(str(func.overloadpacket.__name__))
        return func(*args, **kwargs)

    # ---- reads that bypass dispatch, and blocking uploads ----------------------------------------
    def __enter__(self):
        for name in READS:
            self._saved[name] = getattr(torch.Tensor, name)
            setattr(torch.Tensor, name, self._read(name, self._saved[name]))
        self._saved["to"] = torch.Tensor.to
        torch.Tensor.to = self._upload_to(torch.Tensor.to)
        for name in ("tensor", "as_tensor"):
            self._saved[name] = getattr(torch, name)
            setattr(torch, name, self._upload_new(name, self._saved[name]))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, original in self._saved.items():
            setattr(torch if name in ("tensor", "as_tensor") else torch.Tensor, name, original)
        return super().__exit__(*exc)

    def _read(self, name, original):
        counter = self

        def read(tensor, *args, **kwargs):
            if counter._depth or not _from_specdec(sys._getframe(1)):
                return original(tensor, *args, **kwargs)
            counter._record(f"Tensor.{name}")
            counter._depth += 1
            try:
                return original(tensor, *args, **kwargs)
            finally:
                counter._depth -= 1

        return read

    def _upload_to(self, original):
        counter = self

        def to(tensor, *args, **kwargs):
            frame = sys._getframe(1)
            names_device = any(isinstance(a, (torch.device, str)) for a in args) or "device" in kwargs
            if names_device and not kwargs.get("non_blocking", False) and _from_specdec(frame, uploads=True):
                counter._record("Tensor.to(device) without non_blocking")
            return original(tensor, *args, **kwargs)

        return to

    def _upload_new(self, name, original):
        counter = self

        def new(*args, **kwargs):
            if kwargs.get("device") is not None and _from_specdec(sys._getframe(1), uploads=True):
                counter._record(f"torch.{name}(..., device=) from pageable memory")
            return original(*args, **kwargs)

        return new

    def _record(self, what: str) -> None:
        stack = traceback.extract_stack()[:-2]
        mine = [f for f in stack if "/specdec/" in f.filename and "/tests/" not in f.filename]
        where = f"{mine[-1].filename.split('/specdec/')[-1]}:{mine[-1].lineno}" if mine else "outside specdec"
        self.events.append((what, where))


def _syncs(func, args, kwargs) -> bool:
    if func in SYNC_OPS:
        return True
    if func is aten.repeat_interleave.Tensor:
        return kwargs.get("output_size") is None
    if func in INDEX_OPS:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices if i is not None)
    if func in (aten._to_copy.default, aten.copy_.default):
        src = args[1] if func is aten.copy_.default else args[0]
        dst_device = args[0].device if func is aten.copy_.default else kwargs.get("device")
        to_host = dst_device is not None and torch.device(dst_device).type == "cpu"
        return src.device.type not in ("cpu", "meta") and to_host and not kwargs.get("non_blocking", False)
    return False


def _from_specdec(frame, uploads: bool = False) -> bool:
    """The caller is specdec's code (for uploads: other than the sanctioned pinned copy)."""
    module = frame.f_globals.get("__name__", "")
    if not module.startswith("specdec"):
        return False
    return not (uploads and module == "specdec._transfer")


def run_under_sync_debug_error(decoder) -> None:
    """On a GPU: decode a mixed greedy / sampled batch with CUDA's sync debug mode at "error" after the
    prefill, so any synchronising call but the step's read-back (a warning turned error) fails."""
    import warnings

    import torch

    prompts = [[3, 9, 4, 3, 9, 4, 3], [7, 1], [5, 5, 2, 8]]
    for sampling in (dict(temperature=0.0), dict(temperature=[1.0, 0.0, 0.7], top_k=[5, 0, 0], seed=1)):
        steps = decoder.stream(prompts, max_new_tokens=[12, 5, 9], eos_token_id=None, **sampling)
        next(steps)  # the prefill (one-off allocations and uploads)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                count = sum(1 for _ in steps)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert count >= 3


def events_per_step(decoder, prompts, **sampling) -> list[list[tuple[str, str]]]:
    """The would-be synchronisations of each ``StepOutput`` the decoder's stream yields (prefill first)."""
    steps, per_step = decoder.stream(prompts, **sampling), []
    while True:
        with SyncCounter() as counter:
            try:
                next(steps)
            except StopIteration:
                return per_step
        per_step.append(counter.events)
