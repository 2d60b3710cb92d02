# One entry point for every set-up step: a fresh machine needs only `make run` or `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install browser run test lint typecheck pytest bench demo soak clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch==2.13.0 is pinned in the `transformers` extra: pip takes the machine's local CPU build.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[test,transformers]'
	touch $(STAMP)

install: $(STAMP)

# The status-page test drives a real headless browser: Debian's chromium (no browser download).
browser:
	@command -v chromium >/dev/null || (apt-get update -qq && apt-get install -y -qq chromium >/dev/null)

run: install
	$(BIN)/kvtier serve

lint: install
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

typecheck: install
	$(BIN)/mypy

pytest: install browser
	$(BIN)/python -m pytest -q

test: lint typecheck pytest

bench: install
	$(BIN)/python -m benchmarks.run --output docs/benchmarks.md

demo: install
	$(BIN)/kvtier demo

# A bounded chaos run (issue 10): verified load while clients, the server, Redis and the disk
# misbehave. Minutes long and mounts a tmpfs (needs root), so not part of `make test`.
soak: install
	$(BIN)/python -m benchmarks.soak --duration 120 --json soak.json

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
