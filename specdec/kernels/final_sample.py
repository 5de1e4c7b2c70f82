"""The final token of a verification: one draw from the distribution where the walk stopped
(``tree_walk`` derives which one), by the keyed exponential race of ``sample_probs``.

The distribution is never written out: each block of it is recomputed from the target tile and, for
a residual, the draft row -- p itself or max(0, p - C q), as the walk's ``FINAL_*`` mode says.
``final_draw_tl`` runs in the walk's own program (one per request, so no stage waits on another
program's results) and streams the row once: with the race key the walk hands it (the target's draw
at the node's position, ``ROLE_TARGET``) it folds every block into the race over p and, for a
residual, into the race over the residual with the same clocks while summing the residual's mass.
A residual whose summed mass is below ``RESIDUAL_EPS`` (p == q up to rounding) falls back to p's
winner. The draft row is read only for a residual, i.e. only after a rejection, so a request whose
drafts were all accepted (or that drafted nothing) never touches ``draft_probs``.
"""

from __future__ import annotations

from specdec.kernels._triton import constant, jit, tl
from specdec.kernels.sample_probs import race_block_tl
from specdec.kernels.target_stats import target_values_tl
from specdec.kernels.top_k_top_p import row_load_tl
from specdec.kernels.uniforms import race_clock_tl

RESIDUAL_EPS = 1e-5  # a residual with less mass is rounding noise: sample from p instead

# The final draw the walk hands over:
FINAL_TARGET = constant(1)  # draw from p
FINAL_RESIDUAL = constant(2)  # stochastic rule: draw from max(0, p - C q), its mass summed over the row


@jit
def residual_tile_tl(p, q, c):
    """max(0, p - C q) on one tile of p and the draft row's values q there (negative or non-finite q read as 0)."""
    q = q.to(tl.float32)
    return tl.maximum(p - c * tl.where((q >= 0) & (q < float("inf")), q, 0.0), 0.0)


@jit
def final_draw_tl(logits_row, q_row, mode, c, key, inv_t, thr, m, z, V, n_tiles, RULE: tl.constexpr,
                  BLOCK: tl.constexpr, EPS: tl.constexpr, TILES: tl.constexpr):  # fmt: skip
    """The token the race with key ``key`` draws at the node whose target row is ``logits_row`` ((inv_t, thr,
    m, z) its target): from p (FINAL_TARGET) or from max(0, p - C q) with ``q_row`` the draft row of its
    children (FINAL_RESIDUAL, stochastic rule only)."""
    best_p = inv_t * 0.0 - 1.0  # (fp32 scalars: a score of -1 never wins)
    arg_p = (key * 0 - 1).to(tl.int32)
    best_w = best_p
    arg_w = arg_p
    total = inv_t * 0.0
    # ---- TILES vocabulary tiles a step (a shorter serial chain), in column order, as one 1-D block: a
    # [TILES, BLOCK] block spills once its loads are vectorised
    for first in range(0, n_tiles, TILES):
        cols = first * BLOCK + tl.arange(0, TILES * BLOCK)  # past V: p = 0
        inside = (first + TILES) * BLOCK <= V
        p = target_values_tl(row_load_tl(logits_row, cols, inside, V), cols, V, inv_t, thr, m, z)
        e = race_clock_tl(key, cols)  # one clock per entry, shared by both races
        best_p, arg_p = race_block_tl(p, cols, e, best_p, arg_p)
        if RULE == "stochastic":
            if mode == FINAL_RESIDUAL:  # the draft row of the final node's children: after a rejection, it exists
                w = residual_tile_tl(p, row_load_tl(q_row, cols, inside, V), c)
                total += tl.sum(w, 0)
                best_w, arg_w = race_block_tl(w, cols, e, best_w, arg_w)
    # ---- the residual's winner, unless it is rounding noise (p == q): then p's
    if RULE == "stochastic":
        arg_p = tl.where((mode == FINAL_RESIDUAL) & (total > EPS), arg_w, arg_p)
    return arg_p
