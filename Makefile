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

.PHONY: demo test lint install install-test clean

demo: install
	$(PY) -m specdec demo

test: install-test lint
	$(PY) -m pytest -q -n $(TEST_JOBS) tests
	# every docstring example in the package runs as written (PyTorch path on the CPU)
	$(PY) -m pytest -q --doctest-modules specdec
	# again without the compiled extension: every op must fall back to its PyTorch path
	SPECDEC_DISABLE_EXTENSION=1 $(PY) -m pytest -q -n $(TEST_JOBS) tests/test_tree_metadata.py tests/test_engine.py -k "not exact"

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
	rm -rf $(VENV) build *.egg-info specdec/*.so
