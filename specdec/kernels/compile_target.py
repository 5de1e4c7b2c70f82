"""Compile a planned Triton launch for an NVIDIA GPU that is not here, and read its resources.

The interpreter accepts code the compiler rejects, and only a compile says how many
registers a tile needs. Triton compiles for any target without a device: the launch's
arguments are specialised exactly as the JIT specialises them on that GPU (Triton's own
binder and ``_pack_args``: pointer and integer types, 16-byte divisibility, integers equal
to 1 folded), and ``triton.compile`` lowers the kernel for ``GPUTarget("cuda", arch, 32)``
with the ptxas bundled in Triton's wheel, whose ``-v`` report (registers, stack frame,
spill stores) Triton prints on request; shared memory comes from the compiled metadata, and
the software pipeline's shared-memory buffers from the compiled TritonGPU IR (``pipeline``).
Checked with Triton 3.6 and 3.9 (the binder is Triton's, not a public API, so
``bench/compile_matrix.py`` runs under both in CI).

Run it in a process without TRITON_INTERPRET: Triton's own jit helpers imported with the
interpreter on stay interpreted. ``tuning.capture_launches`` records what to compile.
"""

from __future__ import annotations

import contextlib
import io
import re
import time
from dataclasses import dataclass

# Largest shared memory one block may use (opt-in), bytes: H100/H200 (sm_90), A100 (sm_80).
SHARED_LIMIT = {90: 227 * 1024, 80: 163 * 1024}


@dataclass(frozen=True)
class Buffer:
    """A ring of shared-memory buffers the software pipeliner allocated for one load of a loop."""

    name: str  # the kernel's variable the load assigns (the IR value's name)
    count: int  # buffers in the ring: loads of that many iterations can be in flight
    shape: str  # one buffer, e.g. "128x64xbf16"


@dataclass(frozen=True)
class Resources:
    """What one compiled launch needs, as ptxas reports it, and how its loops were pipelined."""

    registers: int  # per thread
    spill_bytes: int  # per thread: spill stores (0 means no register spills)
    stack_bytes: int  # per thread stack frame (spills, local arrays, call frames)
    shared_bytes: int  # per block
    compile_s: float
    buffers: tuple[Buffer, ...] = ()
    loop_waits: tuple[int, ...] = ()  # ``num`` of each async wait inside a loop: copy groups left in flight
    vector_loads: int = 0  # global loads of 8 or 16 bytes a thread (``ld.global.v2`` / ``.v4`` in the PTX)
    ordered_arrivals: int = 0  # acq_rel GPU-scope atomic adds right after a CTA barrier (``ordered_arrivals``)

    def buffer_count(self, name: str) -> int:
        """The fewest buffers of a ring for the load into ``name`` (0: none, the load is not pipelined)."""
        return min((b.count for b in self.buffers if b.name == name), default=0)

    def problems(self, arch: int, max_registers: int | None = None, min_buffers: dict | None = None,
                 vectorised: bool = False, arrives: bool = False) -> list[str]:  # fmt: skip
        """Why this launch could fail, run slowly or race on ``arch`` (empty: it fits): spills, shared
        memory over the limit, and, where given, registers over ``max_registers``, fewer buffers than
        ``min_buffers`` asks for the named loads, with ``vectorised`` no vector load at all, and with
        ``arrives`` no ordered arrival (a program that counts itself done before its accesses are ordered)."""
        found = []
        if self.spill_bytes:
            found.append(f"{self.spill_bytes} bytes of register spill stores")
        if self.shared_bytes > SHARED_LIMIT[arch]:
            found.append(f"{self.shared_bytes} bytes of shared memory > the {SHARED_LIMIT[arch]} a block may use")
        if max_registers is not None and self.registers > max_registers:
            found.append(f"{self.registers} registers per thread > the declared bound {max_registers}")
        for name, least in (min_buffers or {}).items():
            if self.buffer_count(name) < least:
                found.append(f"{self.buffer_count(name)} shared-memory buffers for {name!r} in the loop < {least}")
        if vectorised and not self.vector_loads:
            found.append("no vector load: its rows are read a value at a time")
        if arrives and not self.ordered_arrivals:
            found.append("no barrier then acq_rel GPU-scope atomic add: its arrival may pass its own accesses")
        return found


# The pipeliner's rings in TritonGPU IR (Triton 3.6 to 3.9): an operand-less mutable allocation whose
# leading dimension is the buffer index,
#   %k_149 = ttg.local_alloc : () -> !ttg.memdesc<2x128x64xbf16, #shared1, #smem, mutable> loc(#loc330)
# that is indexed by stage,
#   %k_400 = ttg.memdesc_index %k_149[%blocks_395] : !ttg.memdesc<2x128x64xbf16, ...> -> ...
# (each value is named after the variable the load assigns, plus a number), and in the loop the waits
# for the copies, ``num`` copy groups left in flight,
#   %k_399 = ttg.async_wait %k_383, %v_385 {num = 2 : i32} loc(#loc330)
_ALLOC = re.compile(r"^\s*%([\w.$-]+) = ttg\.local_alloc : \(\) -> !ttg\.memdesc<(\d+)x([^,>]+),[^>]*\bmutable>")
_WAIT = re.compile(r"\bttg\.async_wait\b.*\{num = (\d+) : i32\}")
_VECTOR_LOAD = re.compile(r"\bld\.global\.(?:\w+\.)*v[248]\.")


def pipeline(ttgir: str) -> tuple[tuple[Buffer, ...], tuple[int, ...]]:
    """The buffer rings and the in-loop async waits' ``num`` of a kernel's TritonGPU IR (``asm["ttgir"]``)."""
    buffers, waits, loops = [], [], []  # loops: for each open region, whether an scf.for opened it
    for line in ttgir.splitlines():
        text = line.strip()
        if text.startswith("}"):
            loops.pop()
        alloc = _ALLOC.match(line)
        if alloc and f"ttg.memdesc_index %{alloc[1]}[" in ttgir:
            buffers.append(Buffer(re.sub(r"_\d+$", "", alloc[1]), int(alloc[2]), alloc[3]))
        wait = _WAIT.search(text)
        if wait and any(loops):
            waits.append(int(wait[1]))
        if text.endswith("{"):
            loops.append("scf.for " in text)
    return tuple(buffers), tuple(waits)


# A program's arrival after its accesses (kv_compact's ticket), as Triton 3.6 to 3.9 print it: a barrier, then
# (past line markers, comments and register moves, with no global write between) one thread's add
#   bar.sync 	0;
#   @%p245 atom.global.gpu.acq_rel.add.u32 %r1483, [ %rd659 + 0 ], %r1484;
_ARRIVAL = re.compile(r"^(?:@!?%p\d+\s+)?atom\.global\.(?:gpu\.acq_rel|acq_rel\.gpu)\.add\.")
_GLOBAL_WRITE = re.compile(r"\b(?:st|atom|red)\.global\.")


def ordered_arrivals(ptx: str) -> int:
    """How many atomic adds in ``ptx`` release at GPU scope with no global write since a barrier of the whole CTA:
    every thread's earlier loads and stores then happen before whatever the program that acquires the count does."""
    count, after_barrier = 0, False
    for line in ptx.splitlines():
        text = line.strip()
        if text.startswith("bar.sync"):
            after_barrier = True
        elif _ARRIVAL.match(text):
            count += after_barrier
            after_barrier = False
        elif _GLOBAL_WRITE.search(text):
            after_barrier = False
    return count


def vector_loads(ptx: str) -> int:
    """How many global loads in ``ptx`` move 8 or 16 bytes a thread (``ld.global.v4.b32``, ``ld.global.nc.v2.b32``)."""
    return len(_VECTOR_LOAD.findall(ptx))


def toolchain() -> tuple[bool, str]:
    """(whether Triton can compile for NVIDIA targets here, why not)."""
    try:
        from triton.backends import backends
        from triton.backends.nvidia.compiler import get_ptxas
    except ImportError as exc:
        return False, f"triton's NVIDIA backend does not import: {exc}"
    if "nvidia" not in backends:
        return False, "triton was installed without its NVIDIA backend"
    try:
        get_ptxas(90)
    except Exception as exc:  # the bundled ptxas is missing
        return False, f"no ptxas: {exc}"
    return True, ""


def compile_launch(kernel, args: tuple, meta: dict, arch: int) -> Resources:
    """Compile ``kernel`` for ``args`` and meta-parameters ``meta`` (launch options ``num_warps`` /
    ``num_stages`` included) for sm_``arch``; raises whatever the compiler raises."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    fn = kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn)  # undo the interpreter's wrapper
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **meta)
    options, signature, constexprs, attrs = fn._pack_args(backend, meta, bound, specialization, options)
    # compile even when Triton's cache holds the kernel, and keep the log of Triton's own ptxas -v run
    saved = knobs.compilation.always_compile, knobs.nvidia.dump_ptxas_log
    knobs.compilation.always_compile, knobs.nvidia.dump_ptxas_log = True, True
    log = io.StringIO()
    start = time.perf_counter()
    try:
        with contextlib.redirect_stdout(log):
            compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target,
                                      options=options.__dict__)  # fmt: skip
    finally:
        knobs.compilation.always_compile, knobs.nvidia.dump_ptxas_log = saved
    seconds = time.perf_counter() - start
    text = log.getvalue()
    frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", text)
    regs = re.search(r"Used (\d+) registers", text)
    if frame is None or regs is None:
        raise RuntimeError(f"no ptxas report in the compile log: {text[-500:]!r}")
    stack, spills, _ = map(int, frame.groups())
    buffers, waits = pipeline(compiled.asm["ttgir"])
    ptx = compiled.asm["ptx"]
    return Resources(int(regs.group(1)), spills, stack, compiled.metadata.shared, seconds, buffers, waits,
                     vector_loads(ptx), ordered_arrivals(ptx))  # fmt: skip
