# Two commands on a fresh machine: `make demo` and `make test`. Both set up first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
LLMQ   := $(BIN)/llmq

.PHONY: setup demo test unit integration bench broker-up broker-down clean help

help:
	@echo "make demo   - set up, start a local Kafka, run workers and a mixed load, print a summary"
	@echo "make test   - set up, then the whole test suite (starts and stops its own broker)"
	@echo "make bench  - set up, run the benchmark scenarios, write bench/results.json"
	@echo "make setup  - create .venv, install llmq into it, fetch the Kafka jars (cached)"

setup: $(VENV)/.installed
	@$(LLMQ) broker fetch

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	@touch $@

demo: setup
	$(LLMQ) demo

test: setup
	$(BIN)/python -m pytest tests

unit: setup
	$(BIN)/python -m pytest tests/unit

integration: setup
	$(BIN)/python -m pytest tests/integration

bench: setup
	$(BIN)/python bench/run.py

broker-up: setup
	$(LLMQ) broker up

broker-down:
	$(LLMQ) broker down

clean:
	-$(LLMQ) broker down
	rm -rf $(VENV) .llmq .pytest_cache .hypothesis *.egg-info
