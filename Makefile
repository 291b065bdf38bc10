# Quick start: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
# The remote-shard tests' moto and s3fs: beside site-packages, not in it (tests/s3_stack.py says why).
S3_STACK := $(VENV)/test-s3
PYTEST_ARGS ?=
SHELL  := /bin/bash
.SHELLFLAGS := -o pipefail -c
# pip warns once per absent mirror folder; keep its real messages only.
QUIET_PIP := { grep -v "^WARNING: Location" || true; }

.PHONY: setup lint format test demo clean-venv gpu-check

setup: $(STAMP) $(S3_STACK)/.installed

# Re-installs when the dependency list or the torch pair changes.
$(STAMP): pyproject.toml constraints.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "installing dmltrain and its dependencies into $(VENV) (first time: a few minutes)"
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[dev]' 2>&1 | $(QUIET_PIP)
	@touch $(STAMP)

# After every install into .venv, which may change what the stack has to add.
$(S3_STACK)/.installed: $(STAMP) tests/s3_stack.py
	@echo "installing the S3 test stack (moto, s3fs) into $(S3_STACK)"
	env -u PYTHONPATH $(BIN)/python tests/s3_stack.py $(S3_STACK) 2>&1 | $(QUIET_PIP)
	@touch $@

# ruff's lint and format check (pyproject.toml's [tool.ruff]); `make test` runs it first, so CI fails on either.
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

test: lint $(STAMP) $(S3_STACK)/.installed
	$(BIN)/python -m pytest $(PYTEST_ARGS)

demo: $(STAMP)
	$(BIN)/dmltrain train configs/demo.yaml

# On one GPU node, every GPU path in one call, at most 8 minutes: doctor, `pytest -m cuda`, the classifier,
# train and eval benches; one table, also as JSON (dmltrain/gpu_check.py). It needs no .venv and never makes
# one: without .venv it runs python3 from PATH, e.g. on a GPU machine that has only PyTorch with
# ../shared/device/bundle's .device/ activated. PY picks another Python; GPU_CHECK_ARGS="--out DIR" and more
# go to it (python -m dmltrain.gpu_check --help).
PY ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)
GPU_CHECK_ARGS ?=
gpu-check:
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(PY) -m dmltrain.gpu_check $(GPU_CHECK_ARGS)

clean-venv:
	rm -rf $(VENV)
