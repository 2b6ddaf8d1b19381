# Two commands for a newcomer:
#   make demo   set up .venv and run a short attention demo on the available device
#   make test   set up .venv (CPU torch 2.13.0, triton 3.6.0) and run the CPU test suite
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.flashtile-installed

.PHONY: demo test lint gpu-check clean

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0 triton==3.6.0 "numpy<2.4" pytest ruff einops "transformers>=5.0"
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

test: $(STAMP)
	$(PY) -m ruff check src tests examples scripts
	$(PY) -m pytest -q -m "not gpu" tests

lint: $(STAMP)
	$(PY) -m ruff check src tests examples scripts

# On the H200 machine (torch/triton preinstalled there, no network): see scripts/gpu_check.sh
gpu-check:
	bash scripts/gpu_check.sh

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
