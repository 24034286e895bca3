# Developer shortcuts; CI (.ci/run) runs the same tools. Everything uses the project venv:
#   python3 -m venv .venv && .venv/bin/pip install -e ".[test]"
# (".[test,bench]" for the peer test of the slow tier, tests/test_bench_peer.py, as CI)
BIN ?= .venv/bin

.PHONY: lint test-fast test e2e bench

lint:  ## ruff, formatting, strict types for exporter/, benchmarks/ and dashboards/, relaxed for tests/
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy exporter
	$(BIN)/mypy tests
	$(BIN)/mypy benchmarks dashboards image  # scripts importing each other by name: a run of their own

test-fast:  ## the quick loop: everything but the e2e and slow tiers, one worker per core
	$(BIN)/pytest -n auto --dist loadfile -m "not e2e and not slow" --durations=10

test:  ## every test, as CI runs them: one worker per core, each file on one worker
	$(BIN)/pytest -n auto --dist loadfile

e2e:  ## the end-to-end tier: a real Prometheus against the simulated node (minutes)
	$(BIN)/pytest -m e2e

bench:  ## the performance harness (benchmarks/README.md)
	$(BIN)/python benchmarks/run.py
