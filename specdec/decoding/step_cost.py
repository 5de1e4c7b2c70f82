"""The adaptive controller's cost model: a step's seconds from its shape, learnt online (on the host, no sync).

A step's features are ``x = [1, R, D, D*R, E, L, C]``: a fixed part, R running requests (one row each), D = 1
when anything is drafted (drafting at all has its own cost: a drafter catching up, wider GEMMs), E extra target
rows (the draft nodes), L draft levels (drafter forwards) and C = sum over requests of rows x context / 1024
(attention). ``StepCostModel`` fits ``seconds = theta . x`` by ridge regression with forgetting, pulled towards
a prior scaled from the first measured step, so directions the data has not explored stay sensible.

Costs are not linear in rows (GEMV against GEMM shapes, tiles), so the linear part is only the fallback:

* a step *shape* -- (requests, levels, mean depth rounded) -- that was measured is priced by its own running
  mean, moved by the fitted row and context terms to the rows and context at hand; fills a row or two apart
  share one mean (each step's time is noisy by about as much as the depths' costs differ);
* an unmeasured shape gets the linear part plus its level count's running residual;
* a shape's first step runs cold (first-use costs land in it): it prices the shape only until the next step
  replaces it; no step enters the fit above ``FIT_OUTLIER_CAP`` times the fit's price, nor a warm shape's mean
  more than ``SHAPE_STEP_CAP`` off its price (one stalled step would otherwise price the shape in use out).

``docs/adaptive.md`` gives the design; ``specdec.decoding.adaptive`` is the controller that uses it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from specdec._backend import extension_function

FEATURES = ("step", "requests", "drafting", "drafting requests", "extra rows", "draft levels", "context")
PRIOR_SHARES = (0.2, 0.2, 0.1, 0.1, 0.25, 0.15, 0.0)  # how the first measured step's time is split a priori
# Steps' worth of the prior per parameter. Context grows with every extra row and every step, so the data
# hardly tells it from the row and step terms; its prior (no context cost) yields only to strong evidence.
PRIOR_WEIGHTS = (0.5, 0.5, 0.5, 0.5, 0.5, 0.5, 20.0)
RESIDUAL_DECAY = 0.7  # weight of a level count's earlier residuals when it is measured again
SHAPE_DECAY = 0.7  # weight of a shape's earlier times when it is measured again
CONTEXT = FEATURES.index("context")
ROWS = FEATURES.index("extra rows")
SHAPE = tuple(FEATURES.index(f) for f in ("requests", "draft levels"))  # a step's shape's features
FIT_OUTLIER_CAP = 3.0  # a step slower than this many times the fit's price enters the fit at that price
# A warm shape's running mean takes each step within this share of the shape's price: live step times have a
# heavier tail than Gaussian noise (a few steps stall well over their neighbours), and one stall on the shape in
# use would otherwise price it out until an exploration measures it again.
SHAPE_STEP_CAP = 0.1


class StepCostModel:
    """Step time = ``theta . features`` by ridge regression with forgetting (on the host: no device, no sync).

    ``decay`` multiplies the weight of every earlier step each time a step is observed; ``PRIOR_WEIGHTS``
    say how many steps' worth the prior counts in each parameter's own direction.
    """

    def __init__(self, decay: float = 0.97):
        self.decay = decay
        n = len(FEATURES)
        self.gram = [[0.0] * n for _ in range(n)]  # sum of decayed x x^T
        self.moment = [0.0] * n  # sum of decayed x y
        self.prior_mean: list[float] | None = None
        self.prior_precision: list[float] = [0.0] * n
        self.theta: list[float] | None = None  # None until a step was measured
        self.row_price = self.context_price = 0.0  # the fit's costs of an extra row and of context, at least 0
        self.residual: dict[int, float] = {}  # per draft-level count: running (measured - predicted)
        # Per shape: running means [seconds, context, extra rows] and the weight of the steps behind them.
        self.shape_mean: dict[tuple[int, int, int], list[float]] = {}
        self.steps = 0

    @staticmethod
    def features(requests: int, extra_rows: int, levels: int, context_rows: float) -> list[float]:
        drafting = float(levels > 0)
        rows = float(extra_rows)
        return [1.0, float(requests), drafting, drafting * requests, rows, float(levels), context_rows / 1024]

    def observe(self, x: Sequence[float], seconds: float) -> None:
        """Learn that a step of features ``x`` took ``seconds``. Every step: where the extension is built,
        ``specdec._C.observe_cost`` does all of this in the same arithmetic and order (the same bits), reading the
        module's constants as they are now."""
        native = extension_function("observe_cost")
        if native is not None:
            native(self, x, seconds, SHAPE_STEP_CAP, FIT_OUTLIER_CAP, SHAPE_DECAY, PRIOR_SHARES, PRIOR_WEIGHTS,
                   RESIDUAL_DECAY)  # fmt: skip
            return
        levels, shape = self._keys(x)
        mean = self.shape_mean.get(shape)
        own = seconds
        if mean is not None and mean[3] > 0:  # a warm shape's mean takes a stalled step at no more than its cap
            price = self._own_price(mean, x[ROWS], x[CONTEXT])
            own = min(max(seconds, (1 - SHAPE_STEP_CAP) * price), (1 + SHAPE_STEP_CAP) * price)
        if self.prior_mean is None:  # the first step sets the scale of the prior
            scale = [max(v, 1.0) for v in x]
            self.prior_mean = [share * seconds / s for share, s in zip(PRIOR_SHARES, scale)]
            self.prior_precision = [w * s * s for w, s in zip(PRIOR_WEIGHTS, scale)]
        if mean is None:  # the shape's first step, cold: its price until the next step replaces it (weight 0)
            self.shape_mean[shape] = [seconds, x[CONTEXT], x[ROWS], 0.0]
        else:
            mean[3] = SHAPE_DECAY * mean[3] + 1.0  # weights fade, then normalise: no step counts more than a later one
            for i, v in enumerate((own, x[CONTEXT], x[ROWS])):
                mean[i] += (v - mean[i]) / mean[3]
        if self.theta is not None:
            fitted = 0.0
            for t, v in zip(self.theta, x):  # (a loop: sum() adds floats with compensation from Python 3.12)
                fitted += t * v
            seconds = min(seconds, FIT_OUTLIER_CAP * fitted) if fitted > 0 else seconds
            if mean is not None:  # the out-of-sample error of the linear part, at this level count (a warm step)
                error = seconds - fitted
                previous = self.residual.get(levels, error)
                self.residual[levels] = RESIDUAL_DECAY * previous + (1 - RESIDUAL_DECAY) * error
        decay = self.decay
        self.moment = [decay * m + v * seconds for m, v in zip(self.moment, x)]
        self.gram = [[decay * g + v * w for g, w in zip(row, x)] for row, v in zip(self.gram, x)]
        self.steps += 1
        self.theta = ridge_solve(self.gram, self.prior_precision, self.moment, self.prior_mean)
        self.row_price, self.context_price = max(self.theta[ROWS], 0.0), max(self.theta[CONTEXT], 0.0)

    def predict(self, x: Sequence[float]) -> float:
        """``price`` of the step with features ``x``."""
        return self.price(round(x[SHAPE[0]]), x[ROWS], round(x[SHAPE[1]]), x[CONTEXT] * 1024)

    def price(self, requests: int, extra_rows: float, levels: int, context_rows: float) -> float:
        """Seconds of a step with ``features(requests, extra_rows, levels, context_rows)``: a measured shape
        (requests, levels, mean depth) at its own running mean; any other at the linear part plus its level
        count's running residual. Shapes' costs jump with tiles and GEMM kernels that no linear term follows, and
        a residual against a moving fit goes stale; a shape's own mean does not. (The controller prices a few
        shapes per level count every step: this is ``theta . features`` without building the features.)"""
        mean = self.shape_mean.get(self._shape(requests, levels, extra_rows))
        if mean is not None:
            return self._own_price(mean, extra_rows, context_rows / 1024)
        t = self.theta
        drafting = float(levels > 0)
        linear = t[0] + t[1] * requests + t[2] * drafting + t[3] * (drafting * requests) + t[4] * extra_rows
        return linear + t[5] * levels + t[6] * (context_rows / 1024) + self.residual.get(levels, 0.0)

    def _own_price(self, mean: list[float], extra_rows: float, context: float) -> float:
        """A measured shape's price: its own running mean, moved by the fitted terms to these extra rows and
        context (features' scale)."""
        return mean[0] + self.row_price * (extra_rows - mean[2]) + self.context_price * (context - mean[1])

    @staticmethod
    def _keys(x: Sequence[float]) -> tuple[int, tuple[int, int, int]]:
        """A step's level count, and its shape: (requests, levels, mean depth rounded)."""
        requests, levels = round(x[SHAPE[0]]), round(x[SHAPE[1]])
        return levels, StepCostModel._shape(requests, levels, x[ROWS])

    @staticmethod
    def _shape(requests: int, levels: int, extra_rows: float) -> tuple[int, int, int]:
        """The key a step's time is kept under: (requests, levels, mean depth rounded)."""
        return requests, levels, round(extra_rows / max(requests, 1))


def ridge_solve(gram: Sequence[Sequence[float]], precision: Sequence[float], moment: Sequence[float],
                prior_mean: Sequence[float]) -> list[float]:  # fmt: skip
    """theta from (gram + diag(precision)) theta = moment + precision * prior_mean, by Cholesky (only gram's lower
    triangle is read): the matrix is a sum of outer products plus a positive diagonal (every prior weight is
    positive), so it is positive definite."""
    n = len(moment)
    low = []  # the Cholesky factor's rows
    for i in range(n):
        gram_row, row = gram[i], []
        for j in range(i):
            low_j, s = low[j], gram_row[j]
            for k in range(j):
                s -= row[k] * low_j[k]
            row.append(s / low_j[j])
        s = gram_row[i] + precision[i]
        for v in row:
            s -= v * v
        row.append(math.sqrt(s))
        low.append(row)
    y = []  # low y = moment + precision * prior_mean
    for i, (m, p, mean) in enumerate(zip(moment, precision, prior_mean)):
        s, row = m + p * mean, low[i]
        for k in range(i):
            s -= row[k] * y[k]
        y.append(s / row[i])
    theta = [0.0] * n  # low^T theta = y
    for i in reversed(range(n)):
        s = y[i]
        for k in range(i + 1, n):
            s -= low[k][i] * theta[k]
        theta[i] = s / low[i][i]
    return theta
