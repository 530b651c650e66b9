PY ?= python3

.PHONY: setup up test unit lint bench

setup:
	bash scripts/setup.sh

up: setup
	splitserve up

test: setup
	$(PY) -m pytest -q --durations=25 tests

unit:
	$(PY) -m pytest -q tests/unit

lint:
	$(PY) -m ruff check engine services kvtransfer tests benchmarks
	$(PY) -m mypy engine services kvtransfer benchmarks

bench: setup
	splitserve bench offline
