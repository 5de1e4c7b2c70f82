"""The final token of a verification: one draw from the distribution where the walk stopped
(``tree_walk`` derives which one), by the two-level inverse CDF of ``sample_probs``.

The distribution is never written out: ``_final_weights`` recomputes any tile of it from the
target tile and, for a residual, the draft row -- p itself, max(0, p - C q), or p without the
rejected children, as the walk's ``FINAL_*`` mode says. ``final_draw_tl`` runs in the walk's own
program (one per request, so no stage waits on another program's results): one pass sums every
tile of that distribution and of p, then it draws ``u = counter_uniform(seed, offset, 2 * node + 1)``,
picks the tile whose running mass passes ``u * total`` and the token inside it. A residual whose
summed mass is below ``RESIDUAL_EPS`` (p == q up to rounding) falls back to p. The draft row is
read only for a residual, i.e. only after a rejection, so a request whose drafts were all accepted
(or that drafted nothing) never touches ``draft_probs``.
"""

from __future__ import annotations

from specdec.kernels._triton import jit, tl
from specdec.kernels.sample_probs import pick_in_tile_tl, pick_tile_tl
from specdec.kernels.target_stats import target_cols_tl, target_tile_tl
from specdec.kernels.uniforms import counter_uniform_tl

RESIDUAL_EPS = 1e-5  # a residual with less mass is rounding noise: sample from p instead

# The final draw the walk hands over:
FINAL_DONE = tl.constexpr(0)  # greedy or invalid: the walk wrote the last token already
FINAL_TARGET = tl.constexpr(1)  # draw from p
FINAL_RESIDUAL = tl.constexpr(2)  # stochastic rule: draw from max(0, p - C q), its mass summed over the tiles
FINAL_EXCLUDED = tl.constexpr(3)  # deterministic rule: draw from p without the rejected children, mass 1 - X


@jit
def residual_tile_tl(p, q_row_ptr, cols, V, c):
    """max(0, p - C q) on one tile (negative or non-finite q read as 0; p is 0 past V)."""
    q = tl.load(q_row_ptr + tl.minimum(cols, V - 1)).to(tl.float32)  # clamped: no lane leaves the row
    return tl.maximum(p - c * tl.where((q >= 0) & (q < float("inf")), q, 0.0), 0.0)


@jit
def _rejected_children(cols, tokens_ptr, parents_ptr, start, cur, n, first_child, CHAIN: tl.constexpr):
    # Columns holding a child of node cur (deterministic rule, FINAL_EXCLUDED: all were rejected).
    if CHAIN:  # its one child carries tokens[first_child]
        hit = cols == tl.load(tokens_ptr + first_child)
    else:
        hit = cols < 0
        for i in range(cur + 1, n):
            if tl.load(parents_ptr + start + i) == cur:
                hit = hit | (cols == tl.load(tokens_ptr + start + i))
    return hit


@jit
def _final_weights(p, cols, mode, q_row, c, V, tokens_ptr, parents_ptr, start, cur, n, first_child,
                   RULE: tl.constexpr, CHAIN: tl.constexpr):  # fmt: skip
    # The mass w the token is drawn from under `mode`, on the tile whose target probabilities are p.
    w = p
    if RULE == "stochastic":
        if mode == FINAL_RESIDUAL:  # the draft row of the final node's children: after a rejection, it exists
            w = residual_tile_tl(p, q_row, cols, V, c)
    else:
        if mode == FINAL_EXCLUDED:
            w = tl.where(_rejected_children(cols, tokens_ptr, parents_ptr, start, cur, n, first_child, CHAIN), 0.0, p)
    return w


@jit
def final_draw_tl(
    logits_row, q_row, tokens_ptr, parents_ptr, mode, start, cur, n, first_child, c, total, inv_t, thr, m, z,
    seed, off, V, n_tiles, RULE: tl.constexpr, CHAIN: tl.constexpr, BLOCK: tl.constexpr, T_PAD: tl.constexpr,
    EPS: tl.constexpr, TILES: tl.constexpr,
):  # fmt: skip
    """The token drawn at local node ``cur`` of the request whose nodes start at row ``start`` (mode not
    FINAL_DONE): ``logits_row`` / ``q_row`` that node's rows, (inv_t, thr, m, z) its target, ``c`` the
    residual's C, ``total`` the mass of an excluded draw (1 otherwise), ``first_child`` where a chain
    node's one child's token lies."""
    # ---- per-tile mass of the final distribution w and of p, TILES tiles a step (a shorter serial chain)
    t_idx = tl.arange(0, T_PAD)
    w_tiles = tl.zeros([T_PAD], dtype=tl.float32)
    p_tiles = tl.zeros([T_PAD], dtype=tl.float32)
    for first in range(0, n_tiles, TILES):
        tiles = first + tl.arange(0, TILES)
        cols = tiles[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]  # [TILES, BLOCK]; past V: p = 0
        p = target_cols_tl(logits_row, cols, V, inv_t, thr, m, z)
        w = _final_weights(p, cols, mode, q_row, c, V, tokens_ptr, parents_ptr, start, cur, n, first_child, RULE,
                           CHAIN)  # fmt: skip
        at = t_idx[:, None] == tiles[None, :]  # each tile's sum lands in its lane once (added to 0: exact)
        w_tiles += tl.sum(tl.where(at, tl.sum(w, 1)[None, :], 0.0), 1)
        p_tiles += tl.sum(tl.where(at, tl.sum(p, 1)[None, :], 0.0), 1)
    # ---- the draw
    total = tl.where(mode == FINAL_RESIDUAL, tl.sum(w_tiles, 0), total)
    use_p = total <= EPS  # a residual of rounding noise (p == q): draw from p
    w_tiles = tl.where(use_p, p_tiles, w_tiles)
    total = tl.where(use_p, 1.0, total)
    mode = tl.where(use_p, FINAL_TARGET, mode)
    target = counter_uniform_tl(seed, off, 2 * cur + 1) * total
    tile, before = pick_tile_tl(w_tiles, t_idx, target)
    cols, p = target_tile_tl(logits_row, tile * BLOCK, V, inv_t, thr, m, z, BLOCK)
    w = _final_weights(p, cols, mode, q_row, c, V, tokens_ptr, parents_ptr, start, cur, n, first_child, RULE, CHAIN)
    return pick_in_tile_tl(w, cols, before, target)
