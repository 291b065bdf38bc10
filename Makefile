# Quick start: `make demo` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
PYTEST_ARGS ?=
SHELL  := /bin/bash
.SHELLFLAGS := -o pipefail -c
# pip warns once per absent mirror folder; keep its real messages only.
QUIET_PIP := { grep -v "^WARNING: Location" || true; }

.PHONY: setup test demo clean-venv

setup: $(STAMP)

# Re-installs when the dependency list or the torch pair changes.
$(STAMP): pyproject.toml constraints.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "installing dmltrain and its dependencies into $(VENV) (first time: a few minutes)"
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[dev]' 2>&1 | $(QUIET_PIP)
	@touch $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

demo: $(STAMP)
	$(BIN)/dmltrain train configs/demo.yaml

clean-venv:
	rm -rf $(VENV)
