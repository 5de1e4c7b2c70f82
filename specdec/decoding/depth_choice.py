"""The adaptive controller's choice: the draft depths with the most expected tokens per second of step time.

Every function here is pure: it reads a ``StepCostModel`` (the prices) and ``prices = (expected, rows)``, where
``expected[r][d]`` is the tokens running request r is expected to emit when drafting d levels
(``AcceptanceModel.expected_tokens``) and ``rows[d]`` the nodes, root included, of a d-level tree.

``best_depths``: for each draft-level count L, the requests' depths are filled greedily by expected tokens per
second of extra cost (the chance that a request's first i drafts are all accepted, over the cost of the rows its
i-th level adds) while that raises the batch's tokens per second; that fill and the uniform depth L are priced as
whole shapes (``StepCostModel.price``: a measured shape at its own mean), and the best of every L wins. 0 is
plain decoding. This runs every step over every request and level: where the extension is built,
``specdec._C.best_depths`` makes the choice, the fills and the prices included, in the same arithmetic and order as
the Python here (so the same bits). ``exploration_variants``: the neighbours of a choice an exploration step may try
instead.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from specdec._backend import extension_function
from specdec.decoding.step_cost import StepCostModel

Prices = tuple[list[list[float]], list[int]]  # (expected tokens per request and depth, nodes per depth)


def expected_rate(cost: StepCostModel, prices: Prices, depths: Sequence[int], contexts: Sequence[int],
                  entry: float = 0.0) -> float:  # fmt: skip
    """Expected tokens per predicted second of a step drafting ``depths``, its time priced from the features the
    controller records for it, plus ``entry`` seconds when it drafts (its share of a catch-up the drafter owes)."""
    expected, rows = prices
    return _rate(cost, len(depths), max(depths, default=0), _sums(expected, rows, depths, contexts), entry)


def best_depths(cost: StepCostModel, prices: Prices, caps: Sequence[int], contexts: Sequence[int],
                entry: float) -> list[int]:  # fmt: skip
    """The depths (each within its request's cap) maximising expected tokens / predicted seconds (see the module
    docstring); ``entry``: seconds added to every shape that drafts."""
    expected, rows = prices
    native = extension_function("best_depths")
    if native is not None:
        return native(cost.shape_mean, cost.residual, cost.theta, cost.row_price, cost.context_price, expected, rows,
                      caps, contexts, entry)  # fmt: skip
    top = max(caps, default=0)
    requests, context = len(caps), sum(contexts)
    tokens0, seconds0 = float(requests), cost.price(requests, 0, 0, context)
    best_rate, best = tokens0 / max(seconds0, 1e-12), [0] * requests
    if requests == 1:  # the fill below is the uniform depth: the best of every depth, priced as a whole shape
        row, ctx = expected[0], contexts[0]
        for levels in range(1, top + 1):
            rate = _rate(cost, 1, levels, (row[levels], rows[levels], rows[levels] * ctx), entry)
            if rate > best_rate:
                best_rate, best = rate, [levels]
        return best
    starts = [max(cost.price(requests, 0, levels, context) + entry, 1e-12) for levels in range(1, top + 1)]
    shapes = fill_shapes(expected, rows, caps, contexts, cost.row_price, cost.context_price / 1024, starts, tokens0)
    for levels, (depth, fill, uniform_sums) in enumerate(shapes, 1):
        uniform = [levels if cap >= levels else cap for cap in caps]  # the shape fixed sizes use: often measured
        if max(depth) == levels:  # the whole shape, priced as measured where it was
            rate = _rate(cost, requests, levels, fill, entry)
            if rate > best_rate:
                best_rate, best = rate, depth
        if depth != uniform:
            rate = _rate(cost, requests, levels, uniform_sums, entry)
            if rate > best_rate:
                best_rate, best = rate, uniform
    return best


def fill_shapes(expected: list[list[float]], rows: Sequence[int], caps: Sequence[int], contexts: Sequence[int],
                row_price: float, context_row_price: float, starts: Sequence[float],
                tokens0: float) -> list[tuple]:  # fmt: skip
    """``best_depths``'s fills: per level count L = 1 .. max(caps), ``(depths, fill, uniform)``: each request's
    depth in the greedy fill of L levels, and the sums ``(tokens, nodes, context rows)`` of that shape and of the
    uniform one (every request drafting L levels or its cap), added in request order as ``expected_rate`` adds
    them. A level's cost is its rows x (``row_price`` + ``context_row_price`` x its request's context); a fill of L
    levels starts from ``tokens0`` tokens (plain decoding's) and ``starts[L - 1]`` seconds (the L-level step's
    price). The extension's ``best_depths`` fills the same, bit for bit (``tests/test_controller_ops.py``)."""
    top = max(caps, default=0)
    row_steps = [rows[i] - rows[i - 1] for i in range(1, top + 1)]
    # Items (ratio, -depth, request index, gain, cost): the i-th draft level of a request. (This runs every
    # step over every request and level: plain loops, no calls.)
    items = []
    for r, (tokens_by_depth, ctx) in enumerate(zip(expected, contexts)):
        ratio_cap, row_cost = math.inf, row_price + context_row_price * ctx
        previous = 1.0
        for i in range(1, len(tokens_by_depth)):
            reach = tokens_by_depth[i] - previous  # the chance its first i drafts are accepted
            previous = tokens_by_depth[i]
            level_cost = row_steps[i - 1] * row_cost
            if level_cost < 1e-12:
                level_cost = 1e-12
            ratio = reach / level_cost
            if ratio < ratio_cap:  # a deeper level never goes before a shallower one
                ratio_cap = ratio
            items.append((ratio_cap, -i, r, reach, level_cost))
    items.sort(reverse=True)
    ends = [0] * (top + 1)  # ends[L]: one past the last item of depth <= L (a fill of L levels stops there)
    for k, item in enumerate(items):
        ends[-item[1]] = k + 1
    for i in range(2, top + 1):
        ends[i] = max(ends[i], ends[i - 1])
    # A request's levels come in order (their ratios never rise, and a tie goes to the shallower), so the fill
    # reaches a request's i-th level only after taking its first i - 1.
    fills = []
    for levels in range(1, top + 1):
        tokens, seconds = tokens0, starts[levels - 1]
        depth, floor = [0] * len(caps), -levels
        for ratio, neg_i, r, gain, level_cost in items[: ends[levels]]:
            if neg_i < floor:  # a level deeper than this count
                continue
            if ratio * seconds <= tokens:  # adding it would not raise tokens / seconds
                break
            tokens, seconds = tokens + gain, seconds + level_cost
            depth[r] = -neg_i
        fills.append(depth)
    return [(depth, _sums(expected, rows, depth, contexts), uniform)
            for depth, uniform in zip(fills, _uniform_sums(expected, rows, caps, contexts))]  # fmt: skip


def _uniform_sums(expected: list[list[float]], rows: Sequence[int], caps: Sequence[int], contexts: Sequence[int]
                  ) -> list[tuple[float, int, int]]:  # fmt: skip
    """``_sums`` of the uniform shape of every level count L = 1 .. max(caps), in one pass over the requests."""
    top = max(caps, default=0)
    tokens = [0.0] * (top + 1)
    for row, cap in zip(expected, caps):
        if cap < top:  # the request stops at its cap
            row = row + [row[cap]] * (top - cap)
        for levels in range(1, top + 1):
            tokens[levels] += row[levels]
    requests, lowest, context, sums = len(caps), min(caps, default=0), sum(contexts), []
    for levels in range(1, top + 1):
        if levels <= lowest:  # every request drafts L levels
            nodes, context_rows = requests * rows[levels], rows[levels] * context
        else:
            nodes_each = [rows[levels if cap >= levels else cap] for cap in caps]
            nodes, context_rows = sum(nodes_each), sum(n * c for n, c in zip(nodes_each, contexts))
        sums.append((tokens[levels], nodes, context_rows))
    return sums


def _sums(expected: list[list[float]], rows: Sequence[int], depths: Sequence[int], contexts: Sequence[int]
          ) -> tuple[float, int, int]:  # fmt: skip
    """A shape's expected tokens, nodes and context rows (nodes x context), in request order."""
    tokens, nodes, context_rows = 0.0, 0, 0
    for row, d, c in zip(expected, depths, contexts):
        n = rows[d]
        tokens, nodes, context_rows = tokens + row[d], nodes + n, context_rows + n * c
    return tokens, nodes, context_rows


def _rate(cost: StepCostModel, requests: int, levels: int, sums: tuple[float, int, int], entry: float) -> float:
    """``expected_rate`` of a shape of ``levels`` levels (its deepest request's) from its ``_sums``."""
    tokens, nodes, context_rows = sums
    seconds = cost.price(requests, nodes - requests, levels, context_rows)
    if levels > 0:
        seconds += entry
    return tokens / (seconds if seconds > 1e-12 else 1e-12)


def exploration_variants(choice: Sequence[int], caps: Sequence[int]) -> list[list[int]]:
    """The depths an exploration step may try instead of ``choice``: one level fewer / more for all, one fewer /
    more for every other request (the first always among them, so extra rows vary apart from draft levels), and
    every uniform depth (an optimum far from the choice, under a cost curve the linear fit misses, is reached in
    one exploration).

    >>> exploration_variants([2, 1], caps=[3, 1])
    [[1, 0], [3, 1], [1, 1], [3, 1], [0, 0], [1, 1], [2, 1], [3, 1]]
    """
    return [
        [max(d - 1, 0) for d in choice],
        [min(d + 1, cap) if r % 2 == 0 else d for r, (d, cap) in enumerate(zip(choice, caps))],
        [max(d - 1, 0) if r % 2 == 0 else d for r, d in enumerate(choice)],
        [min(d + 1, cap) for d, cap in zip(choice, caps)],
        *([min(depth, cap) for cap in caps] for depth in range(max(caps, default=0) + 1)),
    ]
