"""Launch configurations: each Triton kernel's default and the candidates it declares for autotuning.

Every launcher computes its default configuration from host sizes (its heuristic) and
launches through ``launch(kernel, grid, args, meta, config, space)``:

* ``meta`` holds the meta-parameters that say what the kernel computes (dtype switches,
  layouts, padded sizes); ``config`` the ones that only say how fast: tile sizes and the
  launch options ``num_warps``, ``num_stages`` and ``maxnreg`` (a register allowance that
  lifts ptxas's occupancy-driven cap where a kernel runs few programs). Any candidate of
  ``space`` gives the same results as the default, up to the order of floating-point sums.
* Tuning off (the default): the kernel runs with ``config``, no benchmarking, nothing a
  CUDA-graph capture or a ``torch.compile`` region could trip on.
* ``SPECDEC_AUTOTUNE=1`` (read at the first launch, and again at the first launch after
  ``set_autotune(None)``: call that after changing the variable in a running process; ``0`` or
  unset is off, any other value is refused with an error naming the variable, at every launch
  until it is fixed; ``set_autotune`` overrides it) on a GPU: the launch
  goes through ``triton.autotune`` over the default and the space's candidates, keyed by the
  space's ``key`` (argument names; the tensors' dtypes are added by Triton). The first call
  for each key value benchmarks every candidate, later calls reuse the winner, so run one
  eager step before capturing a CUDA graph. Keys never hold the batch size: a request's
  result then never depends on the batch it shares (one configuration, one summation order).
  The interpreter ignores the setting.
* ``use_config(name, config)`` pins one kernel's configuration (tests prove every candidate
  against the reference this way); ``chosen_configs()`` says what each kernel last launched
  with (the benchmarks print it per row); ``capture_launches()`` records launches instead of
  running them (``compile_target`` compiles them for a GPU without one).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from specdec import _backend
from specdec.kernels import triton_dispatch

AUTOTUNE_ENV = "SPECDEC_AUTOTUNE"
PERF_KEYS = {"num_warps": "w", "num_stages": "s", "maxnreg": "r"}  # launch options (not kernel arguments), short
_autotune: bool | None = None  # set_autotune's choice; None follows the environment variable
_env_autotune: bool | None = None  # the variable as last read (None: read it at the next launch)


@dataclass(frozen=True)
class TuningSpace:
    """Candidate configurations of one launch and the arguments whose values select one."""

    configs: tuple[dict, ...]  # each: tile meta-parameters plus launch options (num_warps, num_stages, maxnreg)
    key: tuple[str, ...]  # argument names (meta-parameters too) for triton.autotune's key
    restore: tuple[str, ...] = ()  # arguments the kernel updates in place: restored between trials
    autotune: bool = True  # False: the candidates are compiled and can be pinned, never benchmarked by Triton


class Launch(NamedTuple):
    """One launch as the launcher planned it (what ``capture_launches`` records; a tuple, cheap to make)."""

    kernel: object  # the @triton.jit function
    grid: tuple
    args: tuple
    meta: dict
    config: dict  # the configuration it launches with
    space: TuningSpace

    @property
    def name(self) -> str:
        return self.kernel.__name__


def candidates(**axes: Sequence) -> tuple[dict, ...]:
    """Every combination of the axes: ``candidates(BLOCK=(512, 1024), num_warps=(4, 8))``."""
    return tuple(dict(zip(axes, values)) for values in itertools.product(*axes.values()))


def set_autotune(enabled: bool | None) -> None:
    """Turn autotuning on or off for later launches; ``None`` follows SPECDEC_AUTOTUNE again, read anew
    at the next launch."""
    global _autotune, _env_autotune
    _autotune = None if enabled is None else bool(enabled)
    _env_autotune = None


def autotune_enabled() -> bool:
    """``set_autotune``'s choice, else the environment variable (see ``parse_autotune``), read once and
    kept until ``set_autotune`` is called (a value that is refused is never kept)."""
    global _env_autotune
    if _autotune is not None:
        return _autotune
    if _env_autotune is None:
        _env_autotune = parse_autotune(os.environ.get(AUTOTUNE_ENV, ""))
    return _env_autotune


def parse_autotune(value: str) -> bool:
    """A value of SPECDEC_AUTOTUNE: ``1`` on; ``0``, empty or unset off. Anything else is refused rather
    than guessed at (``false`` or ``off`` must not turn benchmarking on in a CUDA-graph capture)."""
    value = value.strip()
    if value in ("", "0"):
        return False
    if value == "1":
        return True
    raise ValueError(f"{AUTOTUNE_ENV} must be 1 (on) or 0 (off, as when unset), got {value!r}")


_pinned: dict[str, dict] = {}
_chosen: dict[str, dict] = {}
_captured: list[list[Launch]] = []


@contextlib.contextmanager
def use_config(kernel_name: str, config: dict) -> Iterator[None]:
    """Launch ``kernel_name`` with ``config`` (instead of its default) inside the block."""
    previous = _pinned.get(kernel_name)
    _pinned[kernel_name] = dict(config)
    try:
        yield
    finally:
        if previous is None:
            del _pinned[kernel_name]
        else:
            _pinned[kernel_name] = previous


@contextlib.contextmanager
def capture_launches() -> Iterator[list[Launch]]:
    """Record every launch inside the block (nothing runs; outputs stay as they were)."""
    record: list[Launch] = []
    _captured.append(record)
    try:
        yield record
    finally:
        _captured.pop()


def chosen_configs() -> dict[str, dict]:
    """{kernel name: the configuration of its last launch} since the last ``clear_chosen``."""
    return {name: dict(config) for name, config in _chosen.items()}


def clear_chosen() -> None:
    _chosen.clear()


def describe(config: dict) -> str:
    """A short form: ``BLOCK_N=64 w4 s3`` (warps, stages; ``r128``: at most 128 registers per thread)."""
    tiles = [f"{k}={v}" for k, v in config.items() if k not in PERF_KEYS]
    return " ".join(tiles + [f"{short}{config[k]}" for k, short in PERF_KEYS.items() if k in config])


def launch(kernel, grid, args: tuple, meta: dict, config: dict, space: TuningSpace) -> None:
    """Run ``kernel`` with ``config`` (or, autotuning, the best of ``space``); ``grid`` is a tuple or a
    function of the configuration (a dict of the meta-parameters, as Triton passes it). Launchers call
    this on every op call: the common case (no pin, no capture, no tuning) does only a few lookups."""
    tune = autotune_enabled()  # a bad SPECDEC_AUTOTUNE fails the first launch on every backend, not only on a GPU
    pinned = _pinned.get(kernel.__name__) if _pinned else None
    if pinned is not None:
        config = pinned
    shape = grid(config) if callable(grid) else grid
    if _captured:
        _captured[-1].append(Launch(kernel, shape, args, meta, config, space))
        return
    if tune and space.autotune and pinned is None and not _backend.interpreter_enabled():
        tuned = _autotuner(kernel, _frozen((config, *space.configs)), space.key, space.restore)
        tuned[grid if callable(grid) else lambda _: grid](*args, **meta)
        best = tuned.best_config
        options = {"num_warps": best.num_warps, "num_stages": best.num_stages, "maxnreg": best.maxnreg}
        _chosen[kernel.__name__] = {**best.kwargs, **{k: v for k, v in options.items() if v is not None}}
        return
    triton_dispatch.launch(kernel, shape, args, meta, config)
    _chosen[kernel.__name__] = config


def _frozen(configs: Sequence[dict]) -> tuple:
    unique = []
    for c in configs:
        item = tuple(sorted(c.items()))
        if item not in unique:
            unique.append(item)
    return tuple(unique)


@functools.cache
def _autotuner(kernel, configs: tuple, key: tuple[str, ...], restore: tuple[str, ...]) -> Callable:
    import triton

    def to_config(items) -> triton.Config:
        c = dict(items)
        perf = {k: c.pop(k) for k in PERF_KEYS if k in c}
        return triton.Config(c, **perf)

    return triton.autotune([to_config(c) for c in configs], key=list(key), restore_value=list(restore))(kernel)
