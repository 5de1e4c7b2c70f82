"""The adaptive controller's acceptance estimate: per request and draft position, the chance of acceptance.

For each request and draft depth i, the chance that the node at depth i is accepted given that its ancestors
were: a running estimate of the request's own, seeded with the pooled estimate of every request so far, whose
own prior is ``prior_acceptance`` at depth 1 and the pooled estimate at depth i - 1 beyond. ``expected_tokens``
turns the rates into the tokens a step is expected to emit at each depth (``specdec.decoding.adaptive``). Both
run every step over every running request: where the extension is built, ``specdec._C.observe_acceptance`` and
``specdec._C.expected_tokens`` do the Python's arithmetic in its order (the same bits) on the same tables.
"""

from __future__ import annotations

from collections.abc import Sequence

from specdec._backend import extension_function


class AcceptanceModel:
    """Per-request acceptance by draft position: running estimates seeded with a pooled one.

    The chance that request b's draft node at depth i is accepted, given that its ancestors were, is b's own
    running estimate weighed against the pooled one at depth i (``pooled_rates``). Request estimates fade by
    ``request_decay`` per step (recent text counts more, and a request that stopped drafting drifts back to the
    pooled estimate, which is how it gets tried again); the pooled one by ``pooled_decay`` per observation.
    ``*_weight``: how many observations' worth each prior counts.

    >>> model = AcceptanceModel(0.5)
    >>> model.observe(0, depth=2, accepted=2)                  # request 0: both drafts accepted
    >>> [round(t, 3) for t in model.expected_tokens([0], caps=[2])[0]]    # 1, then + 0.7, then + 0.7 * 0.76
    [1.0, 1.7, 2.232]
    >>> model.expected_tokens([0, 1], caps=[1, 0])             # request 1 may not draft
    [[1.0, 1.7], [1.0]]
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
        """A new engine: forget the requests (batch slots are reused), keep the pooled estimate."""
        self.requests = {}

    def forget(self, slots: Sequence[int]) -> None:
        """New requests took ``slots``: their estimates start again from the pooled one."""
        for b in slots:
            self.requests.pop(b, None)

    def pooled_rates(self, depth: int) -> list[float]:
        rates, previous = [], self.prior
        for i in range(depth):
            accepted, tested = self.pooled[i] if i < len(self.pooled) else (0.0, 0.0)
            previous = (accepted + self.pooled_weight * previous) / (tested + self.pooled_weight)
            rates.append(previous)
        return rates

    def observe_step(self, running: Sequence[int], depths: Sequence[int], accepted: Sequence[int | None]) -> None:
        """A step's trees: request ``running[r]`` proposed ``depths[r]`` levels and ``accepted[r]`` of its nodes
        were accepted (None: its logits were invalid, nothing is learnt; so is nothing from a plain step)."""
        native = extension_function("observe_acceptance")
        if native is not None:
            native(self.requests, self.pooled, running, depths, accepted, self.request_decay, self.pooled_decay)
            return
        for b, d, a in zip(running, depths, accepted):
            if a is not None and d > 0:
                self.observe(b, d, a)

    def observe(self, request: int, depth: int, accepted: int) -> None:
        """Request ``request`` proposed a tree of ``depth`` levels and ``accepted`` of its nodes were accepted."""
        own, pooled, decay = self.requests.setdefault(request, []), self.pooled, self.pooled_decay
        for counts in own:
            counts[0] *= self.request_decay
            counts[1] *= self.request_decay
        tested = min(depth, accepted + 1)  # positions 1 .. accepted + 1 were tested
        for table in (own, pooled):
            while len(table) < tested:
                table.append([0.0, 0.0])
        for i in range(tested):
            hit = 1.0 if accepted > i else 0.0
            mine, everyone = own[i], pooled[i]
            mine[0] += hit
            mine[1] += 1.0
            everyone[0] = decay * everyone[0] + hit
            everyone[1] = decay * everyone[1] + 1.0

    def expected_tokens(self, running: Sequence[int], caps: Sequence[int]) -> list[list[float]]:
        """Per running request, the tokens it is expected to emit when drafting d levels, d = 0 .. its cap: 1 plus
        the chances that its first 1, 2, .. drafts are all accepted. (Every step, for every request and level:
        plain loops; the rates of positions no request has counts of are worked out once.)"""
        native = extension_function("expected_tokens")
        if native is not None:
            return native(self.requests, self.pooled, self.prior, self.pooled_weight, self.request_weight, running,
                          caps)  # fmt: skip
        pooled = self.pooled_rates(max(caps, default=0))
        weight = self.request_weight
        weighted = [weight * p for p in pooled]
        unseen = [(0.0 + w) / (0.0 + weight) for w in weighted]  # counts of zero, in the same arithmetic
        expected, requests = [], self.requests
        for b, cap in zip(running, caps):
            own = requests.get(b, ())
            seen = min(cap, len(own))
            reach = total = 1.0
            row = [1.0]
            for i in range(seen):
                accepted, tested = own[i]
                reach *= (accepted + weighted[i]) / (tested + weight)  # the chance of depth i + 1, given i
                total += reach
                row.append(total)
            for i in range(seen, cap):
                reach *= unseen[i]
                total += reach
                row.append(total)
            expected.append(row)
        return expected
