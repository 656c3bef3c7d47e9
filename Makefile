# The two commands of the README: `make run` (the platform) and `make test` (the suite).
# Both create the venv with uv when it is missing, installing uv with pip if needed.
SHELL := /bin/bash
PYTHON ?= python3
UV := $(shell command -v uv 2>/dev/null || echo "$(PYTHON) -m uv")
VENV := .venv
# make test: two pytest workers on the 2 cores (tests/conftest.py groups the units; 0 runs serially)
TEST_WORKERS ?= 2
export PYSPARK_PYTHON := $(CURDIR)/$(VENV)/bin/python
export PYSPARK_DRIVER_PYTHON := $(CURDIR)/$(VENV)/bin/python
export SPARK_LOCAL_IP := 127.0.0.1
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: run test venv lint bench docs clean

venv: $(VENV)/.synced

$(VENV)/.synced: pyproject.toml uv.lock
	@command -v uv >/dev/null 2>&1 || $(PYTHON) -m uv --version >/dev/null 2>&1 || \
		{ echo "installing uv with pip"; $(PYTHON) -m pip install --quiet uv; }
	$(UV) sync --frozen
	@touch $@

# RUN_ARGS: e.g. RUN_ARGS="--port 8081 --rate 500" (see .venv/bin/isbflow platform up --help)
run: venv
	$(VENV)/bin/isbflow platform up $(RUN_ARGS)

test: venv
	@scripts/ensure-chromium
	@scripts/ensure-postgres
	@scripts/ensure-redis
	$(VENV)/bin/lint-imports
	$(VENV)/bin/python -m pytest -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder $(PYTEST_ARGS)

# ruff, and the layering contract in pyproject.toml (an upward import fails naming both modules)
lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports

bench: venv
	$(VENV)/bin/python bench/throughput.py

# the docs site (mkdocs.yml, docs/) on http://127.0.0.1:8000; tests/test_docs.py builds it --strict
docs: venv
	$(VENV)/bin/mkdocs serve -a 127.0.0.1:8000

clean:
	rm -rf .isbflow bench/results/*.json
