# ddlscale developer targets. `make help` lists them.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
ARGS ?=

.PHONY: help setup train test test-quick test-slow lint experiments experiments-quick clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-12s %s\n", $$1, $$2}'

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# The CPU build of torch first: a bare `torch` requirement would pull a multi-GB CUDA build.
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[dev,wandb,slurm,etcd,storage,sweep]'
	touch $@

setup: $(BIN)/.installed  ## create .venv: torch 2.13.0 (CPU), then ddlscale with its dev extras (etcd's, the storage machine's and SLURM's servers: see .ci/run)

train: setup  ## run the default job (ARGS="model=deepfm trainer.devices=3" to override)
	$(BIN)/python train.py $(ARGS)

test: setup  ## the test suite (slow tests excluded)
	@echo "make test: about 15 minutes on 2 quiet cores (19.4 before 17 more tests moved to make test-slow; longer on a busy host); make test-quick is the first check in minutes"
	$(BIN)/python -m pytest -q

test-quick: setup  ## the in-process tests only (no worker processes, no train.py runs): a first check in minutes
	$(BIN)/python -m pytest -q -m 'not slow and not multiprocess and not e2e'

test-slow: setup  ## only the slow tests
	$(BIN)/python -m pytest -q -m slow

lint: setup  ## ruff
	$(BIN)/ruff check .

experiments: setup  ## regenerate every claim of experiments/README.md, in order (hours, root; QUICK=1: the reduced run)
	$(BIN)/python -m experiments.harness $(if $(QUICK),--quick)

experiments-quick: setup  ## the same commands with fewer reps/steps/cells, into experiments/results-quick (~21 min)
	$(BIN)/python -m experiments.harness --quick

clean:  ## remove run outputs and caches (keeps .venv)
	rm -rf outputs multirun lightning_logs .pytest_cache .ruff_cache
