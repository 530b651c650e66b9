PY ?= python3

.PHONY: setup up test unit lint bench flaky

setup:
	bash scripts/setup.sh

up: setup
	splitserve up

# The suite in two parts: all but the timing-sensitive tests on two pytest
# workers (each module whole on one), then those (tests/timing_sensitive.py)
# alone, one at a time.  Both parts always run; either failing fails the target.
test: setup
	$(PY) -m pytest -q --durations=15 -m "not serial" -n 2 --dist loadfile tests; a=$$?; \
	$(PY) -m pytest -q --durations=15 -m serial $$($(PY) -m tests.timing_sensitive); b=$$?; \
	test $$a -eq 0 && test $$b -eq 0

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
