"""The adaptive controller's host loops in the extension against their Python: the choice of depths
(``specdec._C.best_depths``, ``depth_choice.best_depths``: fills and prices), the acceptance estimate's updates and
expected tokens (``specdec._C.observe_acceptance`` and ``expected_tokens``, ``AcceptanceModel``) and the cost
model's learning from a step (``specdec._C.observe_cost``, ``StepCostModel.observe``), bit for bit on random
controller states (ties between requests included); the same choices from a controller on either; and the
extension's refusals of bad arguments."""

import math
import random

import pytest

from specdec import _backend
from specdec.decoding import acceptance, depth_choice, step_cost
from specdec.decoding.adaptive import AcceptanceModel, AdaptiveSpeculation, StepCostModel

native = _backend.extension_function("best_depths")
native_observe_cost = _backend.extension_function("observe_cost")
native_observe = _backend.extension_function("observe_acceptance")
native_expected = _backend.extension_function("expected_tokens")
needs_native = pytest.mark.skipif(
    None in (native, native_observe_cost, native_observe, native_expected),
    reason=f"specdec._C's controller functions are not built ({_backend.extension_status()[1]})",
)


def random_prices(rng: random.Random, requests: int, max_depth: int) -> tuple:
    """``best_depths``'s prices, caps and contexts as the controller makes them: expected tokens that grow by the
    chance of each next depth, chains or trees; some requests copies of others (equal ratios)."""
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
    return (expected, rows), caps, contexts


def random_cost(rng: random.Random, requests: int, max_depth: int, rows: list[int]) -> StepCostModel:
    """A cost model after random steps, many of them shapes ``best_depths`` prices (this batch, its uniform depths),
    so both measured means and the linear part with its residuals are read; free or dear rows and context."""
    model = StepCostModel()
    for _ in range(rng.randint(1, 60)):
        n = rng.choice([requests, requests, rng.randint(1, 40)])
        levels = rng.choice([0, rng.randint(1, max_depth)])
        extra = rng.choice([n * (rows[levels] - 1), rng.randint(0, 3 * levels * n)])
        model.observe(StepCostModel.features(n, extra, levels, rng.randint(100, 4000) * (n + extra)),
                      rng.uniform(2e-3, 5e-2))  # fmt: skip
    if rng.random() < 0.5:
        model.row_price = rng.choice([0.0, rng.uniform(1e-6, 2e-4)])
        model.context_price = rng.choice([0.0, rng.uniform(1e-7, 1e-4)])
    return model


def python_best_depths(monkeypatch, *args) -> list[int]:
    with monkeypatch.context() as patch:
        patch.setattr(depth_choice, "extension_function", lambda name: None)
        return depth_choice.best_depths(*args)


@needs_native
@pytest.mark.parametrize("seed", range(120))
def test_the_extension_chooses_as_the_python_does(seed, monkeypatch):
    rng = random.Random(seed)
    requests, max_depth = rng.choice([1, 2, rng.randint(2, 40)]), rng.randint(1, 8)
    prices, caps, contexts = random_prices(rng, requests, max_depth)
    cost = random_cost(rng, requests, max_depth, prices[1])
    entry = rng.choice([0.0, rng.uniform(1e-4, 1e-2)])
    python = python_best_depths(monkeypatch, cost, prices, caps, contexts, entry)
    assert depth_choice.best_depths(cost, prices, caps, contexts, entry) == python
    assert len(python) == requests and all(0 <= d <= cap for d, cap in zip(python, caps))


@needs_native
def test_the_random_states_reach_every_kind_of_choice():
    """The states above are not all one answer: plain decoding, uniform depths and mixed fills all come out."""
    kinds = set()
    for seed in range(120):
        rng = random.Random(seed)
        requests, max_depth = rng.choice([1, 2, rng.randint(2, 40)]), rng.randint(1, 8)
        (expected, rows), caps, contexts = random_prices(rng, requests, max_depth)
        cost = random_cost(rng, requests, max_depth, rows)
        choice = native(*tables(cost), expected, rows, caps, contexts, 0.0)
        uniform = [min(max(choice), cap) for cap in caps]
        kinds.add("plain" if max(choice) == 0 else "uniform" if choice == uniform else "mixed")
    assert kinds == {"plain", "uniform", "mixed"}


def tables(cost: StepCostModel) -> tuple:
    """``specdec._C.best_depths``'s first arguments: the cost model's tables and fitted prices."""
    return cost.shape_mean, cost.residual, cost.theta, cost.row_price, cost.context_price


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
    for module in (acceptance, depth_choice, step_cost):
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
        (dict(caps=[1, -1]), ValueError, "caps must be >= 0"),
        (dict(caps=None), TypeError, "caps must be a sequence"),
        (dict(contexts=[5, "6"]), TypeError, "integer"),
        (dict(theta=None), TypeError, "theta must be a sequence"),
        (dict(theta=[0.0] * 6), ValueError, "7 parameters"),
        (dict(shape_mean=[]), TypeError, "dict"),
        (dict(shape_mean={(2, 1, 0): 0.01}), TypeError, "shape_mean's values must be lists"),
        (dict(residual={1: "x"}), TypeError, "residual's values must be floats"),
        (dict(shape_mean={(2, 1, 0): [0.01, "x", 1.0, 1.0]}), TypeError, "lists of floats"),
    ],
)
def test_the_extension_refuses_bad_arguments_by_name(change, error, match):
    args = dict(shape_mean={}, residual={}, theta=[1e-3] * 7, row_price=1e-4, context_price=0.0,
                expected=[[1.0, 1.5], [1.0, 1.2]], rows=[1, 2], caps=[1, 1], contexts=[5, 6], entry=0.0)  # fmt: skip
    args.update(change)
    with pytest.raises(error, match=match):
        native(*args.values())


@needs_native
@pytest.mark.parametrize("seed", range(30))
def test_the_extension_learns_acceptance_as_the_python_does(seed, monkeypatch):
    """Two acceptance models fed the same random steps (slots joining and leaving, plain steps, invalid logits),
    one through the extension and one through the Python: the same tables and expected tokens after every step."""
    rng = random.Random(seed)
    prior = rng.uniform(0.1, 0.9)
    fast, slow = AcceptanceModel(prior), AcceptanceModel(prior)
    if rng.random() < 0.5:  # the ablation's pooled-only estimate
        fast.request_weight = slow.request_weight = 1e9
    max_depth = rng.randint(1, 8)
    for _ in range(rng.randint(1, 80)):
        running = sorted(rng.sample(range(16), rng.randint(0, 12)))
        depths = [rng.choice([0, max_depth, rng.randint(0, max_depth)]) for _ in running]
        accepted = [None if rng.random() < 0.05 else rng.randint(0, d) for d in depths]
        caps = [rng.randint(0, max_depth) for _ in running]
        fast.observe_step(running, depths, accepted)
        with monkeypatch.context() as patch:
            patch.setattr(acceptance, "extension_function", lambda name: None)
            slow.observe_step(running, depths, accepted)
            python = slow.expected_tokens(running, caps)
        assert fast.requests == slow.requests and fast.pooled == slow.pooled
        assert fast.expected_tokens(running, caps) == python
        if rng.random() < 0.1:
            gone = rng.sample(range(16), 3)
            fast.forget(gone)
            slow.forget(gone)
    assert fast.pooled  # something was learnt


@needs_native
@pytest.mark.parametrize(
    "function, change, error, match",
    [
        ("observe", dict(depths=[1]), ValueError, "one entry per request"),
        ("observe", dict(accepted=[1, "x"]), TypeError, "accepted must hold ints or None"),
        ("observe", dict(pooled=()), TypeError, "pooled must be a list"),
        ("observe", dict(requests={0: [[1.0]]}), TypeError, "a request's table must hold"),
        ("expected", dict(caps=[1]), ValueError, "one entry per request"),
        ("expected", dict(caps=[1, -1]), ValueError, "caps must be >= 0"),
        ("expected", dict(pooled=[[1.0, "x"]]), TypeError, "pooled must hold"),
        ("expected", dict(requests={0: 5}), TypeError, "a request's table must be a list"),
    ],
)
def test_the_extension_refuses_bad_acceptance_tables_by_name(function, change, error, match):
    if function == "observe":
        args = dict(requests={}, pooled=[], running=[0, 1], depths=[2, 2], accepted=[1, 0], request_decay=0.9,
                    pooled_decay=0.995)  # fmt: skip
        call = native_observe
    else:
        args = dict(requests={}, pooled=[[1.0, 2.0]], prior=0.6, pooled_weight=4.0, request_weight=3.0,
                    running=[0, 1], caps=[2, 2])  # fmt: skip
        call = native_expected
    args.update(change)
    with pytest.raises(error, match=match):
        call(*args.values())


def random_steps(rng: random.Random):
    """Steps as a cost model sees them: shapes that repeat (so means warm up and residuals form), stalls, a few
    batch sizes and depths."""
    shapes = [(rng.randint(1, 32), rng.choice([0, rng.randint(1, 8)])) for _ in range(rng.randint(1, 6))]
    for _ in range(rng.randint(1, 80)):
        requests, levels = rng.choice(shapes)
        extra = rng.choice([requests * levels, rng.randint(0, 3 * levels * requests)]) if levels else 0
        seconds = (1e-3 + 2e-4 * (requests + extra) + 1e-3 * levels) * rng.uniform(0.9, 1.1)
        if rng.random() < 0.05:  # a stalled step
            seconds *= rng.uniform(3, 10)
        yield StepCostModel.features(requests, extra, levels, rng.randint(100, 4000) * (requests + extra)), seconds


@needs_native
@pytest.mark.parametrize("seed", range(30))
@pytest.mark.parametrize("variant", ["shipped", "no outlier caps", "forgetful tables"])
def test_the_extension_learns_step_costs_as_the_python_does(seed, variant, monkeypatch):
    """Two cost models fed the same random steps, one through the extension and one through the Python: the same
    state after every step (means, residuals, normal equations, the solved fit), also with the module's constants
    swapped and with tables that keep nothing, as the ablation benchmark makes them."""

    class Forgetful(dict):
        def __setitem__(self, key, value):
            pass

    if variant == "no outlier caps":
        monkeypatch.setattr(step_cost, "FIT_OUTLIER_CAP", math.inf)
        monkeypatch.setattr(step_cost, "SHAPE_STEP_CAP", math.inf)
    fast, slow = StepCostModel(), StepCostModel()
    if variant == "forgetful tables":
        fast.residual, slow.residual = Forgetful(), Forgetful()
    for x, seconds in random_steps(random.Random(seed)):
        fast.observe(x, seconds)
        with monkeypatch.context() as patch:
            patch.setattr(step_cost, "extension_function", lambda name: None)
            slow.observe(x, seconds)
        assert repr(vars(fast)) == repr(vars(slow))  # (repr: a NaN the variant makes counts as equal to itself)
    assert fast.theta is not None and fast.shape_mean


@needs_native
@pytest.mark.parametrize(
    "change, error, match",
    [
        (dict(x=[1.0] * 6), ValueError, "must hold the 7 features"),
        (dict(x=[1.0] * 6 + [math.nan]), ValueError, "finite"),
        (dict(seconds=math.inf), ValueError, "seconds must be finite"),
        (dict(prior_shares=(0.5,) * 6), ValueError, "prior_shares"),
        (dict(gram=[[0.0] * 7] * 6), TypeError, "its gram a list of 7 such lists"),
        (dict(gram=[[0.0] * 6] * 7), TypeError, "gram must be a list of 7 lists of 7 floats"),
        (dict(shape_mean={(2, 1, 1): [0.01, 1.0]}), TypeError, "shape_mean's values must be lists of 4 floats"),
        (dict(residual={1: "x"}), TypeError, "residual must map level counts to floats"),
        (dict(prior_mean=[0.0] * 7, prior_precision=[-1e9] * 7), ValueError, "not positive definite"),
    ],
)
def test_the_extension_refuses_a_bad_cost_model_by_name(change, error, match):
    model = StepCostModel()
    model.observe(StepCostModel.features(2, 2, 1, 800.0), 0.01)  # the shape (2, 1, 1), now known
    arguments = dict(x=StepCostModel.features(2, 2, 1, 800.0), seconds=0.01)
    for name, value in change.items():
        if name in arguments:
            arguments[name] = value
        elif name != "prior_shares":
            setattr(model, name, value)
    constants = [
        step_cost.SHAPE_STEP_CAP,
        step_cost.FIT_OUTLIER_CAP,
        step_cost.SHAPE_DECAY,
        change.get("prior_shares", step_cost.PRIOR_SHARES),
        step_cost.PRIOR_WEIGHTS,
        step_cost.RESIDUAL_DECAY,
    ]
    steps = model.steps
    with pytest.raises(error, match=match):
        native_observe_cost(model, *arguments.values(), *constants)
    if "prior_precision" not in change:  # refused before anything changed (a failed solve comes last)
        assert model.steps == steps
