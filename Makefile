# Every target creates .venv on first use and installs into it exactly the
# versions of the lock file (policyd's dependencies with its dev extra, each
# checked against its hash), then policyd itself, so a fresh clone needs nothing
# installed by hand and installs what CI installs (docs/development.md).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
LOCK := requirements-dev.lock
# The machines policyd is installed on (CI's, the image's): Linux x86_64, Python 3.11.
LOCK_FLAGS := --generate-hashes --python-version 3.11 --python-platform x86_64-manylinux_2_31 \
	--no-emit-package policyd --custom-compile-command 'make lock' --quiet

.PHONY: demo test lint typecheck unit bench install lock clean test-real

$(STAMP): pyproject.toml $(LOCK)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet --require-hashes -r $(LOCK)
	$(BIN)/python -m pip install --quiet --no-deps -e .
	# xds-protos ships an old copy of the OpenTelemetry protos in the same files as
	# opentelemetry-proto; the OTLP exporters need opentelemetry-proto's, so it goes last
	# (the lock's version and hashes, as a constraint).
	$(BIN)/python -m pip install --quiet --force-reinstall --no-deps -c $(LOCK) opentelemetry-proto
	# A lock older than a change of pyproject.toml's dependencies fails here: run `make lock`.
	$(BIN)/python -m pip check
	touch $(STAMP)

install: $(STAMP)

## Rewrites both lock files from pyproject.toml, keeping each pinned version that still
## fits (`make lock UPGRADE=1`: the newest that fit). requirements.lock, the image's, is
## the runtime part of requirements-dev.lock with the tokenizers extra, at the same
## versions. It needs only uv, not an installed policyd: after a change of
## pyproject.toml's dependencies `make install` refuses the old lock until this has run.
lock:
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	test -x $(BIN)/uv || $(BIN)/python -m pip install --quiet \
		"$$(grep -m1 -o '^uv==[^ ]*' $(LOCK))"
	$(BIN)/uv pip compile pyproject.toml --extra dev $(LOCK_FLAGS) $(if $(UPGRADE),--upgrade) \
		--output-file $(LOCK)
	$(BIN)/uv pip compile pyproject.toml --extra tokenizers $(LOCK_FLAGS) --constraint $(LOCK) \
		--output-file requirements.lock

## The main job on an embedded default: Envoy + policyd + a simulated pool.
demo: $(STAMP)
	$(BIN)/policyd demo

## The whole suite: lint, types, then every test (Envoy end-to-end included).
test: lint typecheck unit

lint: $(STAMP)
	$(BIN)/ruff check policyd tests benchmarks
	$(BIN)/ruff format --check policyd tests benchmarks

typecheck: $(STAMP)
	$(BIN)/mypy

unit: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

## Checks against the real programs (tests/real: jaeger, istioctl, etcd + kube-apiserver, helm,
## kustomize, inference-sim, pd-sidecar, built by ../shared/tools/real-tools.sh); not part of
## `make test`. A missing binary skips its tests.
test-real: $(STAMP)
	eval "$$(../shared/tools/real-tools.sh env)" && $(BIN)/python -m pytest tests/real $(PYTEST_ARGS)

## Every benchmark script in turn (a file of benchmarks/ with a main; the others are the
## pieces they share); each prints its figures as ratios to a baseline (the live
## benchmark's --quick run: its full grid takes hours, docs/benchmarks.md).
BENCH_SCRIPTS = $(filter-out benchmarks/live%,$(shell grep -l '^if __name__ == "__main__":' benchmarks/*.py))
bench: $(STAMP)
	set -e; for script in $(BENCH_SCRIPTS); do \
		echo "== $$script"; $(BIN)/python $$script; done
	cd benchmarks && ../$(BIN)/python live.py --quick --time-scale 3

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis build policyd.egg-info
