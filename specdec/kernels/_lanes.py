"""In-bounds addresses for the padding lanes of a row copied in power-of-two tiles.

A kernel that covers a row of ``ROW`` elements with ``SPAN >= ROW`` lanes (a head dim
padded to a power of two, a token row in 1024-wide chunks) masks the lanes past the row,
but their addresses would still run past the row, and past the buffer for its last row.
``row_lanes`` folds those lanes back into the row: lane e >= ROW addresses element
``e + ROW - SPAN``, which lies in ``[0, ROW)`` whenever ``SPAN <= 2 * ROW`` (else it is
clamped to 0). Runs of ``ALIGN`` lanes stay contiguous and start at multiples of ALIGN (a
power of two dividing ROW and SPAN), and the kernel says so to the compiler, so the
loads stay vectorised; a plain ``min(e, ROW - 1)`` would hide that and cost registers.
"""

from __future__ import annotations

from specdec.kernels._triton import jit, tl


@jit
def row_lanes(e, ROW, SPAN, ALIGN: tl.constexpr):
    """Element index each lane ``e`` (``0 <= e < SPAN``) addresses; ALIGN from ``lane_alignment``."""
    if ALIGN == 0:  # no padding lanes
        return e
    lanes = tl.maximum(tl.where(e < ROW, e, e + ROW - SPAN), 0)
    if ALIGN > 1:
        lanes = tl.max_contiguous(tl.multiple_of(lanes, ALIGN), ALIGN)
    return lanes


def lane_alignment(row: int, span: int) -> int:
    """``row_lanes``' ALIGN: 0 when ``span == row``, else the run length it may promise (1: none)."""
    if span == row:
        return 0
    if 2 * row < span:  # folded lanes would go negative and clamp to 0: no runs to promise
        return 1
    return min(16, row & -row, span & -span)
