PY ?= python3

.PHONY: setup up test unit lint bench flaky

setup:
	bash scripts/setup.sh

up: setup
	splitserve up

test: setup
	$(PY) -m pytest -q --durations=25 tests

# The fault and timing-sensitive modules FLAKY_RUNS times (default 20), with a
# per-test failure count at the end (FLAKY_TESTS: other pytest arguments).
flaky:
	$(PY) scripts/flaky.py

unit:
	$(PY) -m pytest -q tests/unit

lint:
	$(PY) -m ruff check engine services kvtransfer tests benchmarks
	$(PY) -m mypy engine services kvtransfer benchmarks
	lint-imports --no-cache  # the import rules of docs/ARCHITECTURE.md (pyproject.toml)

bench: setup
	splitserve bench offline
