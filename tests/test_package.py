"""Package-level behaviour: imports without the extension, backend dispatch, the CLI."""

import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from specdec import _backend, use_backend

HIDE_EXTENSION = textwrap.dedent(
    """
    import importlib.abc, sys

    class HideExtension(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "specdec._C":
                raise ImportError("specdec._C hidden by the test")
            return None

    sys.meta_path.insert(0, HideExtension())
    """
)


def run_python(code: str, **env) -> subprocess.CompletedProcess:
    import os

    full_env = {**os.environ, **env}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=full_env, timeout=300)


def test_import_and_ops_work_with_the_extension_hidden():
    code = HIDE_EXTENSION + textwrap.dedent(
        """
        import torch, specdec
        from specdec import _backend
        from specdec.kernels import build_tree_metadata
        assert _backend.extension_status()[0] is None, "extension should be hidden"
        meta = build_tree_metadata(torch.tensor([-1, 0, 0, 1], dtype=torch.int32),
                                   torch.tensor([0, 4], dtype=torch.int32))
        assert meta.depth.tolist() == [0, 1, 1, 2]
        from specdec.cli import main
        main(["info"])
        """
    )
    result = run_python(code, TRITON_INTERPRET="0")
    assert result.returncode == 0, result.stderr
    assert "specdec._C hidden by the test" in result.stdout


def test_extension_has_op_answers_for_ops_an_older_build_lacks():
    """A missing op is False (a build from before it was added), never an error at import."""
    assert not _backend.extension_has_op("an_op_no_build_has")
    if _backend.extension_status()[0] is not None:
        assert _backend.extension_has_op("tree_metadata")
        # an argument a newer build added: an older build's op lacks it, and its callers must not call it with it
        assert _backend.extension_has_op("skinny_linear_pack", arguments=("bf16",))
        assert not _backend.extension_has_op("skinny_linear_pack", arguments=("bf16", "an_argument_no_build_has"))
        # an op defined with its one function has no CPU kernel of its own: any dispatch key then
        assert _backend.extension_has_op("skinny_linear_version", dispatch_key=None)


@pytest.mark.skipif(not sys.platform.startswith("linux") or shutil.which("objdump") is None, reason="needs objdump")
def test_the_extension_uses_the_shared_libstdcxx():
    """A built extension itself needs libstdc++.so (not only through torch's libraries) rather than carrying its
    own copy: a toolchain that linked it statically (the H200 image's) made the extension's error messages come
    out truncated or crash."""
    module = _backend.extension_status()[0]
    if module is None:
        pytest.skip("the extension is not built")
    header = subprocess.run(["objdump", "-p", module.__file__], capture_output=True, text=True, timeout=60).stdout
    needed = [line.split()[-1] for line in header.splitlines() if line.strip().startswith("NEEDED")]
    assert any(name.startswith("libstdc++.so") for name in needed), needed


def test_info_lists_every_backend():
    result = run_python("from specdec.cli import main; main(['info'])")
    assert result.returncode == 0, result.stderr
    for name in ("triton (GPU)", "triton interpreter (CPU)", "extension specdec._C (CPU)", "pytorch reference"):
        assert name in result.stdout


def test_dispatch_rules(monkeypatch):
    cpu = torch.zeros(1)
    with use_backend("torch"):
        assert _backend.select_backend(cpu) == "torch"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with use_backend("auto"):
        assert _backend.select_backend(cpu) == "torch"
    if _backend.triton_status()[0]:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        with use_backend("auto"):
            assert _backend.select_backend(cpu) == "triton"


def test_forcing_triton_on_cpu_without_interpreter_is_explained(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    if not _backend.triton_status()[0]:
        pytest.skip("triton is not installed")
    with use_backend("triton"), pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        _backend.select_backend(torch.zeros(1))


def test_bad_backend_name_is_refused(monkeypatch):
    with pytest.raises(ValueError, match="backend must be one of"):
        with use_backend("cuda"):
            pass
    monkeypatch.setenv("SPECDEC_BACKEND", "fast")
    monkeypatch.setattr(_backend, "_env_backend", None)  # (read once: as in a new process)
    with pytest.raises(ValueError, match="SPECDEC_BACKEND must be one of"):
        _backend.forced_backend()


def test_backend_variable_is_read_once(monkeypatch):
    monkeypatch.setattr(_backend, "_env_backend", None)
    monkeypatch.setenv("SPECDEC_BACKEND", "torch")
    assert _backend.forced_backend() == "torch"
    monkeypatch.setenv("SPECDEC_BACKEND", "triton")
    assert _backend.forced_backend() == "torch"
    with use_backend("triton"):  # the context manager still switches
        assert _backend.forced_backend() == "triton"
    monkeypatch.setattr(_backend, "_env_backend", None)
    monkeypatch.delenv("SPECDEC_BACKEND")
    assert _backend.forced_backend() == "auto"


def test_package_works_without_triton():
    code = textwrap.dedent(
        """
        import importlib.abc, sys

        class HideTriton(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name == "triton" or name.startswith("triton."):
                    raise ImportError("triton hidden by the test")
                return None

        sys.meta_path.insert(0, HideTriton())
        import torch
        from specdec import _backend
        from specdec.kernels import SamplingParams, sample
        assert _backend.select_backend(torch.zeros(1)) == "torch"
        tokens, invalid = sample(torch.tensor([[0.0, 3.0, 1.0]]), SamplingParams.make(1))
        assert tokens.tolist() == [1] and invalid.tolist() == [False]
        """
    )
    result = run_python(code, TRITON_INTERPRET="1")
    assert result.returncode == 0, result.stderr


def test_an_old_triton_is_refused_with_both_versions_named():
    # triton reporting 3.5.1: the kernels are refused at import, with a warning naming the installed and the
    # required version; forcing them raises that message; the ops run their PyTorch paths
    code = textwrap.dedent(
        """
        import warnings
        import triton
        triton.__version__ = "3.5.1"
        import torch
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            from specdec import _backend, use_backend
            from specdec.kernels import SamplingParams, rms_norm, sample
        messages = [str(w.message) for w in caught]
        assert any("triton 3.5.1 is installed" in m and "triton >= 3.6" in m for m in messages), messages
        assert _backend.select_backend(torch.zeros(1)) == "torch"
        try:
            with use_backend("triton"):
                _backend.select_backend(torch.zeros(1))
        except RuntimeError as exc:
            assert "triton 3.5.1 is installed" in str(exc) and ">= 3.6" in str(exc), exc
        else:
            raise AssertionError("forcing an old triton was accepted")
        tokens, invalid = sample(torch.tensor([[0.0, 3.0, 1.0]]), SamplingParams.make(1))
        assert tokens.tolist() == [1] and invalid.tolist() == [False]
        x = torch.randn(2, 8)
        assert torch.allclose(rms_norm(x, torch.ones(8), 1e-6), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
        from specdec.cli import main
        main(["info"])
        """
    )
    result = run_python(code, TRITON_INTERPRET="1")
    assert result.returncode == 0, result.stderr
    assert "triton 3.5.1 is installed but specdec's kernels need triton >= 3.6" in result.stdout


@pytest.mark.parametrize(
    "version, expected", [("3.6.0", (3, 6)), ("3.9.0+git1a2b", (3, 9)), ("3.10.1", (3, 10)), ("dev", (0, 0))]
)
def test_triton_version_parsing(version, expected):
    assert _backend.version_tuple(version) == expected
