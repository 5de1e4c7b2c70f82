"""Counter-based uniforms: every random number of the sampling ops is a pure function of
``(seed, offset, counter)``, so results depend on neither batch size, row order nor replay.

A 32-bit integer hash (shift-xor-multiply mixing) is folded over six 32-bit words: the low
and high halves of the request's seed and offset, the counter, and a sixth word (0 for
``counter_uniform``, the vocabulary index for the race clocks below). The top 24 bits of the
result give ``u = h / 2**24`` in [0, 1). Every value lives in int64 and every product stays
below 2**63 (a 32-bit value times a multiplier below 2**31), so PyTorch and Triton (compiled
or interpreted) compute the same bits: the kernels and the references see identical uniforms
and can be compared token for token.

Keys and roles. Every uniform that decides a token is keyed on the request's seed and the
absolute position of that token (``offset`` here), and the counter names its role there:
``ROLE_TARGET`` is the target's own draw at that position -- what ``sample`` draws, what a
verification emits there, and what a coupled draft draws with -- and ``ROLE_TEST + k`` the
stochastic rule's test of the k-th child tried at a node. Nothing is keyed on the step or on a
node's index, so neither the drafter, the draft depth nor the batch changes a seeded request's
tokens (``tree_walk`` derives the rules). ``sample_probs`` takes the counter from its caller.

Race clocks: every draw of a token is an exponential race (Gumbel-max). For the key
``(seed, offset, counter)`` vocabulary entry i gets the clock ``E_i = -log(u_i)`` with

    u_i = ((h_i >> 8) | 1) / 2**24,   h_i = the hash of (seed, offset, counter, i)

(``race_clocks``; in the kernels ``race_key_tl`` once per key, then ``race_clock_tl`` per
entry): the top 24 bits with the lowest one set, an odd multiple of 2**-24, so u_i lies in
[2**-24, 1 - 2**-24], never 0 or 1, and E_i is finite and positive. The token drawn from weights
w is ``argmax_i w_i / E_i`` over the entries with w_i > 0 (the lowest index on ties; none when
no entry is positive): E_i are independent Exp(1), so entry i wins with probability
w_i / sum(w). The target's draw at a position is the race keyed ``(seed, position,
ROLE_TARGET)``; a coupled draft draws from its own q with the same clocks, so it equals the
target's token exactly when both races have the same winner. Every path computes the same hash
bits; the logarithm is each backend's own, so a clock can differ in its last bit between PyTorch
and Triton, which changes a draw only where two scores tie to that precision.
"""

from __future__ import annotations

import numbers

import torch

from specdec.kernels._checks import check_tensor
from specdec.kernels._op import register_op
from specdec.kernels._triton import cdiv, constant, jit, tl
from specdec.kernels.tuning import TuningSpace, candidates, launch

_HASH_START = 0x243F6A88
_MUL1 = 0x7FEB352D  # odd multipliers below 2**31: (x < 2**32) * m stays below 2**63
_MUL2 = 0x68E31DA5
_MASK32 = 0xFFFFFFFF
_U24 = 1.0 / 16777216.0  # 2**-24
# The same constants for the kernels (jit code reads only constexpr globals).
_HASH_START_TL, _MUL1_TL, _MUL2_TL, _MASK32_TL, _U24_TL = map(constant, (_HASH_START, _MUL1, _MUL2, _MASK32, _U24))
_BLOCK = 256

ROLE_TARGET = 0  # the target's draw at a position (plain sampling's token there): the counter of its race clocks
ROLE_TEST = 1  # + k: the stochastic rule's test of the k-th child tried at a node


# ----------------------------------------------------------------------------- Triton


@jit
def race_key_tl(seed, offset, counter):
    """The hash of the key (seed, offset, counter) before its sixth word, for int64 scalars or blocks: a race
    makes it once, then ``race_clock_tl`` gives every vocabulary entry's clock; ``counter_uniform_tl`` finishes
    it into one uniform."""
    # the five words folded in a static loop, one mix per word
    seed = seed.to(tl.int64)
    offset = offset.to(tl.int64)
    counter = offset * 0 + counter  # (a plain int counter becomes a tensor)
    h = seed * 0 + _HASH_START_TL
    for i in tl.static_range(5):
        if i == 0:
            h = h ^ (seed & _MASK32_TL)
        if i == 1:
            h = h ^ ((seed >> 32) & _MASK32_TL)
        if i == 2:
            h = h ^ (offset & _MASK32_TL)
        if i == 3:
            h = h ^ ((offset >> 32) & _MASK32_TL)
        if i == 4:
            h = h ^ (counter & _MASK32_TL)
        h = h ^ (h >> 16)
        h = (h * _MUL1_TL) & _MASK32_TL
        h = h ^ (h >> 15)
        h = (h * _MUL2_TL) & _MASK32_TL
        h = h ^ (h >> 16)
    return h


@jit
def counter_uniform_tl(seed, offset, counter):
    """Uniform in [0, 1) for int64 scalars or blocks (seed, offset) and an integer counter: the key's hash
    (``race_key_tl``) mixed once more, its sixth word 0."""
    h = race_key_tl(seed, offset, counter)
    h = h ^ (h >> 16)
    h = (h * _MUL1_TL) & _MASK32_TL
    h = h ^ (h >> 15)
    h = (h * _MUL2_TL) & _MASK32_TL
    h = h ^ (h >> 16)
    return (h >> 8).to(tl.float32) * _U24_TL


@jit
def race_clock_tl(key, index):
    """fp32 clocks E = -log(u), u in [2**-24, 1 - 2**-24], of vocabulary entries ``index`` (any shape, int32)
    in the race whose ``race_key_tl`` is ``key`` (a scalar): what ``race_clocks`` computes."""
    # uint32 arithmetic: a wrapping 32-bit product is the low half of the int64 one, so the bits equal the int64
    # hash's while each entry costs 32-bit instructions (this runs once per vocabulary entry)
    h = key.to(tl.uint32) ^ index.to(tl.uint32)
    h = h ^ (h >> 16)
    h = h * tl.full([], _MUL1_TL, tl.uint32)
    h = h ^ (h >> 15)
    h = h * tl.full([], _MUL2_TL, tl.uint32)
    h = h ^ (h >> 16)
    return -tl.log(((h >> 8) | 1).to(tl.float32) * _U24_TL)


@jit
def _counter_uniform_kernel(
    seed_ptr,  # [N] int64
    offset_ptr,  # [N] int64
    counter_ptr,  # [N] int64
    out_ptr,  # [N] fp32 out
    n,
    BLOCK: tl.constexpr,
):
    lanes = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = lanes < n
    i = tl.minimum(lanes, n - 1)  # lanes past the end stay inside the buffers
    u = counter_uniform_tl(tl.load(seed_ptr + i), tl.load(offset_ptr + i), tl.load(counter_ptr + i))
    tl.store(out_ptr + i, u, mask=live)


# No key: one tuned configuration for every length.
COUNTER_UNIFORM_SPACE = TuningSpace(candidates(BLOCK=(128, 256, 1024), num_warps=(2, 4, 8)), key=())


def _counter_uniform_triton(seed, offset, counter, out) -> None:
    n = out.numel()
    if n:
        grid = lambda c: (cdiv(n, c["BLOCK"]),)
        args = (seed, offset, counter, out, n)
        launch(_counter_uniform_kernel, grid, args, {}, dict(BLOCK=_BLOCK, num_warps=4), COUNTER_UNIFORM_SPACE)


def _counter_uniform_torch(seed, offset, counter, out) -> None:
    out.copy_(counter_uniform_reference(seed, offset, counter))


# ----------------------------------------------------------------------------- registered op


@register_op("counter_uniform", mutates_args=("out",), triton=_counter_uniform_triton, torch=_counter_uniform_torch)
def _counter_uniform_op(seed: torch.Tensor, offset: torch.Tensor, counter: torch.Tensor, out: torch.Tensor) -> None:
    """Schema: int64 ``[N]`` seed, offset, counter; writes fp32 ``[N]`` out."""


# ----------------------------------------------------------------------------- public function


def counter_uniform(
    seed: torch.Tensor, offset: torch.Tensor, counter: torch.Tensor | int, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """Uniforms in [0, 1), elementwise over broadcast ``seed``, ``offset`` and ``counter``.

    Parameters
    ----------
    seed, offset : integer tensors (any shape; read as int64).
    counter : integer tensor or Python int (read as int64; only its low 32 bits matter).
    out : optional fp32 contiguous tensor of the broadcast shape to write into.

    Returns
    -------
    fp32 tensor of the broadcast shape; bit-identical to ``counter_uniform_tl`` in the kernels.

    Example
    -------
    >>> u = counter_uniform(torch.tensor([1, 2]), torch.tensor([0, 0]), 3)
    >>> u.dtype, u.shape, bool(((u >= 0) & (u < 1)).all())
    (torch.float32, torch.Size([2]), True)
    """
    plain_int = isinstance(counter, numbers.Integral) and not isinstance(counter, bool)
    if not (plain_int or isinstance(counter, torch.Tensor)):
        raise TypeError(f"counter must be an int or an integer tensor, got {type(counter).__name__}")
    tensors = (("seed", seed), ("offset", offset), ("counter", counter))
    for name, value in tensors if isinstance(counter, torch.Tensor) else tensors[:2]:
        check_tensor(name, value, device=seed.device if isinstance(seed, torch.Tensor) else None)
        if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
            raise TypeError(f"{name} must be an integer tensor, got {str(value.dtype).replace('torch.', '')}")
    device = seed.device
    counter = torch.as_tensor(counter, dtype=torch.int64, device=device)
    seed, offset, counter = (t.to(torch.int64) for t in torch.broadcast_tensors(seed, offset, counter))
    if out is None:
        out = torch.empty(seed.shape, dtype=torch.float32, device=device)
    check_tensor("out", out, dtype=torch.float32, shape=tuple(seed.shape), device=device, contiguous=True)
    _counter_uniform_op.run(seed.contiguous().view(-1), offset.contiguous().view(-1), counter.contiguous().view(-1),
                        out.view(-1))  # fmt: skip
    return out


# ----------------------------------------------------------------------------- PyTorch reference


def _mix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = (x * _MUL1) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _MUL2) & _MASK32
    return x ^ (x >> 16)


def request_key(seed: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """The hash state after folding in a request's (seed, offset): compute it once per request,
    then draw any number of uniforms with ``uniform_from_key``."""
    seed, offset = seed.to(torch.int64), offset.to(torch.int64)
    h = _mix32(_HASH_START ^ (seed & _MASK32))
    h = _mix32(h ^ ((seed >> 32) & _MASK32))
    h = _mix32(h ^ (offset & _MASK32))
    return _mix32(h ^ ((offset >> 32) & _MASK32))


def uniform_from_key(key: torch.Tensor, counter: torch.Tensor | int) -> torch.Tensor:
    """fp32 uniforms for counter(s) ``counter`` from keys of ``request_key`` (the last two words)."""
    counter = torch.as_tensor(counter, dtype=torch.int64, device=key.device)
    h = _mix32(_mix32(key ^ (counter & _MASK32)))
    return (h >> 8).to(torch.float32) * _U24


def counter_uniform_reference(seed: torch.Tensor, offset: torch.Tensor, counter: torch.Tensor | int) -> torch.Tensor:
    """Readable PyTorch implementation of ``counter_uniform`` (broadcasting, no ``out``)."""
    return uniform_from_key(request_key(seed, offset), counter)


def race_clocks(seed: torch.Tensor, offset: torch.Tensor, counter: torch.Tensor | int, vocab: int) -> torch.Tensor:
    """fp32 ``[..., vocab]``: the clocks ``E_i = -log(u_i)`` of the races keyed by broadcast ``seed``, ``offset``
    and ``counter`` (the module docstring): ``race_clock_tl``'s hash bits, through PyTorch's ``log``."""
    counter = torch.as_tensor(counter, dtype=torch.int64, device=seed.device)
    key = _mix32(request_key(seed, offset) ^ (counter & _MASK32))
    h = key[..., None] ^ torch.arange(vocab, device=key.device)
    h ^= h >> 16  # _mix32 in place: a [..., vocab] int64 temporary less per step
    h.mul_(_MUL1).bitwise_and_(_MASK32)
    h ^= h >> 15
    h.mul_(_MUL2).bitwise_and_(_MASK32)
    h ^= h >> 16
    return ((h >> 8) | 1).to(torch.float32).mul_(_U24).log_().neg_()
