"""The final token of a verification: one draw from the distribution where the walk stopped
(``tree_walk`` derives which one), by the two-level inverse CDF of ``sample_probs``.

The distribution is never written out: ``_final_weights`` recomputes any tile of it from the
target tile and, for a residual, the draft row -- p itself or max(0, p - C q), as the walk's
``FINAL_*`` mode says. ``final_draw_tl`` runs in the walk's own program (one per request, so no
stage waits on another program's results): one pass sums every tile of that distribution and of
p, then with the walk's uniform ``u`` (the target's draw at the node's position) it picks the
tile whose running mass passes ``u * total`` and the token inside it. A residual whose summed
mass is below ``RESIDUAL_EPS`` (p == q up to rounding) falls back to p. The draft row is
read only for a residual, i.e. only after a rejection, so a request whose drafts were all accepted
(or that drafted nothing) never touches ``draft_probs``.
"""

from __future__ import annotations

from specdec.kernels._triton import jit, tl
from specdec.kernels.sample_probs import pick_in_tile_tl, pick_tile_tl
from specdec.kernels.target_stats import target_cols_tl, target_tile_tl

RESIDUAL_EPS = 1e-5  # a residual with less mass is rounding noise: sample from p instead

# The final draw the walk hands over:
FINAL_TARGET = tl.constexpr(1)  # draw from p
FINAL_RESIDUAL = tl.constexpr(2)  # stochastic rule: draw from max(0, p - C q), its mass summed over the tiles


@jit
def residual_tile_tl(p, q_row_ptr, cols, V, c):
    """max(0, p - C q) on one tile (negative or non-finite q read as 0; p is 0 past V)."""
    q = tl.load(q_row_ptr + tl.minimum(cols, V - 1)).to(tl.float32)  # clamped: no lane leaves the row
    return tl.maximum(p - c * tl.where((q >= 0) & (q < float("inf")), q, 0.0), 0.0)


@jit
def _final_weights(p, cols, mode, q_row, c, V, RULE: tl.constexpr):
    # The mass w the token is drawn from under `mode`, on the tile whose target probabilities are p.
    w = p
    if RULE == "stochastic":
        if mode == FINAL_RESIDUAL:  # the draft row of the final node's children: after a rejection, it exists
            w = residual_tile_tl(p, q_row, cols, V, c)
    return w


@jit
def final_draw_tl(logits_row, q_row, mode, c, u, inv_t, thr, m, z, V, n_tiles, RULE: tl.constexpr,
                  BLOCK: tl.constexpr, T_PAD: tl.constexpr, EPS: tl.constexpr, TILES: tl.constexpr):  # fmt: skip
    """The token drawn with uniform ``u`` at the node whose target row is ``logits_row`` ((inv_t, thr, m, z)
    its target): from p (FINAL_TARGET) or from max(0, p - C q) with ``q_row`` the draft row of its children
    (FINAL_RESIDUAL)."""
    # ---- per-tile mass of the final distribution w and of p, TILES tiles a step (a shorter serial chain)
    t_idx = tl.arange(0, T_PAD)
    w_tiles = tl.zeros([T_PAD], dtype=tl.float32)
    p_tiles = tl.zeros([T_PAD], dtype=tl.float32)
    for first in range(0, n_tiles, TILES):
        tiles = first + tl.arange(0, TILES)
        cols = tiles[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]  # [TILES, BLOCK]; past V: p = 0
        p = target_cols_tl(logits_row, cols, V, inv_t, thr, m, z)
        w = _final_weights(p, cols, mode, q_row, c, V, RULE)
        at = t_idx[:, None] == tiles[None, :]  # each tile's sum lands in its lane once (added to 0: exact)
        w_tiles += tl.sum(tl.where(at, tl.sum(w, 1)[None, :], 0.0), 1)
        p_tiles += tl.sum(tl.where(at, tl.sum(p, 1)[None, :], 0.0), 1)
    # ---- the draw
    total = tl.where(mode == FINAL_RESIDUAL, tl.sum(w_tiles, 0), 1.0)
    use_p = total <= EPS  # a residual of rounding noise (p == q): draw from p
    w_tiles = tl.where(use_p, p_tiles, w_tiles)
    total = tl.where(use_p, 1.0, total)
    mode = tl.where(use_p, FINAL_TARGET, mode)
    target = u * total
    tile, before = pick_tile_tl(w_tiles, t_idx, target)
    cols, p = target_tile_tl(logits_row, tile * BLOCK, V, inv_t, thr, m, z, BLOCK)
    w = _final_weights(p, cols, mode, q_row, c, V, RULE)
    return pick_in_tile_tl(w, cols, before, target)
