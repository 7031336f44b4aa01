# The two commands of the README: `make quickstart` and `make test`. Each creates .venv if it is
# missing and installs what it needs: torch first, pinned to the CPU build that lies on disk on
# these machines (any other torch spec downloads a multi-GB CUDA build), then the project.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.slime-async-installed
TORCH_SPEC ?= torch==2.13.0

.PHONY: install test test-unit test-integration test-gpu quickstart lint format docs clean

# The test tiers (tests/README.md). The CPU tiers hide any GPU (also on a GPU machine) and run on
# JOBS pytest-xdist workers, one test file per worker at a time; `make test` (CI) is lint, then
# both CPU tiers in one pytest run. `make test-gpu` runs on a GPU machine, in the Python that
# has CUDA torch there: `make test-gpu PY=python3` for the system one.
JOBS ?= 2
CPU_TESTS := CUDA_VISIBLE_DEVICES= $(PY) -m pytest -q -n $(JOBS) --dist loadfile

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev,plot,ray]"
	touch $(STAMP)

install: $(STAMP)

test: lint
	$(CPU_TESTS) tests/unit tests/integration

test-unit: $(STAMP)
	$(CPU_TESTS) tests/unit

test-integration: $(STAMP)
	$(CPU_TESTS) tests/integration

test-gpu:
	$(PY) -m pytest -q tests/gpu -m gpu

quickstart: $(STAMP)
	$(VENV)/bin/slime-async run configs/quickstart.toml

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# Regenerates docs/configuration.md from the config fields' docstrings.
docs: $(STAMP)
	$(PY) -m slime_async.config.reference

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
