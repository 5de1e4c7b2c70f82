"""Temperature, top-k and top-p as one threshold per row: the first stage of every sampling op.

For a row of logits ``l`` and temperature ``T > 0`` the scaled logits are ``s = l * (1/T)``
in fp32, with ``1/T`` correctly rounded (as torch computes it) on both paths; greedy rows
(``T <= 0``) keep the raw logits. Top-k keeps ``s >= s_(k)``, the k-th largest value (ties at
the threshold are all kept; ``k <= 0`` or ``k >= V`` is off). Top-p is applied to the top-k
survivors: it keeps ``s >= t`` for the largest ``t`` whose kept mass ``sum exp(s - max)``
reaches ``top_p`` times the top-k mass, i.e. the smallest head of the sorted distribution
holding ``top_p`` of it, ties included (``top_p >= 1`` is off; ``top_p <= 0`` keeps only the
maximum). Both filters together are one threshold ``thr`` per row: keep ``s >= thr``;
``-inf`` when both are off, for greedy rows and for rows that cannot be sampled (any NaN or
+inf, or no finite value; the later stages flag those).

The Triton kernel finds ``thr`` without sorting: a search over the fp32 values' ordered
integer keys, 8 streaming passes over the row, each testing 16 candidate thresholds at once.
The reference sorts the whole row. The PyTorch path (``filter_thresholds_torch``) sorts only the
head that decides every threshold, ``topk`` of a width that grows until it does (a whole-row sort
is far dearer than sorting the narrow head). Every later stage reads a row through
``scaled_tile_tl``, one vocabulary tile at a time (``vocab_block`` columns), so no program ever
holds a whole row.
"""

from __future__ import annotations

import functools

import torch

from specdec.kernels._triton import jit, next_power_of_2, tl
from specdec.kernels.tuning import TuningSpace, launch

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # of logits and probabilities
# How the filter kernel finds the request (and so the parameters) of a row:
ROWS_ARE_REQUESTS = "rows"  # row r belongs to request r
ROWS_BY_NODE_OFFSETS = "nodes"  # request b owns rows offsets[b] .. offsets[b+1]-1
ROWS_BY_DRAFT_OFFSETS = "chain"  # request b owns rows offsets[b]+b .. offsets[b+1]+b (K_b drafts + 1)


def vocab_block(vocab: int) -> int:
    """Vocabulary tile width of every sampling kernel: about four tiles for small vocabularies
    (so tile edges are exercised in tests), 1024 columns for large ones."""
    return max(16, min(1024, next_power_of_2(max(vocab, 1)) // 4))


# ----------------------------------------------------------------------------- Triton helpers


@jit
def inverse_temperature_tl(t):
    """1/T correctly rounded (as torch computes it); -1 for greedy rows (T <= 0); NaN stays NaN."""
    return tl.where(t <= 0, -1.0, tl.math.div_rn(1.0, tl.where(t <= 0, 1.0, t)))


@jit
def row_load_tl(row_ptr, cols, inside, V):
    """``row_ptr[cols]`` for a block of consecutive columns; ``inside``: every one lies inside the row. Then the
    load is a plain one, which the compiler vectorises; else (the row's last block) lanes past V read column V - 1:
    clamped addresses keep every lane inside the row (a masked lane may not point outside either), but are read a
    value at a time."""
    if inside:
        x = tl.load(row_ptr + cols)
    else:
        x = tl.load(row_ptr + tl.minimum(cols, V - 1))
    return x


@jit
def scaled_tile_tl(row_ptr, start, V, inv_t, BLOCK: tl.constexpr):
    """One vocabulary tile of a row: (cols, in-vocabulary mask, s = l * inv_t in fp32, -inf past V)."""
    cols = start + tl.arange(0, BLOCK)
    inb = cols < V
    logits = row_load_tl(row_ptr, cols, start + BLOCK <= V, V).to(tl.float32)
    return cols, inb, tl.where(inb, logits * inv_t, float("-inf"))


@jit
def _ordered_key(x):
    # fp32 -> int32 whose signed order is the float order (for non-NaN values).
    bits = x.to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@jit
def _key_to_float(key):
    bits = tl.where(key >= 0, key, key ^ 0x7FFFFFFF)
    return bits.to(tl.float32, bitcast=True)


@jit
def _mass_above(row_ptr, V, inv_t, m, t, BLOCK: tl.constexpr):
    # Mass sum exp(s - m) of the entries with s >= t, summed in the same order as one column of
    # the search below, so the search's lower bound passes its own test exactly.
    acc = tl.zeros([BLOCK, 1], dtype=tl.float32)
    for start in range(0, V, BLOCK):
        cols, inb, s = scaled_tile_tl(row_ptr, start, V, inv_t, BLOCK)
        acc += tl.where(inb & (s >= t) & (s > float("-inf")), tl.exp(s - m), 0.0)[:, None]
    return tl.sum(tl.sum(acc, 0), 0)


@jit
def _threshold_search(row_ptr, V, inv_t, m, floor, target, BY_COUNT: tl.constexpr, BLOCK: tl.constexpr):
    # Largest t with mass_above(t) >= target (BY_COUNT: the number of entries >= t). The answer's
    # key lies in [lo, hi): mass_above(floor) >= target by construction and nothing lies above m.
    # Each pass tests WAYS candidates and keeps the bracket between the last one that passes and
    # the first that fails.
    WAYS: tl.constexpr = 16
    j = tl.arange(0, WAYS)
    lo = _ordered_key(floor).to(tl.int64)
    hi = _ordered_key(m).to(tl.int64) + 1
    while hi - lo > 1:
        cand = lo + ((hi - lo) * j) // WAYS  # cand[0] = lo, all < hi
        t = _key_to_float(cand.to(tl.int32))
        acc = tl.zeros([BLOCK, WAYS], dtype=tl.float32)
        for start in range(0, V, BLOCK):  # scaled_tile_tl inline: nested jit calls are slow in the interpreter
            cols = start + tl.arange(0, BLOCK)
            s = row_load_tl(row_ptr, cols, start + BLOCK <= V, V).to(tl.float32) * inv_t
            sel = (cols < V)[:, None] & (s[:, None] >= t[None, :])
            if BY_COUNT:
                acc += sel.to(tl.float32)
            else:
                acc += tl.where(sel & (s > float("-inf"))[:, None], tl.exp(s - m)[:, None], 0.0)
        ok = (tl.sum(acc, 0) >= target) | (j == 0)
        new_lo = tl.max(tl.where(ok, cand, lo), 0)
        hi = tl.min(tl.where(ok, hi, cand), 0)
        lo = new_lo
    return _key_to_float(lo.to(tl.int32))


# ----------------------------------------------------------------------------- kernel


@jit
def _threshold_kernel(
    logits_ptr,  # [R, V] fp32/fp16/bf16, row stride stride_row
    offsets_ptr,  # [B+1] int32 request offsets (read as ROWS says; unused for ROWS_ARE_REQUESTS)
    temp_ptr,  # [B] fp32
    top_k_ptr,  # [B] int32
    top_p_ptr,  # [B] fp32
    thr_ptr,  # [R] fp32 out: keep s >= thr (-inf: keep all)
    inv_row_ptr,  # [R] fp32 out: the row's scale 1/T (1 for greedy rows)
    n_req,
    V,
    stride_row,
    ROWS: tl.constexpr,  # ROWS_ARE_REQUESTS, ROWS_BY_NODE_OFFSETS or ROWS_BY_DRAFT_OFFSETS
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    # ---- the row's request: bisect the offsets (start of request lo <= row < start of request hi)
    lo = row * 0
    if ROWS == "rows":
        lo = row
    else:
        hi = lo + n_req
        while hi - lo > 1:
            mid = (lo + hi) // 2
            go = tl.load(offsets_ptr + mid) + (mid if ROWS == "chain" else 0) <= row
            lo = tl.where(go, mid, lo)
            hi = tl.where(go, hi, mid)
    inv_t = inverse_temperature_tl(tl.load(temp_ptr + lo))
    tl.store(inv_row_ptr + row, tl.where(inv_t < 0, 1.0, inv_t))
    k = tl.load(top_k_ptr + lo)
    top_p = tl.load(top_p_ptr + lo)
    use_k = (inv_t > 0) & (k > 0) & (k < V)
    use_p = (inv_t > 0) & (top_p < 1)
    thr = tl.where(use_k, float("-inf"), float("-inf"))  # an fp32 scalar tensor
    if use_k | use_p:
        row_ptr = logits_ptr + row.to(tl.int64) * stride_row
        # ---- pass 1: row maximum; rows with NaN/+inf cannot be sampled and are left unfiltered
        mx = tl.full([BLOCK], float("-inf"), tl.float32)
        bad = tl.zeros([BLOCK], dtype=tl.int32)
        for start in range(0, V, BLOCK):
            cols, inb, s = scaled_tile_tl(row_ptr, start, V, inv_t, BLOCK)
            bad += ((s != s) | (s == float("inf"))).to(tl.int32)
            mx = tl.maximum(mx, s)
        m = tl.max(mx, 0)
        if (tl.sum(bad, 0) == 0) & (m > float("-inf")):
            if use_k:
                thr = _threshold_search(row_ptr, V, inv_t, m, thr, k.to(tl.float32), True, BLOCK)
            if use_p:
                # same summation as inside the search, so the floor itself always passes
                target = tl.maximum(top_p, 0.0) * _mass_above(row_ptr, V, inv_t, m, thr, BLOCK)
                thr = _threshold_search(row_ptr, V, inv_t, m, thr, target, False, BLOCK)
    tl.store(thr_ptr + row, thr)


# ----------------------------------------------------------------------------- launcher

# The streaming tile is private to this kernel (no other stage reads per-tile results), so it is tuned
# with the warps. A pass holds a [BLOCK, 16] fp32 accumulator: 1024 x 16 needs 8 warps (4 spill);
# (256, 4) and (512, 8) spill a few bytes on sm_80 with Triton 3.6.
THRESHOLD_SPACE = TuningSpace(
    (dict(BLOCK=1024, num_warps=8), dict(BLOCK=512, num_warps=4), dict(BLOCK=256, num_warps=8)), key=("V", "ROWS")
)


def filter_thresholds_triton(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    block: int,
    rows: str = ROWS_ARE_REQUESTS,
    offsets: torch.Tensor | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row threshold ``thr [R]`` fp32 and scale ``1/T [R]`` fp32 (1 for greedy rows) of ``logits
    [R, V]`` (unit column stride) for per-request parameters ``[B]``; ``rows`` says which request a
    row belongs to (one of ``ROWS_*``, with int32 ``offsets [B+1]`` unless rows are requests).
    ``block`` is the default tile width; ``out`` = (thr, inv_row) to write (else fresh). Triton
    launcher, no checks."""
    n_rows, vocab = logits.shape
    if out is None:
        out = (torch.empty(n_rows, dtype=torch.float32, device=logits.device),
               torch.empty(n_rows, dtype=torch.float32, device=logits.device))  # fmt: skip
    thr, inv_row = out
    if offsets is None:  # ROWS_ARE_REQUESTS: never read
        offsets = top_k
    if n_rows:
        args = (logits, offsets, temperature, top_k, top_p, thr, inv_row, temperature.shape[0], vocab,
                logits.stride(0))  # fmt: skip
        launch(_threshold_kernel, (n_rows,), args, _ROWS_META[rows], _threshold_config(block), THRESHOLD_SPACE)
    return thr, inv_row


_ROWS_META = {rows: dict(ROWS=rows) for rows in (ROWS_ARE_REQUESTS, ROWS_BY_NODE_OFFSETS, ROWS_BY_DRAFT_OFFSETS)}


@functools.cache
def _threshold_config(block: int) -> dict:
    """The default configuration for a tile (made once: launches read it, never change it)."""
    return dict(BLOCK=block, num_warps=8 if block >= 1024 else 4)


# ----------------------------------------------------------------------------- PyTorch reference


def inverse_temperature(temperature: torch.Tensor) -> torch.Tensor:
    """1/T (-1 for greedy requests, T <= 0; a NaN temperature stays NaN and invalidates the rows)."""
    return torch.where(temperature <= 0, -1.0, 1.0 / temperature)


def scaled_logits(logits: torch.Tensor, temperature_rows: torch.Tensor) -> torch.Tensor:
    """fp32 ``s = l * (1/T)`` of ``logits [R, V]`` with one temperature per row; greedy rows keep ``l``."""
    inv_t = inverse_temperature(temperature_rows)
    return logits.float() * torch.where(inv_t < 0, 1.0, inv_t)[:, None]


def bad_rows(s: torch.Tensor) -> torch.Tensor:
    """bool ``[R]``: rows that cannot be sampled (any NaN or +inf, or no finite value)."""
    return (torch.isnan(s) | (s == float("inf"))).any(-1) | ~(s > float("-inf")).any(-1)


def filters_on(s: torch.Tensor, temperature_rows, top_k_rows, top_p_rows) -> tuple[torch.Tensor, ...]:
    """(use_k, use_p) bool ``[R]``: which rows of ``s [R, V]`` each filter applies to, and the all-off
    threshold ``-inf [R]`` fp32 (greedy and unsampleable rows keep it)."""
    sampled = (temperature_rows > 0) & ~bad_rows(s)
    use_k = sampled & (top_k_rows > 0) & (top_k_rows < s.shape[1])
    use_p = sampled & (top_p_rows < 1)
    return use_k, use_p, torch.full((s.shape[0],), float("-inf"), dtype=torch.float32, device=s.device)


def filter_thresholds_reference(
    s: torch.Tensor, temperature_rows: torch.Tensor, top_k_rows: torch.Tensor, top_p_rows: torch.Tensor
) -> torch.Tensor:
    """Threshold ``thr [R]`` fp32 for scaled logits ``s [R, V]`` (by sorting; the kernel's contract)."""
    vocab, ninf = s.shape[1], float("-inf")
    use_k, use_p, thr = filters_on(s, temperature_rows, top_k_rows, top_p_rows)
    if not bool((use_k | use_p).any()):
        return thr
    ordered = s.sort(dim=-1, descending=True).values
    kth = ordered.gather(1, (top_k_rows.long().clamp(1, vocab) - 1)[:, None])[:, 0]
    thr = torch.where(use_k, kth, thr)
    m = ordered[:, :1]
    e = torch.where((ordered >= thr[:, None]) & (ordered > ninf), torch.exp(ordered - m), 0.0)
    target = top_p_rows.float().clamp_min(0.0) * e.sum(-1)
    first = (e.cumsum(-1) < target[:, None]).sum(-1).clamp_max(vocab - 1)  # first head reaching target
    return torch.where(use_p, ordered.gather(1, first[:, None])[:, 0], thr)


def filter_thresholds_torch(
    s: torch.Tensor, temperature_rows: torch.Tensor, top_k_rows: torch.Tensor, top_p_rows: torch.Tensor
) -> torch.Tensor:
    """``filter_thresholds_reference``'s thresholds from the sorted head of each row, not the whole row.

    The head's values are the sorted row's first ``width`` values, so its running mass is the
    reference's prefix: the top-p cut is found once the head's mass reaches ``top_p`` of the kept
    mass (summed over the unsorted row), else the head widens 4x up to the whole row. Reads a few
    host facts (the largest k, whether every cut was reached): it is the CPU's body, never a GPU hot path.
    """
    vocab, ninf = s.shape[1], float("-inf")
    use_k, use_p, thr = filters_on(s, temperature_rows, top_k_rows, top_p_rows)
    if not bool((use_k | use_p).any()):
        return thr
    k = top_k_rows.long().clamp(1, vocab)
    width = min(vocab, max(64, int(torch.where(use_k, k, 1).max())))  # holds every top-k cut
    head = s.topk(width, dim=-1).values
    thr = torch.where(use_k, head.gather(1, (k.clamp_max(width) - 1)[:, None])[:, 0], thr)
    if not bool(use_p.any()):
        return thr
    m = head[:, :1]
    kept = torch.where((s >= thr[:, None]) & (s > ninf), torch.exp(s - m), 0.0)
    target = top_p_rows.float().clamp_min(0.0) * kept.sum(-1)
    while True:
        mass = torch.where((head >= thr[:, None]) & (head > ninf), torch.exp(head - m), 0.0).cumsum(-1)
        if width == vocab or bool(((mass[:, -1] >= target) | ~use_p).all()):
            break
        width = min(vocab, 4 * width)
        head = s.topk(width, dim=-1).values
    first = (mass < target[:, None]).sum(-1).clamp_max(width - 1)  # first head entry reaching target
    return torch.where(use_p, head.gather(1, first[:, None])[:, 0], thr)
