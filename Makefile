# The two commands of the README: `make quickstart` and `make test`. Each creates .venv if it is
# missing and installs what it needs: torch first, pinned to the CPU build that lies on disk on
# these machines (any other torch spec downloads a multi-GB CUDA build), then the project.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.slime-async-installed
TORCH_SPEC ?= torch==2.13.0

.PHONY: install test test-all quickstart bench lint format clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[dev,plot,ray]"
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -m "not gpu" -q -n 2 --dist loadfile

quickstart: $(STAMP)
	$(VENV)/bin/slime-async run configs/quickstart.toml

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: $(STAMP)
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
