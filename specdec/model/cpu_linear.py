"""Linear layers of CPU forwards: a skinny-GEMM kernel up to a hundred-odd rows, oneDNN for more.

Multi-row forwards are every verification of a chain or tree, a batch's decode, a draft level of a
batch and the prefill. PyTorch's ``F.linear`` runs one row (decode at batch 1) well, but a few rows
poorly on some CPUs (far slower than reading the weight once). So ``linear_for`` picks, once per forward,
the path that runs each layer at its row count fastest (``bench/bench_cpu_linear.py`` times all three):

* up to ``SKINNY_MAX_ROWS`` rows: ``skinny_linear``, the extension's kernel (``csrc/skinny_linear_cpu.cpp``: it
  streams a packed copy of the weight once, in passes of 8 rows over slices that stay in L1), for every layer. A
  forward streams its weights from beyond L2 (they do not stay in cache from one forward to the next), and
  there, measured end to end, the kernel over a half-size pack (below) wins from one row to about a hundred:
  decode, verification of chains and trees, a batch's decode and draft levels, short prefills;
* more rows, or without the extension (or with ``SPECDEC_BACKEND=torch``): ``packed_linear``, oneDNN with
  the weight reordered ("packed") for it, which wins over ``F.linear`` on the larger weights of such
  forwards (by a margin that depends on the CPU), and ``F.linear`` for one row.

In the row-invariant mode (``SPECDEC_ROW_INVARIANT=1`` or ``specdec.set_row_invariant(True)``) every layer at every
row count runs ``row_invariant_linear``: the skinny kernel with each row summed in the order of a row alone (the
number of partial sums above depends on the rows in a pass, as F.linear's and oneDNN's blockings do), so a row's
output never depends on the rows beside it; the backend forced to ``torch`` does not change that.

The thresholds are fixed, not timed at run time: a timed choice would make the arithmetic (and so, at ties,
greedy tokens) depend on timing.

Where Triton's interpreter runs the kernels on CPU tensors (``TRITON_INTERPRET=1``, the backend not forced
to ``torch``), the forward stands in for a GPU's and keeps a GPU's GEMMs: ``F.linear`` throughout (what
``tests/test_launches.py`` counts).

Both packs are made on a weight's first use and kept on the weight tensor itself: a pack lives as long
as the weight and costs a second copy of it (half a copy for the skinny pack of a weight whose every value is a
bfloat16, as a bfloat16 checkpoint's are: that pack holds bfloat16, which the kernel widens exactly, so it streams
half the bytes for the same sums; every weight so, small ones too, since a forward streams them all from beyond
L2). A decoder makes its models' skinny packs when it is built
(``pack_ahead``): made lazily, they landed in the first few-rows step, which then ran several times its
later time -- the first plain step the adaptive controller measured, so plain decoding was priced out. A
pack records the weight's version and storage, so a weight changed in place or swapped by loading is
packed again, never served stale. Inference-mode weights (no version counter), float16/bfloat16, autograd and
``torch.compile`` (its graph keeps ``F.linear``) stay on ``F.linear``; so do weights below
``PACK_MIN_ELEMENTS`` on the oneDNN path (there the call's own cost wins). Results agree with ``F.linear``
up to float rounding (other summation orders), not bit for bit.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from specdec import _backend

# Below this size a weight runs alike or slower packed for oneDNN (the call's own cost wins); the fused gate/up and
# an LM head of the embedded target are above it (bench/bench_cpu_linear.py).
PACK_MIN_ELEMENTS = 1 << 18
PACK_ROWS = 32  # the row count the layout is packed for (any count >= 2 runs alike)
AVAILABLE = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
# Up to this many rows every layer runs the skinny kernel; beyond, oneDNN's blocking ties with it end to end (a
# prefill of 150 to 600 rows) and takes over (bench/RESULTS.md, "CPU GEMMs").
SKINNY_MAX_ROWS = 128


@functools.cache
def skinny_available() -> bool:
    """The loaded extension has the skinny-GEMM ops as this package calls them (one built before they, or their
    bfloat16 packs, were added has not)."""
    return (
        _backend.extension_has_op("skinny_linear")
        and _backend.extension_has_op("skinny_linear_pack", arguments=("bf16",))
        and _backend.extension_has_op("skinny_linear_version", dispatch_key=None)
    )


if skinny_available():  # shapes for torch.compile and torch.library.opcheck

    @torch.library.register_fake("specdec::skinny_linear_pack")
    def _(weight, bf16=False):
        blocks = -(-weight.shape[0] // 8)
        if bf16:  # input features in pairs: [blocks, ceil(K / 2), 16]
            return weight.new_empty(blocks, -(-weight.shape[1] // 2), 16, dtype=torch.bfloat16)
        return weight.new_empty(blocks, weight.shape[1], 8)

    @torch.library.register_fake("specdec::skinny_linear")
    def _(x, packed, out_features, bias=None, row_invariant=False):
        return x.new_empty(x.shape[0], out_features)


def _pack(weight: torch.Tensor, attribute: str, make: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """``make(weight)``, kept on the weight as ``attribute`` and made again when the weight's version or storage
    moved (changed in place, or swapped by loading)."""
    stamp = (weight._version, weight.data_ptr())
    entry = getattr(weight, attribute, None)
    if entry is None or entry[0] != stamp:
        entry = (stamp, make(weight.detach()))
        setattr(weight, attribute, entry)
    return entry[1]


def skinny_pack(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight``'s pack for the skinny kernel (made once, kept on the weight), or None for an inference-mode weight
    (no version counter: a pack could go stale unseen)."""
    if weight.is_inference():
        return None
    return _pack(weight, "_specdec_skinny", _make_skinny_pack)


def _make_skinny_pack(weight: torch.Tensor) -> torch.Tensor:
    """The skinny kernel's pack of ``weight``: in bfloat16 where its every value is a bfloat16 (a bfloat16
    checkpoint's): half the bytes to stream from beyond the caches, the same products and sums; else in float32."""
    in_bfloat16 = torch.equal(weight.to(torch.bfloat16).float(), weight)
    return torch.ops.specdec.skinny_linear_pack(weight, in_bfloat16)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` through the extension's skinny-GEMM kernel with ``weight`` packed (float32 CPU
    tensors, no autograd, the extension built; ``x`` of any leading shape)."""
    packed = skinny_pack(weight)
    if packed is None:
        return F.linear(x, weight, bias)
    if x.dim() == 2 and x.stride(1) == 1:  # the model's activations: no reshaping
        return torch.ops.specdec.skinny_linear(x, packed, weight.shape[0], bias)
    out = torch.ops.specdec.skinny_linear(x.reshape(-1, x.shape[-1]).contiguous(), packed, weight.shape[0], bias)
    return out.view(*x.shape[:-1], weight.shape[0])


def row_invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` through the skinny kernel in its row-invariant order: each row's output has the
    same bits whatever the other rows of ``x`` (any leading shape; float32 CPU tensors, no autograd, the extension
    built). An inference-mode weight, which cannot keep a pack safely, is packed on every call."""
    packed = skinny_pack(weight)
    if packed is None:
        packed = _make_skinny_pack(weight)
    rows, out_features = x.reshape(-1, x.shape[-1]).contiguous(), weight.shape[0]
    return torch.ops.specdec.skinny_linear(rows, packed, out_features, bias, True).view(*x.shape[:-1], out_features)


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` through oneDNN with ``weight`` packed (float32 CPU tensors, no autograd)."""
    if weight.numel() < PACK_MIN_ELEMENTS or weight.is_inference():
        return F.linear(x, weight, bias)
    packed = _pack(weight, "_specdec_onednn", lambda w: torch.ops.mkldnn._reorder_linear_weight(w, PACK_ROWS))
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def pack_ahead(weights: list[torch.Tensor]) -> None:
    """Make the skinny-kernel packs of the linear ``weights`` now, where ``linear_for`` would use them (float32 CPU
    weights, the extension's kernel, no Triton interpreter standing in for a GPU), instead of on their first
    few-rows forward."""
    if not skinny_serves() and not _row_invariant_serves():
        return
    for weight in weights:
        if weight.dtype == torch.float32 and weight.device.type == "cpu":
            skinny_pack(weight)


def skinny_serves() -> bool:
    """The skinny kernel serves few-row float32 CPU forwards: the extension has it, the backend is not forced to
    ``torch``, and no Triton interpreter stands in for a GPU (then every GEMM is ``F.linear``)."""
    return _backend.forced_backend() != "torch" and not _backend.interpreter_enabled() and skinny_available()


def _row_invariant_serves() -> bool:
    """The row-invariant mode is on for float32 CPU forwards outside Triton's interpreter (where ``linear_for`` runs
    ``row_invariant_linear``)."""
    return _backend.row_invariant() and not _backend.interpreter_enabled() and skinny_available()


def linear_for(x: torch.Tensor) -> Callable[..., torch.Tensor]:
    """The linear function for a forward whose activations are ``x [rows, features]`` (a host decision)."""
    rows, own_ops = x.shape[0], _backend.forced_backend() != "torch"
    if x.dtype != torch.float32 or x.device.type != "cpu" or torch.is_grad_enabled() or torch.compiler.is_compiling():
        return F.linear
    if own_ops and _backend.interpreter_enabled():  # Triton's interpreter stands in for a GPU: its GEMMs
        return F.linear
    if _backend.row_invariant():
        if not skinny_available():
            raise RuntimeError(
                f"{_backend.ROW_INVARIANT_ENV}=1 (set_row_invariant) needs the extension's skinny_linear op: "
                "build it with `pip install --no-build-isolation -e .`"
            )
        return row_invariant_linear
    if rows <= SKINNY_MAX_ROWS and skinny_serves():
        return skinny_linear
    return packed_linear if AVAILABLE and rows > 1 else F.linear
