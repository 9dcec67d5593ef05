# Every target creates .venv on first use and installs policyd with its dev
# extra into it, so a fresh clone needs nothing installed by hand.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test lint typecheck unit bench install clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
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

## Every benchmark script in turn; each prints its figures as ratios to a baseline.
bench: $(STAMP)
	set -e; for script in benchmarks/*.py; do echo "== $$script"; $(BIN)/python $$script; done

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
