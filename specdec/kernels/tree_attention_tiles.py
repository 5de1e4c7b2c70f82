"""Tree attention's tile choice: the main kernel's launch shape from host sizes, and the tuning spaces.

The kernels and their launcher are in ``specdec.kernels.tree_attention_kernels``; the plan
(``specdec.kernels.attention_plan``) chooses a tile once per forward with ``tile_config``.
"""

from __future__ import annotations

import functools
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


def next_pow2(x: int) -> int:
    return 1 << max(0, x - 1).bit_length()


# (KV positions per step BLOCK_N, warps, pipeline stages) by tile rows BLOCK_M: the tuning candidates, the
# default first. Every one compiles for sm_80 and sm_90 with Triton 3.6 and 3.9 without register spills
# at the shapes of bench/compile_matrix.py; what was left out spilled somewhere (ptxas allocates
# registers differently per version and architecture).
_CHOICES_16BIT = {
    16: ((64, 4, 3), (64, 4, 2), (32, 4, 3)),  # (64, 8) spills on sm_90 with Triton 3.6
    32: ((64, 4, 3), (64, 4, 2), (32, 4, 3), (32, 8, 3)),
    64: ((64, 8, 3), (64, 8, 2), (32, 8, 3), (32, 4, 3)),  # (64, 4) spills on sm_80
    128: ((32, 8, 3), (32, 8, 2)),  # (64, 8) spills on sm_80
    256: ((16, 8, 3), (16, 8, 2)),  # Hopper only (everything spills on sm_80); (32, 8) spills with Triton 3.6
}
# head dims above 128 (at most 64 rows): (32, 8, 3) spills on sm_80 with Triton 3.6, (16, 8, 3) on sm_90 with 3.9
_CHOICES_WIDE_HEAD = ((32, 8, 2),)
# fp32 dots run on FMA units with twice the registers: 16 rows (one query token of a group of up to 16)
# and one choice (wider tiles spill on sm_90 once the kernel also writes lse, 32 rows spill on sm_80)
_CHOICES_FP32 = {16: ((16, 8, 3),)}


def tile_choices(block_m: int, block_d: int, fp32: bool) -> tuple[tuple[int, int, int], ...]:
    """The (BLOCK_N, num_warps, num_stages) candidates of a tile, the default first."""
    if fp32:
        return _CHOICES_FP32.get(block_m, ((16, 8, 3),))  # (groups above 16 in fp32: not in the matrix)
    if block_d > 128:
        return _CHOICES_WIDE_HEAD
    return _CHOICES_16BIT.get(block_m, ((32, 8, 3),))


def tile_config(
    tokens: int, batch: int, group: int, head_dim: int, num_splits: int, *, fp32: bool = False, hopper: bool = True
) -> TileConfig:
    """Tile sizes, warps and stages of the main kernel, from host sizes only (``hopper``: compute
    capability >= 9)."""
    block_d = max(16, next_pow2(head_dim))  # tl.dot needs 16; lanes past head_dim are masked
    # Rows are (query token, head of the group) pairs; size the tile to the mean request, so
    # decode and trees up to BLOCK_Q nodes read each KV tile once per (request, KV head).
    rows = next_pow2(-(-tokens // batch) * group)
    if fp32:
        block_m = max(16, next_pow2(group))
    elif hopper and block_d <= 128 and 128 < rows <= 256:
        # e.g. a 64-node tree x 4 heads: 256 rows in one tile with 16-wide KV steps (about 240
        # registers, no spills on sm_90) rather than two 128-row tiles that would each read the context
        block_m = 256
    else:
        block_m = max(16, min(128 if block_d <= 128 else 64, rows), next_pow2(group))
    block_n, num_warps, num_stages = tile_choices(block_m, block_d, fp32)[0]
    return TileConfig(block_m, block_m // group, block_n, block_d, num_warps, num_splits, num_stages)


@functools.cache
def attention_space(block_m: int, block_d: int, fp32: bool) -> TuningSpace:
    """Candidates at the plan's rows per tile (BLOCK_M, set by the requests' shape) and head tile: KV
    positions per step, warps and pipeline stages (``tile_choices``)."""
    configs = tuple(dict(BLOCK_N=n, num_warps=w, num_stages=s) for n, w, s in tile_choices(block_m, block_d, fp32))
    return TuningSpace(configs, key=("BLOCK_M", "BLOCK_D", "GROUP", "PAGED", "TREE", "NUM_SPLITS"))


MERGE_SPACE = TuningSpace(candidates(num_warps=(2, 4)), key=("NUM_SPLITS", "BLOCK_D"))


def default_splits(device: torch.device, tokens: int, batch: int, kv_heads: int, block: TileConfig, context: int):
    """Split each tile's context until the grid covers the GPU about twice (1 off the GPU)."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    tiles = tokens // block.block_q + batch
    return max(1, min(-(-2 * sms // (tiles * kv_heads)), -(-context // (4 * block.block_n)), 64))
