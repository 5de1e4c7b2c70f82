"""How vLLM finds the plugin (entry point, VLLM_PLUGINS), and the version gate."""

import logging
import os
import subprocess
import sys

import pytest
import vllm
from vllm.v1.sample.rejection_sampler import RejectionSampler
from vllm.v1.worker import gpu_model_runner

from specdec.integrations import vllm as plugin
from specdec.integrations._vllm_samplers import SpecdecRejectionSampler

PROBE = (
    "from vllm.plugins import load_general_plugins; load_general_plugins(); "
    "from vllm.v1.worker import gpu_model_runner; print(gpu_model_runner.RejectionSampler.__name__)"
)


@pytest.mark.parametrize(
    ("allowed", "expected"),
    [("specdec", "SpecdecRejectionSampler"), ("lora_filesystem_resolver", "RejectionSampler")],
)
def test_vllm_plugins_selects_the_entry_point(allowed, expected):
    env = dict(os.environ, VLLM_PLUGINS=allowed)
    result = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == expected


def test_untested_vllm_version_is_left_alone(monkeypatch, caplog):
    plugin.unregister()
    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    plugin.logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING, logger=plugin.logger.name):
            assert plugin.register() is False
    finally:
        plugin.logger.removeHandler(caplog.handler)
    assert gpu_model_runner.RejectionSampler is RejectionSampler
    assert "vLLM 0.33.0 is outside the tested range (0.32.x)" in caplog.text


def test_register_and_unregister_swap_the_class():
    stock_init = gpu_model_runner.GPUModelRunner.__init__
    try:
        assert plugin.register() is True
        assert plugin.register() is True  # idempotent: the original is still what unregister restores
        assert gpu_model_runner.RejectionSampler is SpecdecRejectionSampler
        assert gpu_model_runner.GPUModelRunner.__init__ is not stock_init  # binds the sampler to the positions
    finally:
        plugin.unregister()
    assert gpu_model_runner.RejectionSampler is RejectionSampler
    assert gpu_model_runner.GPUModelRunner.__init__ is stock_init


def test_the_extension_is_built_beside_vllm():
    """Users' installs build specdec._C; without it all-greedy batches take the slower PyTorch body (still exact),
    so this environment must have it too, or its tests would not time or run what users get."""
    from specdec import _backend
    from specdec.kernels.verify_greedy import _has_cpp_greedy

    assert _has_cpp_greedy(), f"specdec._C without the greedy C++ bodies: {_backend.extension_status()[1]}"
