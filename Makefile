# The two commands a newcomer types: `make report` (the main job) and `make test`.
# Both bootstrap .venv from pyproject.toml on first use; the stamp makes later runs instant.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch first, pinned: on this CPU machine the CPU build lies on disk; on a CUDA machine the same
# specifier gives PyPI's CUDA build. Override with `make TORCH_SPEC='torch==X' ...`.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed
PROFILE ?=
PYTEST_ARGS ?=
# the test files spread over one pytest worker per core (pytest-xdist), each file on one worker so that its
# module fixtures (a server, a process group) start once, in the order tests/conftest.py gives (the files of minutes
# first: LONG_FIRST); PYTEST_WORKERS=0 runs them in this process
PYTEST_WORKERS ?= auto

.PHONY: help venv report test lint format lab clean-venv

help:
	@echo "make report   run the experiment pipeline into reports/ (profile from the hardware; PROFILE=smoke|cpu|gpu)"
	@echo "make test     lint, unit/kernel/parity tests, pipeline end-to-end and nbval"
	@echo "make lab      JupyterLab with the 'workbench' kernel"

venv: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check "$(TORCH_SPEC)"
	$(PY) -m pip install -q --disable-pip-version-check -e ".[dev]"
	$(PY) -m ipykernel install --sys-prefix --name workbench --display-name "Python (workbench)" >/dev/null
	@touch $(STAMP)

report: $(STAMP)
	$(VENV)/bin/workbench report $(if $(PROFILE),--profile $(PROFILE),)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# nbval re-runs every notebook under notebooks/ with its default parameters (lax: only cells marked
# NBVAL_CHECK_OUTPUT are compared); tests/test_notebooks_nbval.py fails a notebook saved without outputs.
test: lint
	MPLBACKEND=agg $(PY) -m pytest --nbval-lax --nbval-current-env --nbval-sanitize-with notebooks/nbval_sanitize.cfg \
		$(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder) $(PYTEST_ARGS) tests notebooks

# JupyterLab refuses to start as root without --allow-root (containers often run as root)
lab: $(STAMP)
	$(VENV)/bin/jupyter lab $(if $(filter 0,$(shell id -u)),--allow-root,) notebooks/

clean-venv:
	rm -rf $(VENV)
