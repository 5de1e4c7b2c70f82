"""Tree attention's tile choice: the main kernel's launch shape from host sizes, and the tuning spaces.

The kernels and their launcher are in ``specdec.kernels.tree_attention_kernels``; the plan
(``specdec.kernels.attention_plan``) chooses a tile once per forward with ``tile_config``.
"""

from __future__ import annotations

import functools
from fractions import Fraction
from typing import NamedTuple

import torch

from specdec.kernels.tuning import TuningSpace, candidates

MAX_HEAD_DIM = 256  # widest head the Triton tiles hold (BLOCK_D); the PyTorch path has no limit


class TileConfig(NamedTuple):
    """Launch shape of the main kernel; ``list(config)`` is how the registered op receives it."""

    block_m: int
    block_q: int
    block_n: int
    block_d: int
    num_warps: int
    num_splits: int
    num_stages: int = 3
    tiles_per_request: int = 0  # query tiles of every request when all have the same queries; 0: ragged
    hopper: int = 1  # planned for compute capability >= 9 (picks the tuning space)


def next_pow2(x: int) -> int:
    return 1 << max(0, x - 1).bit_length()


# (KV positions per step BLOCK_N, warps, pipeline stages) by tile rows BLOCK_M: the tuning candidates, the
# default first. Every one compiles for its architectures without register spills at the shapes of
# bench/compile_matrix.py (which runs under Triton 3.6 and 3.9); what was left out spilled somewhere (ptxas
# allocates registers differently per version, architecture and head width).
_CHOICES_16BIT = {
    16: ((64, 4, 3), (64, 4, 2), (32, 4, 3)),  # (64, 8) spills on sm_90 with Triton 3.6
    32: ((64, 4, 3), (64, 4, 2), (32, 8, 3)),  # (32, 4, 3) spills on sm_80
    64: ((64, 8, 3), (64, 8, 2), (32, 8, 3)),  # (64, 4) spills on sm_80, (32, 4, 3) takes 246 registers
}
# sm_80's 128-row tile: 16-wide KV steps (32-wide ones spill at some head width with Triton 3.6 or 3.9)
_CHOICES_SM80_128 = ((16, 8, 3),)
# Hopper's 128-row tile (trees over 128 rows per request take two): 64-wide KV steps keep the tensor cores
# busy between softmax updates, with three K/V buffers in 227 KB of shared memory
_CHOICES_HOPPER_128 = ((64, 8, 3), (64, 8, 2), (32, 8, 3), (64, 8, 4))
# head dims above 128 (at most 64 rows), 3 stages to double-buffer K and V: decode's 16 rows over 16 warps
# ((32, 8, 3) spills on sm_90 with Triton 3.6), wider tiles in 16-wide KV steps ((32, 8, 2) spills on sm_80
# with Triton 3.6, every 16-warp tile is capped at 128 registers and spills)
_CHOICES_WIDE_HEAD = {16: ((32, 16, 3), (16, 8, 3), (32, 8, 2)), 64: ((16, 8, 3), (16, 8, 2))}
# fp32 dots run on FMA units with twice the registers: 16 rows (one query token of a group of up to 16)
# and one choice, 16-wide KV steps over 8 warps in 2 stages, the one found clean at every shape, split or not
# ((32, 16, 3) spilled in the chain's split tile on sm_90 with Triton 3.6; (16, 8, 3) on both with Triton 3.9)
_CHOICES_FP32 = {16: ((16, 8, 2),)}


def tile_choices(block_m: int, block_d: int, fp32: bool, hopper: bool = True) -> tuple[tuple[int, int, int], ...]:
    """The (BLOCK_N, num_warps, num_stages) candidates of a tile, the default first."""
    if fp32:
        return _CHOICES_FP32.get(block_m, _CHOICES_FP32[16])  # (groups above 16 in fp32: not in the matrix)
    if block_d > 128:
        return _CHOICES_WIDE_HEAD[16 if block_m <= 16 else 64]
    if block_m == 128:
        return _CHOICES_HOPPER_128 if hopper else _CHOICES_SM80_128
    return _CHOICES_16BIT.get(block_m, ((32, 8, 3),))


def tile_config(
    tokens: int,
    batch: int,
    group: int,
    head_dim: int,
    num_splits: int,
    *,
    fp32: bool = False,
    hopper: bool = True,
    uniform: bool = False,
) -> TileConfig:
    """Tile sizes, warps and stages of the main kernel, from host sizes only (``hopper``: compute
    capability >= 9; ``uniform``: every request has ``tokens / batch`` queries)."""
    block_d = max(16, next_pow2(head_dim))  # tl.dot needs 16; lanes past head_dim are masked
    # Rows are (query token, head of the group) pairs; size the tile to the mean request, so decode and
    # small trees read each KV tile once per (request, KV head). Larger requests take several tiles.
    rows = next_pow2(-(-tokens // batch) * group)
    if fp32:
        block_m = max(16, next_pow2(group))
    else:
        block_m = max(16, min(128 if block_d <= 128 else 64, rows), next_pow2(group))
    block_n, num_warps, num_stages = tile_choices(block_m, block_d, fp32, hopper)[0]
    block_q = block_m // group
    tiles_per_request = -(-(tokens // batch) // block_q) if uniform else 0
    return TileConfig(block_m, block_q, block_n, block_d, num_warps, num_splits, num_stages, tiles_per_request,
                      int(hopper))  # fmt: skip


@functools.cache
def attention_space(block_m: int, block_d: int, fp32: bool, hopper: bool = True) -> TuningSpace:
    """Candidates at the plan's rows per tile (BLOCK_M, set by the requests' shape) and head tile: KV
    positions per step, warps and pipeline stages (``tile_choices``)."""
    configs = tuple(
        dict(BLOCK_N=n, num_warps=w, num_stages=s) for n, w, s in tile_choices(block_m, block_d, fp32, hopper)
    )
    return TuningSpace(configs, key=("BLOCK_M", "BLOCK_D", "GROUP", "PAGED", "TREE", "NUM_SPLITS"))


MERGE_SPACE = TuningSpace(candidates(num_warps=(2, 4)), key=("NUM_SPLITS", "BLOCK_D"))


# Registers per thread a tile is counted at for occupancy: 16-row (decode) tiles compile within 168 on sm_80
# and sm_90 (bench/compile_matrix.py); wider tiles are counted at ptxas's ceiling.
_DECODE_REGISTERS, _MAX_REGISTERS = 168, 255
SPLIT_MIN_STEPS = 4  # KV steps (BLOCK_N positions) a split must have at least: its fixed cost and the merge
MAX_SPLITS = 64
SPLIT_SLACK = Fraction(11, 10)


def ctas_per_sm(tile: TileConfig, props, elem_bytes: int) -> int:
    """Programs of ``tile`` one SM holds at once (an estimate): the least of what its threads, its registers
    (counted as above) and its shared memory (Q and S staging plus ``num_stages - 1`` K and V buffers) allow
    on a device with properties ``props`` (``torch.cuda.get_device_properties``)."""
    threads = tile.num_warps * 32
    registers = _DECODE_REGISTERS if tile.block_m <= 16 else _MAX_REGISTERS
    buffers = max(1, tile.num_stages - 1)
    shared = elem_bytes * (2 * buffers * tile.block_n * tile.block_d + tile.block_m * (tile.block_d + tile.block_n))
    by_threads = getattr(props, "max_threads_per_multi_processor", 2048) // threads
    by_registers = getattr(props, "regs_per_multiprocessor", 65536) // (threads * registers)
    by_shared = getattr(props, "shared_memory_per_multiprocessor", 167936) // shared
    return max(1, min(by_threads, by_registers, by_shared))


def default_splits(device: torch.device, tokens: int, batch: int, kv_heads: int, block: TileConfig, context: int,
                   elem_bytes: int = 2) -> int:  # fmt: skip
    """Context splits per query tile: 1 off the GPU, and when the working programs already fill every SM.
    Else the fewest splits that finish within SPLIT_SLACK of the soonest, counted in whole waves of
    ``ctas_per_sm`` programs per SM, each split keeping at least SPLIT_MIN_STEPS KV steps of the ``context``
    bound. Working tiles: B x tiles per request with uniform queries, else the grid's bound."""
    if device.type != "cuda":
        return 1
    props = torch.cuda.get_device_properties(device)
    tiles = batch * block.tiles_per_request if block.tiles_per_request else tokens // block.block_q + batch
    programs = max(1, tiles * kv_heads)
    slots = props.multi_processor_count * ctas_per_sm(block, props, elem_bytes)
    most = max(1, min(MAX_SPLITS, context // (SPLIT_MIN_STEPS * block.block_n)))
    if programs >= slots or most == 1:
        return 1
    # time ~ waves x each split's share of the context; more splits cost merge traffic, so take the fewest
    # within SPLIT_SLACK of the fastest
    cost = {s: Fraction(-(-programs * s // slots), s) for s in range(1, most + 1)}
    best = min(cost.values())
    return min(s for s, c in cost.items() if c <= best * SPLIT_SLACK)
