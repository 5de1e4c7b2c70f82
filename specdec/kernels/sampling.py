"""Pieces shared by the sampling and verification ops: counter-based uniforms, the
temperature / top-k / top-p filter, and the target distribution over vocabulary tiles.

Uniforms. Every random number is a pure function of ``(seed, offset, counter)``:
a 32-bit integer hash folded over the two 32-bit halves of the request's seed and
offset and the counter, whose top 24 bits give ``u = h / 2**24`` in [0, 1). The
hash uses only shifts, xors and products below 2**63, so int64 arithmetic in
PyTorch and in Triton (compiled or interpreted) yields the same bits: the Triton
kernels and the PyTorch references see identical uniforms and can be compared
token for token. Results depend on neither batch size, row order nor replay.

Filter. For a row of logits ``l`` and temperature ``T > 0`` the scaled logits are
``s = l * (1/T)`` (fp32). Top-k keeps ``s >= s_(k)``, the k-th largest value
(ties at the threshold are all kept; ``k <= 0`` or ``k >= V`` is off). Top-p is
applied to the top-k survivors: it keeps ``s >= t`` for the largest ``t`` whose
kept mass ``sum exp(s - max)`` reaches ``top_p`` times the top-k mass, i.e. the
smallest head of the sorted distribution holding ``top_p`` of it, ties included
(``top_p >= 1`` is off; ``top_p <= 0`` keeps only the maximum). Either filter is
one threshold ``thr`` per row, ``-inf`` when off and for greedy rows (``T <= 0``).
The Triton path finds it by a binary search over the fp32 values' ordered integer
keys (8 streaming passes over the row, each testing 16 candidates; no sort); the reference sorts.

Tiles. ``_row_stats_kernel`` (rows x tiles) reduces every tile of every row to its kept
maximum, ``sum exp(s - max)``, first argmax and count of NaN/+inf; ``combine_row_tl`` merges a
row's tiles into ``(max, Z, argmax, bad)`` and ``tile_mass_tl`` evaluates ``p = exp(s - max) / Z``
(or ``max(0, p - C q)``) on one tile, so no program ever holds a whole row.
"""

from __future__ import annotations

import torch

from specdec.kernels._triton import jit, tl, triton

_MASK32 = 0xFFFFFFFF
_HASH_START = 0x243F6A88
_MUL1 = 0x7FEB352D  # odd multipliers below 2**31: (x < 2**32) * m stays below 2**63
_MUL2 = 0x68E31DA5
_U24 = 1.0 / 16777216.0


# ----------------------------------------------------------------------------- Triton helpers


@jit
def counter_uniform_tl(seed, offset, counter):
    """Uniform in [0, 1) for int64 scalars (seed, offset) and an integer counter."""
    # Fold the 32-bit words seed_lo, seed_hi, offset_lo, offset_hi, counter, 0 into h with the
    # 32-bit mix; values live in int64 and every product stays below 2**63 (no overflow).
    # (Written inline: nested jit calls are slow in the interpreter.)
    seed = seed.to(tl.int64)
    offset = offset.to(tl.int64)
    h = seed * 0 + 0x243F6A88
    for i in tl.static_range(6):
        if i == 0:
            h = h ^ (seed & 0xFFFFFFFF)
        if i == 1:
            h = h ^ ((seed >> 32) & 0xFFFFFFFF)
        if i == 2:
            h = h ^ (offset & 0xFFFFFFFF)
        if i == 3:
            h = h ^ ((offset >> 32) & 0xFFFFFFFF)
        if i == 4:
            h = h ^ (counter.to(tl.int64) & 0xFFFFFFFF)
        h = h ^ (h >> 16)
        h = (h * 0x7FEB352D) & 0xFFFFFFFF
        h = h ^ (h >> 15)
        h = (h * 0x68E31DA5) & 0xFFFFFFFF
        h = h ^ (h >> 16)
    return (h >> 8).to(tl.float32) * (1.0 / 16777216.0)


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
        cols = start + tl.arange(0, BLOCK)
        s = tl.load(row_ptr + cols, mask=cols < V, other=float("-inf")).to(tl.float32) * inv_t
        sel = (cols < V) & (s >= t) & (s > float("-inf"))
        acc += tl.where(sel, tl.exp(s - m), 0.0)[:, None]
    return tl.sum(tl.sum(acc, 0), 0)


@jit
def _threshold_search(row_ptr, V, inv_t, m, floor, target, BY_COUNT: tl.constexpr, BLOCK: tl.constexpr):
    # Largest t with mass_above(t) >= target. The answer's key lies in [lo, hi): mass_above(floor)
    # >= target by construction and nothing lies above m. Each pass tests WAYS candidates at once
    # and keeps the bracket between the last one that passes and the first that fails, so the
    # 32-bit key range needs ceil(32 / log2(WAYS)) = 8 passes over the row.
    WAYS: tl.constexpr = 16
    j = tl.arange(0, WAYS)
    lo = _ordered_key(floor).to(tl.int64)
    hi = _ordered_key(m).to(tl.int64) + 1
    while hi - lo > 1:
        cand = lo + ((hi - lo) * j) // WAYS  # cand[0] = lo, all < hi
        key = cand.to(tl.int32)
        t = tl.where(key >= 0, key, key ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)  # key -> float
        acc = tl.zeros([BLOCK, WAYS], dtype=tl.float32)
        for start in range(0, V, BLOCK):  # mass_above(t), inline (nested jit calls are slow interpreted)
            cols = start + tl.arange(0, BLOCK)
            s = tl.load(row_ptr + cols, mask=cols < V, other=float("-inf")).to(tl.float32) * inv_t
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


# ----------------------------------------------------------------------------- filter kernel


@jit
def _filter_threshold_kernel(
    logits_ptr,  # [R, V] fp32/fp16/bf16, row stride stride_row
    offsets_ptr,  # [B+1] int32: request b owns rows offsets[b] .. offsets[b+1]-1 (each at least one);
    #               CHAIN: draft offsets, request b owns rows offsets[b]+b .. offsets[b+1]+b
    temp_ptr,  # [B] fp32
    top_k_ptr,  # [B] int32
    top_p_ptr,  # [B] fp32
    thr_ptr,  # [R] fp32 out: keep s >= thr (-inf = keep all)
    inv_row_ptr,  # [R] fp32 out: the row's scale 1/T (1 for greedy rows)
    n_req,
    V,
    stride_row,
    CHAIN: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    # ---- the row's request: bisect the offsets (offsets[lo] <= row < offsets[hi])
    lo = row * 0
    hi = lo + n_req
    while hi - lo > 1:
        mid = (lo + hi) // 2
        go = tl.load(offsets_ptr + mid) + (mid if CHAIN else 0) <= row
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid)
    t = tl.load(temp_ptr + lo)
    # 1/T correctly rounded, as torch computes it; -1 marks greedy; a NaN temperature stays NaN
    inv_t = tl.where(t <= 0, -1.0, tl.math.div_rn(1.0, tl.where(t <= 0, 1.0, t)))
    tl.store(inv_row_ptr + row, tl.where(inv_t < 0, 1.0, inv_t))
    k = tl.load(top_k_ptr + lo)
    top_p = tl.load(top_p_ptr + lo)
    use_k = (inv_t > 0) & (k > 0) & (k < V)
    use_p = (inv_t > 0) & (top_p < 1)
    thr = tl.where(use_k, float("-inf"), float("-inf"))  # an fp32 scalar tensor
    if use_k | use_p:
        row_ptr = logits_ptr + row.to(tl.int64) * stride_row
        # ---- pass 1: row maximum; rows with NaN/+inf are invalid and left unfiltered
        mx = tl.full([BLOCK], float("-inf"), tl.float32)
        bad = tl.zeros([BLOCK], dtype=tl.int32)
        for start in range(0, V, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            s = tl.load(row_ptr + cols, mask=cols < V, other=float("-inf")).to(tl.float32) * inv_t
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


def filter_thresholds_triton(
    logits: torch.Tensor,
    offsets: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    block: int,
    chain: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row threshold ``thr [R]`` fp32 of the filter and the row's scale ``1/T [R]`` fp32 (1 for
    greedy rows), for requests owning rows by int32 ``offsets [B+1]`` (``chain``: draft offsets,
    K_b + 1 rows per request). Triton launcher, no checks."""
    rows, vocab = logits.shape
    thr = torch.empty(rows, dtype=torch.float32, device=logits.device)
    inv_row = torch.empty_like(thr)
    if rows:
        _filter_threshold_kernel[(rows,)](
            logits, offsets, temperature, top_k, top_p, thr, inv_row, offsets.numel() - 1, vocab, logits.stride(0),
            CHAIN=chain, BLOCK=block,
        )  # fmt: skip
    return thr, inv_row


# ----------------------------------------------------------------------------- per-tile statistics of the target


@jit
def _row_stats_kernel(
    logits_ptr,  # [R, V] fp32/fp16/bf16
    inv_row_ptr,  # [R] fp32 scale of the row (1/T; 1 for greedy rows)
    thr_ptr,  # [R] fp32 filter threshold on s
    max_ptr,  # [R, n_tiles] fp32 out: max of kept s in the tile
    sum_ptr,  # [R, n_tiles] fp32 out: sum exp(s - tile max) over kept entries
    arg_ptr,  # [R, n_tiles] int32 out: first index of the tile max
    bad_ptr,  # [R, n_tiles] int32 out: number of NaN/+inf entries
    V,
    n_tiles,
    stride_row,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    tile = tl.program_id(1)
    inv_t = tl.load(inv_row_ptr + row)
    thr = tl.load(thr_ptr + row)
    cols = tile * BLOCK + tl.arange(0, BLOCK)
    inb = cols < V
    s = tl.load(logits_ptr + row.to(tl.int64) * stride_row + cols, mask=inb, other=float("-inf")).to(tl.float32)
    s = s * inv_t
    bad = (s != s) | (s == float("inf"))
    kept = inb & (s >= thr) & ~bad
    sk = tl.where(kept, s, float("-inf"))
    m = tl.max(sk, 0)
    m_safe = tl.where(m > float("-inf"), m, 0.0)  # an all -inf tile: no (-inf) - (-inf)
    e = tl.where(kept & (sk > float("-inf")), tl.exp(sk - m_safe), 0.0)
    arg = tl.min(tl.where(kept & (sk == m), cols, 2147483647), 0)
    out = row.to(tl.int64) * n_tiles + tile
    tl.store(max_ptr + out, m)
    tl.store(sum_ptr + out, tl.sum(e, 0))
    tl.store(arg_ptr + out, arg)
    tl.store(bad_ptr + out, tl.sum(bad.to(tl.int32), 0))


@jit
def combine_row_tl(max_ptr, sum_ptr, arg_ptr, bad_ptr, row, n_tiles, T_PAD: tl.constexpr):
    # Row max m, normaliser Z = sum exp(s - m), argmax and "cannot be sampled" from the tile partials.
    c = tl.arange(0, T_PAD)
    ok = c < n_tiles
    base = row.to(tl.int64) * n_tiles
    mc = tl.load(max_ptr + base + c, mask=ok, other=float("-inf"))
    sc = tl.load(sum_ptr + base + c, mask=ok, other=0.0)
    ac = tl.load(arg_ptr + base + c, mask=ok, other=2147483647)
    bc = tl.load(bad_ptr + base + c, mask=ok, other=0)
    m = tl.max(mc, 0)
    z = tl.sum(tl.where(mc > float("-inf"), sc * tl.exp(mc - tl.where(m > float("-inf"), m, 0.0)), 0.0), 0)
    arg = tl.min(tl.where((mc == m) & ok, ac, 2147483647), 0)
    bad = (tl.sum(bc, 0) > 0) | (m == float("-inf"))
    return m, z, arg, bad


@jit
def tile_mass_tl(row_ptr, q_ptr, cols, V, inv_t, thr, m, z, c, HAS_Q: tl.constexpr):
    # One tile of the node's target p and of the unnormalised mass of its current distribution:
    # p itself, or max(0, p - c q) under the stochastic rule.
    inb = cols < V
    s = tl.load(row_ptr + cols, mask=inb, other=float("-inf")).to(tl.float32) * inv_t
    kept = inb & (s >= thr) & (s > float("-inf"))
    p = tl.where(kept, tl.exp(s - m) / z, 0.0)
    mass = p
    if HAS_Q:
        q = tl.load(q_ptr + cols, mask=inb, other=0.0).to(tl.float32)
        q = tl.where((q >= 0) & (q < float("inf")), q, 0.0)
        mass = tl.maximum(p - c * q, 0.0)
    return p, mass


def row_stats_triton(logits, inv_row, thr, block):
    """Tile partials (max, sum exp, argmax, bad count), each ``[R, cdiv(V, block)]`` (launcher, no checks)."""
    rows, vocab = logits.shape
    n_tiles = triton.cdiv(vocab, block)
    part_max = torch.empty(rows, n_tiles, dtype=torch.float32, device=logits.device)
    part_sum = torch.empty_like(part_max)
    part_arg = torch.empty(rows, n_tiles, dtype=torch.int32, device=logits.device)
    part_bad = torch.empty_like(part_arg)
    if rows:
        _row_stats_kernel[(rows, n_tiles)](
            logits, inv_row, thr, part_max, part_sum, part_arg, part_bad,
            vocab, n_tiles, logits.stride(0), BLOCK=block,
        )  # fmt: skip
    return part_max, part_sum, part_arg, part_bad


# ----------------------------------------------------------------------------- PyTorch references


def _mix32_torch(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x.mul_(_MUL1).bitwise_and_(_MASK32)
    x.bitwise_xor_(x >> 15)
    x.mul_(_MUL2).bitwise_and_(_MASK32)
    return x.bitwise_xor_(x >> 16)


def request_key(seed: torch.Tensor, offset: torch.Tensor) -> torch.Tensor:
    """The hash state after folding in (seed, offset): compute once per request, then ``uniform_from_key``."""
    seed, offset = seed.to(torch.int64), offset.to(torch.int64)
    h = _mix32_torch(_HASH_START ^ (seed & _MASK32))
    h = _mix32_torch(h ^ ((seed >> 32) & _MASK32))
    h = _mix32_torch(h ^ (offset & _MASK32))
    return _mix32_torch(h ^ ((offset >> 32) & _MASK32))


def uniform_from_key(key: torch.Tensor, counter: torch.Tensor | int) -> torch.Tensor:
    counter = torch.as_tensor(counter, dtype=torch.int64, device=key.device)
    h = _mix32_torch(_mix32_torch(key ^ (counter & _MASK32)))
    return (h >> 8).to(torch.float32) * _U24


def counter_uniform(seed: torch.Tensor, offset: torch.Tensor, counter: torch.Tensor | int) -> torch.Tensor:
    """Uniforms in [0, 1) (fp32), elementwise over broadcast int64 ``seed``, ``offset``, ``counter``.

    Bit-identical to ``counter_uniform_tl`` inside the Triton kernels.
    """
    return uniform_from_key(request_key(seed, offset), counter)


def inverse_temperature(temperature: torch.Tensor) -> torch.Tensor:
    """What the kernels read instead of T: 1/T (computed here, so both paths scale by the same
    bits), -1 for greedy requests (T <= 0); a NaN temperature stays NaN and invalidates the rows."""
    return torch.where(temperature <= 0, -1.0, 1.0 / temperature)


def scaled_logits(logits: torch.Tensor, temperature_rows: torch.Tensor) -> torch.Tensor:
    """fp32 ``s = l * (1/T)`` per row; greedy rows (T <= 0) keep the raw logits."""
    inv_t = inverse_temperature(temperature_rows)
    return logits.float() * torch.where(inv_t < 0, 1.0, inv_t)[:, None]


def bad_rows(s: torch.Tensor) -> torch.Tensor:
    """Rows that cannot be sampled: any NaN or +inf, or no finite value."""
    return (torch.isnan(s) | (s == float("inf"))).any(-1) | ~(s > float("-inf")).any(-1)


def filter_thresholds_reference(
    s: torch.Tensor, temperature_rows: torch.Tensor, top_k_rows: torch.Tensor, top_p_rows: torch.Tensor
) -> torch.Tensor:
    """Threshold ``thr [R]`` for scaled logits ``s [R, V]`` (sorting; same contract as the kernel)."""
    rows, vocab = s.shape
    ninf = float("-inf")
    sampled = (temperature_rows > 0) & ~bad_rows(s)
    use_k = sampled & (top_k_rows > 0) & (top_k_rows < vocab)
    use_p = sampled & (top_p_rows < 1)
    thr = torch.full((rows,), ninf, dtype=torch.float32, device=s.device)
    if rows == 0 or not bool((use_k | use_p).any()):
        return thr
    ordered = s.sort(dim=-1, descending=True).values
    kth = ordered.gather(1, (top_k_rows.long().clamp(1, vocab) - 1)[:, None])[:, 0]
    thr = torch.where(use_k, kth, thr)
    m = ordered[:, :1]
    e = torch.where((ordered >= thr[:, None]) & (ordered > ninf), torch.exp(ordered - m), 0.0)
    target = top_p_rows.float().clamp_min(0.0) * e.sum(-1)
    first = (e.cumsum(-1) < target[:, None]).sum(-1).clamp_max(vocab - 1)  # first head reaching target
    return torch.where(use_p, ordered.gather(1, first[:, None])[:, 0], thr)


def target_probs_reference(s: torch.Tensor, thr: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(p [R, V] fp32 filtered and normalised, argmax [R] int64, bad [R] bool) from scaled logits.

    ``p = exp(s - max) / Z`` on kept entries (``s >= thr``), 0 elsewhere; bad rows get p = 0.
    """
    bad = bad_rows(s)
    clean = torch.where(torch.isnan(s), float("-inf"), s)
    m = clean.max(-1, keepdim=True).values
    kept = (s >= thr[:, None]) & (s > float("-inf")) & ~bad[:, None]
    e = torch.where(kept, torch.exp(clean - torch.where(bad[:, None], 0.0, m)), 0.0)
    z = e.sum(-1, keepdim=True)
    p = e / torch.where(z > 0, z, 1.0)
    return p, clean.argmax(-1), bad


def sanitize_draft_probs(q: torch.Tensor) -> torch.Tensor:
    """Draft probabilities as the residual uses them: negative or non-finite entries count as 0."""
    q = q.float()
    return torch.where((q >= 0) & (q < float("inf")), q, 0.0)


def inverse_cdf_reference(mass: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per row, the first index whose running sum of ``mass`` exceeds ``target`` (among positive
    entries); when rounding leaves the sum short of ``target``, the last positive entry."""
    positive = mass > 0
    hit = (mass.cumsum(-1) > target[:, None]) & positive
    idx = torch.arange(mass.shape[-1], device=mass.device)
    first = torch.where(hit, idx, mass.shape[-1]).min(-1).values
    last = torch.where(positive, idx, -1).max(-1).values
    return torch.where(first < mass.shape[-1], first, last)
