# shardless: `make demo` and `make test` set up everything they need on a machine with
# Python 3.11+, Java 17+ and Node 18+.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
TOOLS := .tools
STAMP_PY := $(VENV)/.installed
STAMP_NODE := $(TOOLS)/.installed
PYTEST_ARGS ?=

.PHONY: setup demo test test-fast lint bench clean

setup: $(STAMP_PY) $(STAMP_NODE)

$(STAMP_PY): pyproject.toml
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "Python 3.11+ is required, found " + sys.version' 
	@command -v java >/dev/null || { echo "Java 17+ is required (java not found on PATH)"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $@

$(STAMP_NODE): package.json package-lock.json
	@command -v node >/dev/null || { echo "Node 18+ is required (node not found on PATH)"; exit 1; }
	mkdir -p $(TOOLS)
	cp package.json package-lock.json $(TOOLS)/
	cd $(TOOLS) && npm ci --no-audit --no-fund --loglevel=error
	touch $@

demo: setup
	$(PY) -m processor.demo

test: setup
	$(PY) -m ruff check .
	$(PY) -m pytest $(PYTEST_ARGS)

test-fast: setup
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

STAMP_BENCH := $(VENV)/.installed-bench

$(STAMP_BENCH): $(STAMP_PY)
	$(PY) -m pip install --quiet -e '.[dev,bench]'
	touch $@

# Every benchmark in bench/, each writing its JSON under bench/results/ (vs_spark: 25-45 min,
# faults: ~75 min).
bench: setup $(STAMP_BENCH)
	$(PY) -m bench.state_loop --json > bench/results/state_loop.json
	$(PY) -m bench.restore --json > bench/results/restore.json
	$(PY) -m bench.source --json > bench/results/source.json
	$(PY) -m bench.faults --schedules 30 --seed 7 --json > bench/results/faults.json
	$(PY) -m bench.head_items --json > bench/results/head_items.json
	$(PY) -m bench.commit_latency --json > bench/results/commit_latency.json
	$(PY) -m bench.store_reads --json > bench/results/store_reads.json
	$(PY) -m bench.vs_spark --json > bench/results/vs_spark.json
	$(PY) -m bench.chart bench/results/vs_spark.json bench/results/vs_spark.png

clean:
	rm -rf $(VENV) $(TOOLS) .pytest_cache .hypothesis *.egg-info
