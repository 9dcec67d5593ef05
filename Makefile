# Every target creates .venv on first use and installs policyd with its dev
# extra into it, so a fresh clone needs nothing installed by hand.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint typecheck unit bench install clean test-real

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	# xds-protos ships an old copy of the OpenTelemetry protos in the same files as
	# opentelemetry-proto; the OTLP exporters need opentelemetry-proto's, so it goes last.
	$(BIN)/python -m pip install --quiet --force-reinstall --no-deps \
		"opentelemetry-proto==$$($(BIN)/python -c 'from importlib.metadata import version; print(version("opentelemetry-proto"))')"
	touch $(STAMP)

install: $(STAMP)

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

## Checks against the real programs (tests/real: jaeger, istioctl, etcd + kube-apiserver,
## built by ../shared/tools/real-tools.sh); not part of `make test`. A missing binary skips its tests.
test-real: $(STAMP)
	eval "$$(../shared/tools/real-tools.sh env)" && $(BIN)/python -m pytest tests/real $(PYTEST_ARGS)

## Every benchmark script in turn; each prints its figures as ratios to a baseline.
bench: $(STAMP)
	set -e; for script in benchmarks/*.py; do echo "== $$script"; $(BIN)/python $$script; done

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis build policyd.egg-info
