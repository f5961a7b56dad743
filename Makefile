# Set-up is `make demo` or `make test` on a fresh machine: each builds .venv first.
PYTHON ?= python3
TORCH_VERSION ?= 2.13.0
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(TORCH_VERSION)

.PHONY: install test unit lint typecheck demo bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# Pin torch first: an unpinned torch pulls a multi-GB CUDA build.
	$(PY) -m pip install --quiet "torch==$(TORCH_VERSION)"
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $@

test: install lint typecheck unit

unit: install
	FTCOMM_DEBUG=1 $(PY) -m pytest -q

lint: install
	$(PY) -m ruff check ftcomm tests examples
	$(PY) -m ruff format --check ftcomm tests examples

typecheck: install
	$(PY) -m mypy

demo: install
	$(PY) examples/recover_from_dead_rank.py

bench: install
	$(PY) -m ftcomm bench

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache .hypothesis
