"""The adaptive controller's host loops in the extension against their Python: the greedy fills
(``specdec._C.fill_shapes``, ``depth_choice.fill_shapes``) and the cost fit's solve (``specdec._C.ridge_solve``,
``step_cost.ridge_solve``), bit for bit on random controller states (ties between requests included); the same
choices from a controller on either; and the extension's refusals of bad arguments."""

import math
import random

import pytest

from specdec import _backend
from specdec.decoding import depth_choice, step_cost
from specdec.decoding.adaptive import AdaptiveSpeculation, StepCostModel

native = _backend.extension_function("fill_shapes")
native_solve = _backend.extension_function("ridge_solve")
needs_native = pytest.mark.skipif(
    native is None or native_solve is None,
    reason=f"specdec._C's controller functions are not built ({_backend.extension_status()[1]})",
)


def random_state(rng: random.Random, requests: int, max_depth: int) -> tuple:
    """``fill_shapes``'s arguments as the controller makes them: expected tokens that grow by the chance of each
    next depth, chains or trees, free or dear rows and context; some requests copies of others (equal ratios)."""
    caps = [rng.choice([0, max_depth, rng.randint(0, max_depth)]) for _ in range(requests)]
    expected, contexts = [], []
    for r in range(requests):
        if r and rng.random() < 0.3:  # a copy of an earlier request: its items tie with that one's
            k = rng.randrange(r)
            caps[r] = caps[k]
            expected.append(list(expected[k]))
            contexts.append(contexts[k])
            continue
        reach, total, row = 1.0, 1.0, [1.0]
        for _ in range(caps[r]):
            reach *= rng.choice([0.0, 1.0, rng.random(), rng.uniform(0.6, 0.95)])
            total += reach
            row.append(total)
        expected.append(row)
        contexts.append(rng.randint(1, 4000))
    rows = [1]
    for _ in range(max_depth):
        rows.append(rows[-1] + (1 if rng.random() < 0.5 else rng.randint(1, 4)))  # a chain's level or a tree's
    row_price = rng.choice([0.0, rng.uniform(1e-6, 2e-4)])
    context_row_price = rng.choice([0.0, rng.uniform(1e-9, 1e-7)])
    starts = [rng.uniform(2e-3, 5e-2) for _ in range(max(caps, default=0))]
    return expected, rows, caps, contexts, row_price, context_row_price, starts, float(requests)


@needs_native
@pytest.mark.parametrize("seed", range(80))
def test_the_extension_fills_as_the_python_does(seed):
    rng = random.Random(seed)
    args = random_state(rng, requests=rng.randint(2, 40), max_depth=rng.randint(1, 8))
    python = depth_choice.fill_shapes(*args)
    assert native(*args) == python
    assert len(python) == max(args[2]) and all(len(depth) == len(args[2]) for depth, _, _ in python)


@needs_native
def test_a_controller_chooses_the_same_on_either(monkeypatch):
    """A controller on a noisy simulated clock, 12 requests with their own acceptance, 150 steps: the same choices
    with the extension's fills as with the Python's."""

    def run() -> list[list[int]]:
        rng, now = random.Random(7), [0.0]
        ctl = AdaptiveSpeculation(clock=lambda: now[0])
        ctl.bind(max_depth=6, max_nodes=7)
        ctl.start()
        running, acceptance, choices = list(range(12)), [0.3 + 0.05 * r for r in range(12)], []
        for step in range(150):
            contexts = [100 + 3 * step + r for r in running]
            depths = ctl.choose(running, [40] * len(running), contexts)
            now[0] += (0.01 + 0.0004 * sum(d + 1 for d in depths) + 0.002 * max(depths)) * rng.uniform(0.95, 1.05)
            accepted = []
            for r, d in zip(running, depths):
                a = 0
                while a < d and rng.random() < acceptance[r]:
                    a += 1
                accepted.append(a)
            ctl.observe(running, [d + 1 for d in depths], depths, accepted, contexts)
            choices.append(depths)
        return choices

    with_extension = run()
    for module in (depth_choice, step_cost):
        monkeypatch.setattr(module, "extension_function", lambda name: None)
    assert run() == with_extension
    assert len({max(c) for c in with_extension}) > 1  # the choices moved: the fills decided something


@needs_native
@pytest.mark.parametrize(
    "change, error, match",
    [
        (dict(caps=[1, 1, 1]), ValueError, "one entry per request"),
        (dict(expected=[[1.0, 1.5], [1.0]]), ValueError, r"expected\[1\] must hold caps\[1\] \+ 1"),
        (dict(expected=[[1.0, math.nan], [1.0, 1.2]]), ValueError, "finite"),
        (dict(rows=[1]), ValueError, "rows needs max"),
        (dict(starts=[]), ValueError, "starts"),
        (dict(caps=[1, -1]), ValueError, "caps must be >= 0"),
        (dict(caps=None), TypeError, "caps must be a sequence"),
        (dict(contexts=[5, "6"]), TypeError, "integer"),
    ],
)
def test_the_extension_refuses_bad_arguments_by_name(change, error, match):
    args = dict(expected=[[1.0, 1.5], [1.0, 1.2]], rows=[1, 2], caps=[1, 1], contexts=[5, 6], row_price=1e-4,
                context_row_price=0.0, starts=[0.01], tokens0=2.0)  # fmt: skip
    args.update(change)
    with pytest.raises(error, match=match):
        native(*args.values())


@needs_native
@pytest.mark.parametrize("seed", range(20))
def test_the_extension_solves_the_cost_fit_as_the_python_does(seed):
    """The cost model's normal equations after random steps (the model's own gram, moment and prior)."""
    rng, model = random.Random(seed), StepCostModel()
    for _ in range(rng.randint(1, 60)):
        requests, levels = rng.randint(1, 32), rng.choice([0, 0, rng.randint(1, 8)])
        extra = rng.randint(0, 3 * levels * requests) if levels else 0
        x = StepCostModel.features(requests, extra, levels, rng.randint(100, 4000) * (requests + extra))
        model.observe(x, rng.uniform(2e-3, 5e-2))
        args = model.gram, model.prior_precision, model.moment, model.prior_mean
        assert native_solve(*args) == step_cost.ridge_solve(*args) == model.theta


@needs_native
@pytest.mark.parametrize(
    "change, error, match",
    [
        (dict(moment=[1.0]), ValueError, "must match moment"),
        (dict(gram=[[1.0, 0.0], [0.0]]), ValueError, "through its diagonal"),
        (dict(precision=[1.0, math.inf]), ValueError, "finite"),
        (dict(gram=[[-5.0, 0.0], [0.0, 1.0]]), ValueError, "not positive definite"),
        (dict(prior_mean=3.0), TypeError, "prior_mean must be a sequence"),
    ],
)
def test_the_extension_refuses_a_bad_fit_by_name(change, error, match):
    args = dict(gram=[[2.0, 0.5], [0.5, 1.0]], precision=[1.0, 1.0], moment=[1.0, 2.0], prior_mean=[0.0, 0.0])
    args.update(change)
    with pytest.raises(error, match=match):
        native_solve(*args.values())
