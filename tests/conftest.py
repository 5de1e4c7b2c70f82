"""Shared test harness.

* Without CUDA, TRITON_INTERPRET=1 is set before specdec is imported, so the
  Triton kernels are decorated for the interpreter and run on the CPU.
* ``backend`` runs a kernel test once per implementation: the PyTorch reference
  path ('torch') and the Triton path ('triton': compiled on a GPU, interpreted
  elsewhere). ``device`` is where that backend's tensors live.
* ``gpu``-marked tests skip cleanly without CUDA.
* ``interpreter``-marked tests drive the Triton path with CPU tensors (CPU models, sync counters, the
  bounds checker): where CUDA is present the interpreter is off and the package refuses that, so their
  Triton cases skip there (their torch cases still run); the device tests cover the compiled kernels.
* Every test starts from a seed derived from its own name, so tests are
  reproducible alone or in any order.
* ``SPECDEC_FAILURES_LOG=path`` appends each failure's traceback to ``path`` the moment it is reported,
  so a run cut at a time limit (the GPU check's test stages) still leaves them.
"""

import os
import zlib

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from specdec import _backend  # noqa: E402  (after TRITON_INTERPRET is decided)

HAS_CUDA = torch.cuda.is_available()
# Small CPU ops are latency-bound: one intra-op thread per test process (pytest -n runs one
# process per core) avoids oversubscribing the cores.
torch.set_num_threads(1)
HAS_TRITON = _backend.triton_status()[0]


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    skip_interpreted = pytest.mark.skip(reason="runs the Triton path on CPU tensors: needs Triton's interpreter")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
        if "interpreter" in item.keywords and HAS_CUDA and _backend_of(item) != "torch":
            item.add_marker(skip_interpreted)


_XDIST_WORKER = [False]  # set at configure: under xdist only the controller writes the failures log


def pytest_configure(config):
    _XDIST_WORKER[0] = hasattr(config, "workerinput")


def pytest_runtest_logreport(report):
    path = os.environ.get("SPECDEC_FAILURES_LOG")
    if path and report.failed and not _XDIST_WORKER[0]:
        with open(path, "a") as log:
            log.write(f"\n==== {report.nodeid} ({report.when})\n{report.longreprtext}\n")


def _backend_of(item) -> str | None:
    """The backend a parametrized test runs ('torch', 'triton'), None if it names none."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    return params.get("backend", params.get("backend_name"))


@pytest.fixture(autouse=True)
def _seed_per_test(request):
    seed = zlib.crc32(request.node.nodeid.encode())
    torch.manual_seed(seed)
    yield


@pytest.fixture(params=["torch", "triton"])
def backend(request):
    """Run the test body with one backend forced; yields its name."""
    if request.param == "triton" and not HAS_TRITON:
        pytest.skip("triton is not installed")
    with _backend.use_backend(request.param):
        yield request.param


@pytest.fixture
def device(backend):
    """Device of the tensors for the current backend (CUDA when there is one)."""
    return torch.device("cuda" if HAS_CUDA else "cpu")


@pytest.fixture
def torch_backend():
    """Force the PyTorch path of every op (for model/engine tests; the Triton kernels have their own)."""
    with _backend.use_backend("torch"):
        yield


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory):
    """variant -> (path, transformers model): small random checkpoints (``helpers.HF_VARIANTS``) saved by
    transformers, each built on first use and shared by every test of the session (needs transformers)."""
    pytest.importorskip("transformers")
    from helpers import build_hf_checkpoint

    built = {}

    def get(variant):
        if variant not in built:
            path = tmp_path_factory.mktemp(variant)
            built[variant] = path, build_hf_checkpoint(path, variant)
        return built[variant]

    return get
