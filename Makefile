# Two commands for a newcomer:
#   make demo   set up .venv and run a short attention demo on the available device
#   make test   set up .venv and run ruff and the CPU test suite (TEST_WORKERS processes)
#   make docs   set up .venv and build the docs site into site/ (mkdocs, strict: a broken link fails)
#
# The venv pins the CPU test stack: torch 2.13.0 (CPU build) and triton 3.6.0, the lowest triton the
# kernels support (pyproject claims torch >= 2.11; the GPU suite runs on torch 2.11 + triton 3.6, see
# scripts/gpu_check.sh). Triton 3.6's interpreter needs numpy < 2.4.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.flashtile-installed
TORCH  ?= 2.13.0
TRITON ?= 3.6.0
# pytest-xdist workers: the interpreter's tests are CPU-bound and CI has 2 cores; each worker imports its own torch
TEST_WORKERS ?= 2

.PHONY: demo test lint docs gpu-check clean

# docs/requirements.txt: the docs tools, for make docs and for tests/test_docs_build.py (make test builds the site)
$(STAMP): pyproject.toml docs/requirements.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==$(TORCH) triton==$(TRITON) "numpy<2.4" "setuptools>=77" \
		pytest pytest-xdist ruff einops "transformers>=5.0"
	$(PY) -m pip install --quiet -r docs/requirements.txt
	$(PY) -m pip install --quiet --no-deps --no-build-isolation -e .
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/demo.py

test: $(STAMP)
	$(PY) -m ruff check src tests examples scripts
	$(PY) -m pytest -q -n $(TEST_WORKERS) -m "not gpu" tests

# the site: MkDocs + Material; --strict turns a broken link, a missing snippet or a bad docstring into an error
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict -d site

lint: $(STAMP)
	$(PY) -m ruff check src tests examples scripts

# On a GPU machine (torch and triton preinstalled): the GPU tests and benchmarks, see scripts/gpu_check.sh
gpu-check:
	bash scripts/gpu_check.sh

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache site
