"""Adaptive speculation: per step, per request, the draft depth that maximises the batch's tokens per second.

The controller (``AdaptiveSpeculation``) measures as it goes and re-decides every step: step costs
(``specdec.decoding.step_cost``), each request's acceptance by draft position (``specdec.decoding.acceptance``),
and from both the depths with the most expected tokens per second (``specdec.decoding.depth_choice``).

* **Warm-up**: the first steps draft the strategy's full size, nothing, then half, a quarter, ... down to one
  level, twice over (``warm_up_depths``: once cold, once warm), so the first choices are between measured shapes.
* **Exploration**: on a fixed, deterministic schedule a step tries the variant of the choice predicted fastest
  -- or none, when even that one is predicted well under the choice (but at least every eighth time).
* **Catch-up**: a drafter may owe work before it can draft (the prompts, after plain steps). The strategy's
  ``prepare`` runs it outside the step's time; with the optional hook ``owed_tokens(running, contexts)`` the
  controller times it per owed token and adds its price to drafting shapes: in full to an exploration, spread
  over the stream's steps left to the choice, so drafting restarts only where it gains more than it costs.

Timing adds no synchronisation: the engine's clock reads bracket the step, from after ``prepare``
(``restart_clock``) to right after the step's one read-back (``observe``), which waits for the device anyway.
The controller's own Python falls outside. The clock is injectable (tests drive it). Strategies need only the
contract; the optional hook ``draft_nodes(depth)`` tells a depth's tree size before one was seen. A benchmark
that times given depths passes ``forced`` (and ``on_step`` to see each step's time). Design notes and
measured limits: ``docs/adaptive.md``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from specdec.decoding.acceptance import AcceptanceModel
from specdec.decoding.depth_choice import Prices, best_depths, expected_rate, exploration_variants
from specdec.decoding.step_cost import StepCostModel

__all__ = ["AcceptanceModel", "AdaptiveSpeculation", "StepCostModel", "warm_up_depths"]

EXPLORE_MARGIN = 0.8  # explore a variant predicted at no less than this share of the choice's tokens per second
# Explorations the margin skips in a row before one goes ahead anyway: acceptance moves with the text, and
# only drafting measures it.
SKIPS_BEFORE_EXPLORING = 7
OWED_DECAY = 0.7  # weight of the earlier catch-ups in the running price of an owed token


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
    forced : depths given instead of chosen (for benchmarks that time fixed patterns of depths):
        ``forced(step, running, limits)`` returns one depth per running request for step ``step`` of the
        ``stream`` call (from 0); each is clipped to its request's limit and the strategy's ``max_depth``.
        Nothing is learnt then.
    on_step : called after every step with ``(seconds, running, nodes, depths, accepted, contexts)``: the
        step's time on ``clock`` and ``observe``'s arguments.

    Example
    -------
    >>> ticks = iter(range(0, 10**6, 5))                        # a clock whose steps take 5 "seconds"
    >>> ctl = AdaptiveSpeculation(clock=lambda: next(ticks) / 1000)
    >>> ctl.bind(max_depth=4, max_nodes=5)
    >>> ctl.start()
    >>> ctl.choose([0, 1], limits=[10, 10], contexts=[20, 30])  # nothing measured yet: the strategy's own
    [4, 4]
    >>> fixed = AdaptiveSpeculation(forced=lambda step, running, limits: [step] * len(running))
    >>> fixed.bind(max_depth=4, max_nodes=5)
    >>> fixed.start()
    >>> [fixed.choose([0, 1], limits=[2, 9], contexts=[20, 30]) for _ in range(4)]
    [[0, 0], [1, 1], [2, 2], [2, 3]]
    """

    def __init__(
        self, *, clock: Callable[[], float] | None = None, prior_acceptance: float = 0.6, explore_every: int = 8,
        forced: Callable[[int, Sequence[int], Sequence[int]], Sequence[int]] | None = None,
        on_step: Callable[..., object] | None = None,
    ):  # fmt: skip
        if clock is not None and not callable(clock):
            raise TypeError(f"clock must be a callable returning seconds, got {type(clock).__name__}")
        for name, hook in (("forced", forced), ("on_step", on_step)):
            if hook is not None and not callable(hook):
                raise TypeError(f"{name} must be a callable or None, got {type(hook).__name__}")
        if not isinstance(prior_acceptance, (int, float)) or not 0.0 <= prior_acceptance <= 1.0:
            raise ValueError(f"prior_acceptance must be a number in [0, 1], got {prior_acceptance!r}")
        if not isinstance(explore_every, int) or explore_every < 2:
            raise ValueError(f"explore_every must be an int >= 2, got {explore_every!r}")
        self.clock = clock or time.perf_counter
        self.cost = StepCostModel()
        self.acceptance = AcceptanceModel(prior_acceptance)
        self.explore_every = explore_every
        self.forced, self.on_step = forced, on_step
        self.max_depth, self.max_nodes = 0, 1
        self._warm_up = warm_up_depths(0)
        self._draft_nodes: Callable[[int], int] | None = None
        self._owed_tokens: Callable[[Sequence[int], Sequence[int]], int] | None = None
        # Seconds per owed token, and the weight of the catch-ups behind it; None until one was timed. ``_owed``:
        # tokens this step's drafting owes (0 when it does not draft).
        self._owed_price: float | None = None
        self._owed_weight, self._owed = 0.0, 0
        self._nodes_seen: dict[int, int] = {}
        self._rows: list[int] = []  # nodes(d) for d = 0 .. max_depth, remade when what it rests on changes
        self._interval, self._until_explore, self._skipped = explore_every, explore_every, 0
        self._last_choice = -1  # the deepest level chosen at the last exploration
        self._started: float | None = None
        self._timed = True  # the step's time prices its trees (``untimed``)
        self._step = 0  # steps of the current stream (``forced``'s argument)

    def bind(self, max_depth: int, max_nodes: int, draft_nodes: Callable[[int], int] | None = None,
             owed_tokens: Callable[[Sequence[int], Sequence[int]], int] | None = None) -> None:  # fmt: skip
        """Serve a strategy of these limits (``draft_nodes``, ``owed_tokens``: its optional hooks, see the module
        docstring)."""
        self.max_depth, self.max_nodes, self._draft_nodes = max_depth, max_nodes, draft_nodes
        self._owed_tokens = owed_tokens
        self._warm_up = warm_up_depths(max_depth)
        self._rows = []

    def start(self) -> None:
        """A new engine (a ``stream`` call makes one): its batch slots hold new requests."""
        self.acceptance.start()
        self._started = None
        self._step = 0

    def forget(self, slots: Sequence[int]) -> None:
        """New requests joined ``slots`` of a running engine: what was learnt of the slots' earlier requests goes."""
        self.acceptance.forget(slots)

    # ---- per step ---------------------------------------------------------------------------------

    def choose(self, running: Sequence[int], limits: Sequence[int], contexts: Sequence[int]) -> list[int]:
        """Draft depth per running request (in ``running`` order), each within ``limits`` (tokens it may still
        draft) and the strategy's ``max_depth``; ``contexts``: tokens each request has cached. Starts the
        step's clock."""
        caps = [max(0, min(limit, self.max_depth)) for limit in limits]
        if self.forced is not None:
            depths = list(self.forced(self._step, running, limits))
            if len(depths) != len(running):
                raise ValueError(f"forced must return one depth per running request ({len(running)}), got {depths}")
            self._step += 1
            self._started = self.clock()
            return [max(0, min(d, cap)) for d, cap in zip(depths, caps)]
        owed = self._owed_tokens(running, contexts) if self._owed_tokens is not None else 0
        if self.cost.steps < len(self._warm_up):  # the warm-up: each rung's depth, within each request's cap
            choice = [min(self._warm_up[self.cost.steps], cap) for cap in caps]
        else:
            prices = self._prices(running, caps)
            entry = owed * self._owed_price if owed and self._owed_price is not None else 0.0
            choice = best_depths(self.cost, prices, caps, contexts, entry / (max(0, max(limits, default=0)) + 1))
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
            price = (now - self._started) / self._owed
            self._owed_weight = OWED_DECAY * self._owed_weight + 1.0
            previous = price if self._owed_price is None else self._owed_price
            self._owed_price = previous + (price - previous) / self._owed_weight
            self._owed = 0
        self._started = now

    def untimed(self) -> None:
        """This step did other work beside its trees (joining prompts in its forward): its time prices nothing."""
        self._timed = False

    def observe(self, running: Sequence[int], nodes: Sequence[int], depths: Sequence[int],
                accepted: Sequence[int | None], contexts: Sequence[int]) -> None:  # fmt: skip
        """After the step's read-back: the trees' sizes (``nodes``, ``depths``), what was accepted (None for a
        request whose logits were invalid) and the context each tree was verified after."""
        seconds = self.clock() - self._started
        timed, self._timed = self._timed, True
        if self.on_step is not None:
            self.on_step(seconds, running, nodes, depths, accepted, contexts)
        if self.forced is not None:
            return
        if self._draft_nodes is None:  # the hook says a tree's size; else the proposals seen do
            for n, d in zip(nodes, depths):
                if n > self._nodes_seen.get(d, 0):
                    self._nodes_seen[d], self._rows = n, []
        self.acceptance.observe_step(running, depths, accepted)
        if not timed:
            return
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

    def _prices(self, running, caps) -> Prices:
        """What pricing this step's shapes needs, computed once per step: each running request's expected tokens
        per depth (``AcceptanceModel.expected_tokens``) and the nodes of a d-level tree (d = 0 .. max_depth)."""
        expected = self.acceptance.expected_tokens(running, caps)
        if len(self._rows) <= max(caps, default=0):
            self._rows = [self.nodes(d) for d in range(self.max_depth + 1)]
        return expected, self._rows

    def _explore(self, prices: Prices, choice: list[int], caps: list[int], contexts, entry: float) -> list[int]:
        """The exploration step's depths: of the ``exploration_variants``, the one predicted fastest (the likeliest
        to beat the choice), or the choice itself when even that one is predicted under ``EXPLORE_MARGIN`` of the
        choice's tokens per second (exploring would cost more than it could find: n-gram drafts nobody accepts,
        or a catch-up the drafter owes, ``entry`` seconds, dear against a step). A measured shape is priced by its
        own mean, so one found slow stops being picked and the next likeliest gets its turn. The interval doubles
        while the choice holds and restarts when it moved."""
        changed = max(choice, default=0) != self._last_choice
        self._last_choice = max(choice, default=0)
        self._interval = self.explore_every if changed else min(2 * self._interval, 8 * self.explore_every)
        self._until_explore = self._interval
        variants = exploration_variants(choice, caps)
        rated = [(expected_rate(self.cost, prices, v, contexts, entry), -k)
                 for k, v in enumerate(variants) if v != choice]  # fmt: skip
        if not rated:
            return choice
        rate, k = max(rated)
        skip = rate < EXPLORE_MARGIN * expected_rate(self.cost, prices, choice, contexts, entry)
        if skip and self._skipped < SKIPS_BEFORE_EXPLORING:
            self._skipped += 1
            return choice
        self._skipped = 0
        return variants[-k]
