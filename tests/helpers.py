"""Assertions shared by the tests (import as `from helpers import ...`)."""

import torch


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float, what: str = "") -> None:
    """torch.testing.assert_close that also names the worst element."""
    actual, expected = actual.double().cpu(), expected.double().cpu()
    err = (actual - expected).abs() - rtol * expected.abs()
    if not torch.isfinite(actual).all():
        bad = (~torch.isfinite(actual)).nonzero()[0].tolist()
        raise AssertionError(f"{what}: non-finite output at {bad}")
    if err.numel() and err.max() > atol:
        idx = torch.unravel_index(err.argmax(), err.shape)
        idx = tuple(int(i) for i in idx)
        raise AssertionError(
            f"{what}: mismatch at {idx}: got {actual[idx].item():.6g}, expected {expected[idx].item():.6g} "
            f"(atol={atol}, rtol={rtol}, max excess {err.max().item():.3g})"
        )
