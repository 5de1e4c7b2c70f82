"""Adaptive speculation: per step, per request, the draft depth that maximises the batch's tokens per second.

Speculation pays only while the drafted tokens that survive are worth more than the rows they add
to the target's forward and the draft forwards that made them. Both sides move: acceptance with
the text (and the temperature), cost with the batch, the context and the machine. So the
controller measures both as it goes and re-decides every step:

* **Cost** (``StepCostModel``): a step's time is modelled as ``theta . x`` with
  ``x = [1, R, D, D*R, E, L, C]``: a fixed part, R running requests (one row each), D = 1 when
  anything is drafted (drafting at all has its own cost: a drafter catching up, wider GEMMs -- on
  one CPU thread the first level costs several later ones), E extra target rows (the draft nodes),
  L draft levels (drafter forwards) and C = sum over requests of rows x context / 1024
  (attention). ``theta`` is a ridge
  regression on the measured steps (older steps fading), pulled towards a prior scaled from the
  first measured step, so directions the data has not explored stay sensible. Costs are not linear
  in rows (one CPU thread: GEMV against GEMM shapes; a GPU: tiles), so each level count L also
  keeps a running residual (measured minus predicted) added to the predictions at that L, and a
  step shape that was measured -- (requests, levels, mean depth rounded) -- is priced by its own
  running mean (moved by the fitted row and context terms to the extra rows and context at hand),
  not by the fit. Ragged fills a row or two apart share one mean: the choice between depths turns
  on a few percent, each step's time is noisy by about as much, and fills counted apart were each
  priced from one or two steps (``specdec.decoding.replay`` measures what that cost).
  The machine's speed drifts (other processes, clocks, caches; ``bench/bench_adaptive_replay.py --record``
  measures it), and a shape measured in a slow minute would otherwise stay dear
  against one measured in a fast one. So each step of a shape measured before moves a running speed
  factor by part of how far it came from that shape's price, and every time is stored divided by the
  factor at its step: prices compare shapes at one speed (the first step's), whenever they were measured.
  A shape's first step runs cold -- first-use costs such as kernels compiled or weights packed for a new
  shape land in it -- so it prices the shape only until the shape's next step
  replaces it, and no step enters the fit at more than ``FIT_OUTLIER_CAP`` times the fit's prediction, nor a warm
  shape's mean at more than ``SHAPE_STEP_CAP`` off the shape's price (a stalled step would otherwise price the shape
  in use out until an exploration measured it again).
* **Acceptance** (``AcceptanceModel``): per request and draft position i, the chance that node i is
  accepted given that i - 1 were, a running estimate (recent steps count more) seeded with the
  pooled estimate of every request so far, whose own prior is ``prior_acceptance`` at position 1
  and the estimate at position i - 1 beyond.
* **Choice**: for each draft-level count L, requests' depths are filled greedily by expected
  tokens per second of extra cost (``P(first i accepted) / cost of the rows of depth i``) while
  that beats the batch's current tokens per second; that fill and the uniform depth L are priced
  as whole shapes, and the best of every L wins. 0 = plain decoding.
  The first measured steps are the strategy's full size, plain decoding, then half, a quarter, ...
  of it down to one level, twice over (``warm_up_depths``: the first time cold, the second warm): the
  first choices are between measured shapes, and a cost curve bent either way shows at once (at
  larger batches the best depth is often a short one, which a fit through the two ends prices
  worst); after that, on a fixed, deterministic schedule, an exploration step tries the variant of
  the choice (a level up or down for all or every other request, or any uniform depth) predicted
  fastest -- or none, when even that one is predicted well below the choice (but at least every
  eighth time), so exploring drafts nobody accepts stays rare.

A drafter may owe work before it can draft (``DraftModelStrategy``: the prompts, fed at the first step that drafts,
or a long run of plain steps): that catch-up runs in the strategy's ``prepare``, outside the step's time, so no
shape is priced by it -- but it is paid whenever drafting starts again. With the optional hook
``strategy.owed_tokens(running, contexts)`` (tokens a drafting step would first feed the drafter) the controller
times each catch-up (``restart_clock``), keeps a running price per owed token, and adds the owed tokens' price to
every drafting shape: in full to an exploration step (one step pays it), and spread over the steps left in the
stream (the longest request's) to the choice, so drafting restarts only where it gains more than the catch-up
costs (at large batches a deferred draft prefill can cost more than drafting one level gains).

Timing adds no synchronisation: the engine reads the host clock at the start of a step (after the
strategy's optional ``prepare``, work owed from earlier steps such as a deferred draft prefill:
``restart_clock``) and right after the step's one read-back (which waits for the device anyway), so
the time between the two is the step's time on any device. The controller's own Python falls outside
it: it is kept cheap, not priced. The clock is injectable (tests drive it); by default it is
``time.perf_counter``.

Strategies need nothing but the contract (per-request ``max_depth`` / ``max_nodes`` in each
``StepContext``). Two optional hooks sharpen the prices: ``strategy.draft_nodes(depth)``, the nodes (root
included) of the tree the strategy proposes when allowed ``depth`` levels (without it the controller learns each
depth's size from the proposals it sees, a chain's ``depth + 1`` until then), and ``strategy.owed_tokens`` above.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

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
EXPLORE_MARGIN = 0.8  # explore a variant predicted at no less than this share of the choice's tokens per second
# Explorations the margin skips in a row before one goes ahead anyway: acceptance moves with the text, and
# only drafting measures it.
SKIPS_BEFORE_EXPLORING = 7
# The share of a measured shape's log error that moves the machine's speed factor (times w / (w + 1) for a shape
# of measured weight w: an error against a shape seen once is half its own noise), and the largest error counted:
# a step stalled by something else (a page fault, a preempted thread) must not reprice every shape.
SPEED_GAIN = 0.5
SPEED_ERROR_CAP = 0.25
FIT_OUTLIER_CAP = 3.0  # a step slower than this many times the fit's price enters the fit at that price
# A warm shape's running mean takes each step within this share of the shape's price: live step times have a
# heavier tail than Gaussian noise (a few steps stall well over their neighbours), and one stall on the shape in
# use would otherwise price it out until an exploration measures it again.
SHAPE_STEP_CAP = 0.1
OWED_DECAY = 0.7  # weight of the earlier catch-ups in the running price of an owed token


class StepCostModel:
    """Step time = ``theta . features`` by ridge regression with forgetting (pure Python: no device, no sync).

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
        self._row_price = self._context_price = 0.0  # the fit's costs of an extra row and of context, at least 0
        self.residual: dict[int, float] = {}  # per draft-level count: running (measured - predicted)
        # Per shape: running means [seconds, context, extra rows] and the weight of the steps behind them.
        self.shape_mean: dict[tuple[int, int, int], list[float]] = {}
        self.log_speed = 0.0  # the machine's slowness against the first step, by which every time is divided
        self.steps = 0

    @staticmethod
    def features(requests: int, extra_rows: int, levels: int, context_rows: float) -> list[float]:
        drafting = float(levels > 0)
        rows = float(extra_rows)
        return [1.0, float(requests), drafting, drafting * requests, rows, float(levels), context_rows / 1024]

    def observe(self, x: Sequence[float], seconds: float) -> None:
        levels, shape = self._keys(x)
        mean = self.shape_mean.get(shape)
        price = None if mean is None else self._own_price(mean, x[ROWS], x[CONTEXT])
        seconds = self._at_first_speed(seconds, mean, price)
        own = seconds
        if mean is not None and mean[3] > 0:  # a warm shape's mean takes a stalled step at no more than its cap
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
            fitted = sum(t * v for t, v in zip(self.theta, x))
            seconds = min(seconds, FIT_OUTLIER_CAP * fitted) if fitted > 0 else seconds
            if mean is not None:  # the out-of-sample error of the linear part, at this level count (a warm step)
                error = seconds - fitted
                previous = self.residual.get(levels, error)
                self.residual[levels] = RESIDUAL_DECAY * previous + (1 - RESIDUAL_DECAY) * error
        decay = self.decay
        self.moment = [decay * m + v * seconds for m, v in zip(self.moment, x)]
        self.gram = [[decay * g + v * w for g, w in zip(row, x)] for row, v in zip(self.gram, x)]
        self.steps += 1
        self.theta = self._solve()
        self._row_price, self._context_price = max(self.theta[ROWS], 0.0), max(self.theta[CONTEXT], 0.0)

    def _at_first_speed(self, seconds: float, mean: list[float] | None, price: float | None) -> float:
        """``seconds`` divided by the machine's speed factor, after moving the factor by this step's error when its
        shape was measured before (``mean``: the shape's running mean, ``price`` its price for this step; None for
        an unmeasured shape, whose error is the fit's, not the machine's)."""
        if mean is not None:
            error = math.log(max(seconds, 1e-12) / max(price, 1e-12)) - self.log_speed
            error = max(-SPEED_ERROR_CAP, min(SPEED_ERROR_CAP, error))
            self.log_speed += SPEED_GAIN * mean[3] / (mean[3] + 1) * error
        return seconds * math.exp(-self.log_speed)

    def predict(self, x: Sequence[float]) -> float:
        """``price`` of the step with features ``x``."""
        return self.price(round(x[SHAPE[0]]), x[ROWS], round(x[SHAPE[1]]), x[CONTEXT] * 1024)

    def price(self, requests: int, extra_rows: float, levels: int, context_rows: float) -> float:
        """Seconds at the first step's machine speed (so shapes compare alike whenever they were measured) of a step
        with ``features(requests, extra_rows, levels, context_rows)``: a measured shape (requests, levels, mean
        depth) at its own running mean; any other at the linear part plus its level count's running residual.
        Shapes' costs jump with tiles and GEMM kernels that no linear term follows, and a residual against a
        moving fit goes stale; a shape's own mean does not. (The controller prices a few shapes per level count
        every step: this is ``theta . features`` without building the features.)"""
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
        return mean[0] + self._row_price * (extra_rows - mean[2]) + self._context_price * (context - mean[1])

    @staticmethod
    def _keys(x: Sequence[float]) -> tuple[int, tuple[int, int, int]]:
        """A step's level count, and its shape: (requests, levels, mean depth rounded)."""
        requests, levels = round(x[SHAPE[0]]), round(x[SHAPE[1]])
        return levels, StepCostModel._shape(requests, levels, x[ROWS])

    @staticmethod
    def _shape(requests: int, levels: int, extra_rows: float) -> tuple[int, int, int]:
        """The key a step's time is kept under: (requests, levels, mean depth rounded)."""
        return requests, levels, round(extra_rows / max(requests, 1))

    def _solve(self) -> list[float]:
        """(gram + diag(precision)) theta = moment + precision * prior_mean, by Cholesky: the matrix is a sum of
        outer products plus a positive diagonal (every prior weight is positive), so it is positive definite."""
        n, gram, precision = len(self.moment), self.gram, self.prior_precision
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
        for i, (m, p, mean) in enumerate(zip(self.moment, precision, self.prior_mean)):
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


class AcceptanceModel:
    """Per-request acceptance by draft position: running estimates seeded with a pooled one.

    ``rate(b, i)`` (i from 1) is the chance that request b's draft node at depth i is accepted given
    that its ancestors were. Request estimates fade by ``request_decay`` per step (recent text counts
    more, and a request that stopped drafting drifts back to the pooled estimate, which is how it
    gets tried again); the pooled one by ``pooled_decay`` per observation.
    """

    def __init__(
        self, prior_acceptance: float = 0.6, *, request_decay: float = 0.9, pooled_decay: float = 0.995,
        request_weight: float = 3.0, pooled_weight: float = 4.0,
    ):  # fmt: skip
        self.prior = prior_acceptance
        self.request_decay, self.pooled_decay = request_decay, pooled_decay
        self.request_weight, self.pooled_weight = request_weight, pooled_weight
        self.pooled: list[list[float]] = []  # per position: [accepted, tested] (decayed counts)
        self.requests: dict[int, list[list[float]]] = {}

    def start(self) -> None:
        """A new stream: forget the requests (batch slots are reused), keep the pooled estimate."""
        self.requests = {}

    def pooled_rates(self, depth: int) -> list[float]:
        rates, previous = [], self.prior
        for i in range(depth):
            accepted, tested = self.pooled[i] if i < len(self.pooled) else (0.0, 0.0)
            previous = (accepted + self.pooled_weight * previous) / (tested + self.pooled_weight)
            rates.append(previous)
        return rates

    def rates(self, request: int, pooled: list[float]) -> list[float]:
        """Request ``request``'s conditional acceptance at depths 1 .. len(pooled)."""
        own = self.requests.get(request, [])
        out = []
        for i, prior in enumerate(pooled):
            accepted, tested = own[i] if i < len(own) else (0.0, 0.0)
            out.append((accepted + self.request_weight * prior) / (tested + self.request_weight))
        return out

    def observe(self, request: int, depth: int, accepted: int) -> None:
        """Request ``request`` proposed a tree of ``depth`` levels and ``accepted`` of its nodes were accepted."""
        own = self.requests.setdefault(request, [])
        for counts in own:
            counts[0] *= self.request_decay
            counts[1] *= self.request_decay
        for i in range(min(depth, accepted + 1)):  # positions 1 .. accepted + 1 were tested
            hit = float(accepted > i)
            for table, decay in ((own, 1.0), (self.pooled, self.pooled_decay)):
                while len(table) <= i:
                    table.append([0.0, 0.0])
                table[i][0] = decay * table[i][0] + hit
                table[i][1] = decay * table[i][1] + 1.0


def warm_up_depths(max_depth: int) -> list[int]:
    """The uniform depths of the controller's first steps: the full size, plain decoding, then the full size
    halved (rounding up) down to one level; twice, so each is measured once warm.

    >>> warm_up_depths(8), warm_up_depths(1)
    ([8, 0, 4, 2, 1, 8, 0, 4, 2, 1], [1, 0, 1, 0])
    """
    ladder = [max_depth, 0]
    depth = max_depth
    while depth > 1:
        depth = (depth + 1) // 2
        ladder.append(depth)
    return ladder * 2


class AdaptiveSpeculation:
    """Chooses each running request's draft depth per step (0 = plain decoding) from measured costs.

    Pass an instance as ``SpeculativeDecoder(..., adaptive=AdaptiveSpeculation(...))`` to set its
    options (``adaptive=True``, the default, uses the defaults below; one controller serves one
    decoder, and what it learnt carries over from one ``stream`` call to the next).

    Parameters
    ----------
    clock : seconds now (host time, read twice a step; never a device value). Default ``time.perf_counter``.
    prior_acceptance : the acceptance assumed at depth 1 before anything was measured.
    explore_every : every this many steps (doubling up to 8x while the choice does not change), one step may
        try the variant of the choice predicted fastest, so sizes not in use stay measured.

    Example
    -------
    >>> ticks = iter(range(0, 10**6, 5))                        # a clock whose steps take 5 "seconds"
    >>> ctl = AdaptiveSpeculation(clock=lambda: next(ticks) / 1000)
    >>> ctl.bind(max_depth=4, max_nodes=5)
    >>> ctl.start()
    >>> ctl.choose([0, 1], limits=[10, 10], contexts=[20, 30])  # nothing measured yet: the strategy's own
    [4, 4]
    """

    def __init__(
        self, *, clock: Callable[[], float] | None = None, prior_acceptance: float = 0.6, explore_every: int = 8
    ):
        if clock is not None and not callable(clock):
            raise TypeError(f"clock must be a callable returning seconds, got {type(clock).__name__}")
        if not isinstance(prior_acceptance, (int, float)) or not 0.0 <= prior_acceptance <= 1.0:
            raise ValueError(f"prior_acceptance must be a number in [0, 1], got {prior_acceptance!r}")
        if not isinstance(explore_every, int) or explore_every < 2:
            raise ValueError(f"explore_every must be an int >= 2, got {explore_every!r}")
        self.clock = clock or time.perf_counter
        self.cost = StepCostModel()
        self.acceptance = AcceptanceModel(prior_acceptance)
        self.explore_every = explore_every
        self.max_depth, self.max_nodes = 0, 1
        self._warm_up = warm_up_depths(0)
        self._draft_nodes: Callable[[int], int] | None = None
        self._owed_tokens: Callable[[Sequence[int], Sequence[int]], int] | None = None
        # Seconds (at the first step's speed) per owed token, and the weight of the catch-ups behind it; None until
        # one was timed. ``_owed``: tokens this step's drafting owes (0 when it does not draft).
        self._owed_price: float | None = None
        self._owed_weight, self._owed = 0.0, 0
        self._nodes_seen: dict[int, int] = {}
        self._rows: list[int] = []  # nodes(d) for d = 0 .. max_depth, remade when what it rests on changes
        self._interval, self._until_explore, self._skipped = explore_every, explore_every, 0
        self._last_choice = -1  # the deepest level chosen at the last exploration
        self._started: float | None = None

    def bind(self, max_depth: int, max_nodes: int, draft_nodes: Callable[[int], int] | None = None,
             owed_tokens: Callable[[Sequence[int], Sequence[int]], int] | None = None) -> None:  # fmt: skip
        """Serve a strategy of these limits (``draft_nodes``, ``owed_tokens``: its optional hooks, see the module
        docstring)."""
        self.max_depth, self.max_nodes, self._draft_nodes = max_depth, max_nodes, draft_nodes
        self._owed_tokens = owed_tokens
        self._warm_up = warm_up_depths(max_depth)
        self._rows = []

    def start(self) -> None:
        """A new ``stream`` call (its batch slots are new requests)."""
        self.acceptance.start()
        self._started = None

    # ---- per step ---------------------------------------------------------------------------------

    def choose(self, running: Sequence[int], limits: Sequence[int], contexts: Sequence[int]) -> list[int]:
        """Draft depth per running request (in ``running`` order), each within ``limits`` (tokens it may still
        draft) and the strategy's ``max_depth``; ``contexts``: tokens each request has cached. Starts the
        step's clock."""
        caps = [max(0, min(limit, self.max_depth)) for limit in limits]
        owed = self._owed_tokens(running, contexts) if self._owed_tokens is not None else 0
        if self.cost.steps < len(self._warm_up):  # the warm-up: each rung's depth, within each request's cap
            choice = [min(self._warm_up[self.cost.steps], cap) for cap in caps]
        else:
            prices = self._prices(running, caps)
            entry = owed * self._owed_price if owed and self._owed_price is not None else 0.0
            choice = self._best(prices, caps, contexts, entry / (max(0, max(limits, default=0)) + 1))
            self._until_explore -= 1
            if self._until_explore <= 0:
                choice = self._explore(prices, choice, caps, contexts, entry)
        self._owed = owed if max(choice, default=0) > 0 else 0
        self._started = self.clock()
        return choice

    def restart_clock(self) -> None:
        """The step starts now: what ran since ``choose`` (a strategy's ``prepare``: work owed from earlier steps,
        such as a deferred prefill) is not its cost. On a GPU that work's kernels may still be running: they land
        in the step's time anyway, as a cold step's would. When the step owed the drafter tokens, that time is the
        catch-up's, and prices the next ones."""
        now = self.clock()
        if self._owed > 0:
            price = (now - self._started) * math.exp(-self.cost.log_speed) / self._owed
            self._owed_weight = OWED_DECAY * self._owed_weight + 1.0
            previous = price if self._owed_price is None else self._owed_price
            self._owed_price = previous + (price - previous) / self._owed_weight
            self._owed = 0
        self._started = now

    def observe(self, running: Sequence[int], nodes: Sequence[int], depths: Sequence[int],
                accepted: Sequence[int | None], contexts: Sequence[int]) -> None:  # fmt: skip
        """After the step's read-back: the trees' sizes (``nodes``, ``depths``), what was accepted (None for a
        request whose logits were invalid) and the context each tree was verified after."""
        seconds = self.clock() - self._started
        learn_nodes = self._draft_nodes is None  # the hook says a tree's size; else the proposals seen do
        for b, n, d, a in zip(running, nodes, depths, accepted):
            if learn_nodes and n > self._nodes_seen.get(d, 0):
                self._nodes_seen[d], self._rows = n, []
            if a is not None and d > 0:
                self.acceptance.observe(b, d, a)
        context_rows = sum(n * c for n, c in zip(nodes, contexts))
        x = StepCostModel.features(len(running), sum(nodes) - len(running), max(depths, default=0), context_rows)
        self.cost.observe(x, seconds)

    # ---- the choice -------------------------------------------------------------------------------

    def nodes(self, depth: int) -> int:
        """Nodes (root included) of the tree proposed at ``depth`` levels: the hook, else the largest seen, else
        a chain's."""
        if depth <= 0:
            return 1
        if self._draft_nodes is not None:
            return self._draft_nodes(depth)
        return min(self.max_nodes, self._nodes_seen.get(depth, depth + 1))

    def _prices(self, running, caps) -> tuple[list[list[float]], list[int]]:
        """What pricing this step's shapes needs, computed once per step: per running request the tokens it is
        expected to emit when drafting d levels (d = 0 .. its cap: 1 plus the chances that its first 1, 2, ..
        drafts are all accepted), and the nodes of a d-level tree (d = 0 .. the largest cap)."""
        top = max(caps, default=0)
        pooled = self.acceptance.pooled_rates(top)
        expected = []
        for b, cap in zip(running, caps):
            reach, row = 1.0, [1.0]
            for rate in self.acceptance.rates(b, pooled[:cap]):
                reach *= rate
                row.append(row[-1] + reach)
            expected.append(row)
        if len(self._rows) <= top:
            self._rows = [self.nodes(d) for d in range(self.max_depth + 1)]
        return expected, self._rows

    def _best(self, prices, caps, contexts, entry: float) -> list[int]:
        """The depths maximising expected tokens / predicted seconds (see the module docstring); ``entry``: seconds
        added to every shape that drafts (its share of an owed catch-up)."""
        expected, rows = prices
        top = max(caps, default=0)
        requests, context = len(caps), sum(contexts)
        tokens0, seconds0 = float(requests), self.cost.price(requests, 0, 0, context)
        best_rate, best = tokens0 / max(seconds0, 1e-12), [0] * requests
        if requests == 1:  # the fill below is the uniform depth: the best of every depth, priced as a whole shape
            for levels in range(1, top + 1):
                rate = self._rate(prices, [levels], contexts, entry)
                if rate > best_rate:
                    best_rate, best = rate, [levels]
            return best
        per_row, per_context_row = self.cost._row_price, self.cost._context_price / 1024
        row_steps = [rows[i] - rows[i - 1] for i in range(1, top + 1)]
        # Items (ratio, -depth, request index, gain, cost): the i-th draft level of a request. (This runs every
        # step over every request and level: plain loops, no calls.)
        items = []
        for r, (tokens_by_depth, ctx) in enumerate(zip(expected, contexts)):
            ratio_cap, row_cost = math.inf, per_row + per_context_row * ctx
            previous = 1.0
            for i in range(1, len(tokens_by_depth)):
                reach = tokens_by_depth[i] - previous  # the chance its first i drafts are accepted
                previous = tokens_by_depth[i]
                cost = row_steps[i - 1] * row_cost
                if cost < 1e-12:
                    cost = 1e-12
                ratio = reach / cost
                if ratio < ratio_cap:  # a deeper level never goes before a shallower one
                    ratio_cap = ratio
                items.append((ratio_cap, -i, r, reach, cost))
        items.sort(reverse=True)
        for levels in range(1, top + 1):
            tokens, seconds = tokens0, max(self.cost.price(requests, 0, levels, context) + entry, 1e-12)
            depth, deepest = [0] * requests, 0
            for ratio, neg_i, r, gain, cost in items:
                i = -neg_i
                if i > levels or i != depth[r] + 1:
                    continue
                if ratio * seconds <= tokens:  # adding it would not raise tokens / seconds
                    break
                tokens, seconds = tokens + gain, seconds + cost
                depth[r] = i
                if i > deepest:
                    deepest = i
            uniform = [levels if cap >= levels else cap for cap in caps]  # the shape fixed sizes use: often measured
            if deepest == levels:  # the whole shape, priced as measured where it was
                rate = self._rate(prices, depth, contexts, entry)
                if rate > best_rate:
                    best_rate, best = rate, depth
            if depth != uniform and max(uniform) == levels:
                rate = self._rate(prices, uniform, contexts, entry)
                if rate > best_rate:
                    best_rate, best = rate, uniform
        return best


    def _explore(self, prices, choice: list[int], caps: list[int], contexts, entry: float) -> list[int]:
        """The exploration step's depths: of the variants below, the one predicted fastest (the likeliest to beat
        the choice), or the choice itself when even that one is predicted under ``EXPLORE_MARGIN`` of the
        choice's tokens per second (exploring would cost more than it could find: n-gram drafts nobody
        accepts, or a catch-up the drafter owes, ``entry`` seconds, dear against a step). A measured shape is
        priced by its own mean, so one found slow stops being picked and the next likeliest gets its turn.
        Variants: one level fewer / more for all, one fewer / more for every other request (the first always
        among them, so extra rows vary apart from draft levels), and every uniform depth (an optimum far from the
        choice, under a cost curve the linear fit misses, is reached in one exploration). The interval doubles
        while the choice holds and restarts when it moved."""
        changed = max(choice, default=0) != self._last_choice
        self._last_choice = max(choice, default=0)
        self._interval = self.explore_every if changed else min(2 * self._interval, 8 * self.explore_every)
        self._until_explore = self._interval
        variants = [
            [max(d - 1, 0) for d in choice],
            [min(d + 1, cap) if r % 2 == 0 else d for r, (d, cap) in enumerate(zip(choice, caps))],
            [max(d - 1, 0) if r % 2 == 0 else d for r, d in enumerate(choice)],
            [min(d + 1, cap) for d, cap in zip(choice, caps)],
            *([min(depth, cap) for cap in caps] for depth in range(max(caps, default=0) + 1)),
        ]
        rated = [(self._rate(prices, v, contexts, entry), -k) for k, v in enumerate(variants) if v != choice]
        if not rated:
            return choice
        rate, k = max(rated)
        skip = rate < EXPLORE_MARGIN * self._rate(prices, choice, contexts, entry)
        if skip and self._skipped < SKIPS_BEFORE_EXPLORING:
            self._skipped += 1
            return choice
        self._skipped = 0
        return variants[-k]

    def _rate(self, prices, depths: Sequence[int], contexts, entry: float = 0.0) -> float:
        """Expected tokens per predicted second of a step drafting ``depths`` (``prices``: ``_prices``), its time
        priced from the features ``observe`` records for it, plus ``entry`` seconds when it drafts."""
        expected, rows = prices
        tokens, nodes, context_rows, deepest = 0, 0, 0, 0
        for row, d, c in zip(expected, depths, contexts):
            n = rows[d]
            tokens, nodes, context_rows = tokens + row[d], nodes + n, context_rows + n * c
            if d > deepest:
                deepest = d
        seconds = self.cost.price(len(depths), nodes - len(depths), deepest, context_rows)
        if deepest > 0:
            seconds += entry
        return tokens / (seconds if seconds > 1e-12 else 1e-12)
