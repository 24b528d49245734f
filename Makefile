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
	@echo "make chaos  - set up, run the fault harness on a 3-node cluster (leaders killed, a node frozen, restarts) in both modes; SOAK=30: a 30-minute soak a mode, a fault every minute"
	@echo "make screenshot - the demo's load in Prometheus's web UI, as docs/prometheus-demo.png (needs chromium)"
	@echo "make setup  - create .venv, install llmq into it, fetch the Kafka jars and promtool (cached)"

setup: $(VENV)/.installed
	@$(LLMQ) broker fetch
	@bash deploy/tools/fetch-prometheus.sh > $(VENV)/.prometheus-bin

$(VENV)/.installed: pyproject.toml setup.py
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	@touch $@

demo: setup
	$(LLMQ) demo

# promtool and prometheus (Debian's package, unpacked into the cache) go first on PATH.
WITH_PROM = PATH="$$(cat $(VENV)/.prometheus-bin):$$PATH"

# A real llama.cpp server (llama-cpp-python) for the model tests: built once into the wheel
# cache (~/.cache/llmq/wheels; minutes on two cores), installed from it in seconds after that.
.PHONY: llama
llama: setup
	$(BIN)/python -m tests.llama.install

test: setup llama
	$(WITH_PROM) $(BIN)/python -m pytest tests

unit: setup
	$(WITH_PROM) $(BIN)/python -m pytest tests/unit

integration: setup llama
	$(WITH_PROM) $(BIN)/python -m pytest tests/integration

bench: setup
	$(BIN)/python bench/run.py
	$(BIN)/python bench/charts.py
	$(BIN)/python bench/capacity.py

# Fault harness on a three-node cluster: partition leaders SIGKILLed, a node frozen, the cluster
# restarted, a worker killed and one frozen, calls longer than max.poll.interval.ms, with gateways,
# SDK and serve traffic, in both delivery modes; writes bench/chaos.json (about 15 minutes).
# SOAK=MINUTES: that long a mode instead, with a fault every minute (bench/chaos.py --soak).
.PHONY: chaos
chaos: setup
	$(BIN)/python bench/chaos.py $(if $(SOAK),--soak $(SOAK))

# docs/prometheus-demo.png: the real stack under the demo's load in Prometheus's web UI, taken with
# headless Debian chromium (apt-get install chromium); about two minutes.
.PHONY: screenshot
screenshot: setup
	$(WITH_PROM) $(BIN)/python deploy/tools/screenshot.py

# Mutation fuzzer over the worker's admission path (no broker); writes bench/fuzz.json.
.PHONY: fuzz
fuzz: setup
	$(BIN)/python bench/fuzz.py

broker-up: setup
	$(LLMQ) broker up

broker-down:
	$(LLMQ) broker down

clean:
	-$(LLMQ) broker down
	rm -rf $(VENV) .llmq .pytest_cache .hypothesis *.egg-info
