# Two commands for a newcomer:
#   make demo   set up .venv and run a short attention demo on the available device
#   make test   set up .venv (CPU torch 2.13.0, triton 3.6.0) and run the CPU test suite (TEST_WORKERS=2 processes)
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.flashtile-installed
# pytest-xdist workers for the CPU suite: the interpreter's tests are CPU-bound, and CI has 2 cores (1203 tests in
# 465 s on 2 workers against 793 s on one, session 30); each worker imports its own torch
TEST_WORKERS ?= 2

.PHONY: demo test lint gpu-check clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0 triton==3.6.0 "numpy<2.4" pytest pytest-xdist ruff einops "transformers>=5.0"
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

test: $(STAMP)
	$(PY) -m ruff check src tests examples scripts
	$(PY) -m pytest -q -n $(TEST_WORKERS) -m "not gpu" tests

lint: $(STAMP)
	$(PY) -m ruff check src tests examples scripts

# On the H200 machine (torch/triton preinstalled there, no network): see scripts/gpu_check.sh
gpu-check:
	bash scripts/gpu_check.sh

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
