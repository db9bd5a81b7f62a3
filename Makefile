# dockrl: the two commands of the README, plus lint.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

export RAY_AUTH_MODE ?= disabled
export TOKENIZERS_PARALLELISM ?= false

.PHONY: demo test test-fast test-slow test-faults lint format venv clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(BIN)/dockrl demo --out runs/demo

test: $(STAMP)
	$(BIN)/python -m pytest -q -x --durations=15

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -x -m unit

test-slow: $(STAMP)
	$(BIN)/python -m pytest -q -x -m slow

test-faults: $(STAMP)
	$(BIN)/python -m pytest -q -x -m faults tests/test_faults.py

lint: $(STAMP)
	$(BIN)/ruff check src tests
	$(BIN)/ruff format --check src tests
	$(BIN)/mypy

format: $(STAMP)
	$(BIN)/ruff format src tests
	$(BIN)/ruff check --fix src tests

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
