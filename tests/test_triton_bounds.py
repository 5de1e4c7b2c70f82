"""The bounds checker of tests/triton_bounds.py catches what it must (so a test using it can fail)."""

import os

import pytest
import torch
from triton_bounds import OutOfBounds, check_bounds

from specdec.kernels._triton import jit, tl, triton

pytestmark = pytest.mark.skipif(
    triton is None or os.environ.get("TRITON_INTERPRET") != "1", reason="checks the Triton interpreter's accesses"
)


@jit
def _double_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr, CLAMP: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    idx = tl.minimum(cols, n - 1) if CLAMP else cols
    tl.store(y_ptr + idx, 2 * tl.load(x_ptr + idx, mask=cols < n, other=0.0), mask=cols < n)


@jit
def _count_kernel(counts_ptr, slot):
    tl.atomic_add(counts_ptr + slot, 1)


def test_atomics_are_checked_too():
    counts = torch.zeros(4, dtype=torch.int32)
    with check_bounds():
        _count_kernel[(3,)](counts, 3)
    assert counts.tolist() == [0, 0, 0, 3]
    with pytest.raises(Exception, match=r"atomic through counts_ptr \(4 elements\) reaches element offsets \[4\]"):
        with check_bounds():
            _count_kernel[(1,)](counts, 4)


def test_clamped_lanes_pass_and_compute_the_same():
    x, y = torch.randn(5), torch.full((5,), float("nan"))
    with check_bounds():
        _double_kernel[(1,)](x, y, 5, BLOCK=8, CLAMP=True)
    assert torch.equal(y, 2 * x)


def test_masked_lanes_past_the_end_are_reported_after_the_launch():
    x, y = torch.randn(5), torch.empty(5)
    with pytest.raises(OutOfBounds, match=r"load through x_ptr \(5 elements\) reaches element offsets \[5, 6, 7\]"):
        with check_bounds():
            _double_kernel[(1,)](x, y, 5, BLOCK=8, CLAMP=False)
    with check_bounds(masked_lanes=False):  # a GPU would not touch them
        _double_kernel[(1,)](x, y, 5, BLOCK=8, CLAMP=False)


def test_an_active_lane_past_the_end_stops_the_kernel_before_it_reads():
    x, y = torch.randn(5), torch.empty(5)
    with pytest.raises(Exception, match=r"x_ptr \(5 elements\) reaches element offsets \[5\].*active lanes"):
        with check_bounds(masked_lanes=False):
            _double_kernel[(1,)](x, y, 6, BLOCK=8, CLAMP=True)


def test_any_access_to_an_empty_tensor_is_reported():
    with pytest.raises(OutOfBounds, match=r"x_ptr \(0 elements\)"):
        with check_bounds():
            _double_kernel[(1,)](torch.empty(0), torch.empty(5), 0, BLOCK=8, CLAMP=False)


def test_a_read_inside_another_argument_still_counts_as_outside():
    """Pointers remember their own tensor: landing in a neighbouring buffer is no excuse."""
    both = torch.randn(10)
    x, y = both[:5], both[5:]  # y starts where x ends
    with pytest.raises(Exception, match="x_ptr"):
        with check_bounds(masked_lanes=False):
            _double_kernel[(1,)](x, y, 6, BLOCK=8, CLAMP=True)
