# tensorrpc developer targets. `make test` and `make demo` each build .venv when missing.
# The editable install maps the name `tensorrpc` alone (tests, bench and examples resolve
# from the working directory: run the targets from the repository root); mypy, run from
# here, reads the sources directly. See CONTRIBUTING.md, "Editable installs".
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PIP_FLAGS := --disable-pip-version-check -q

.PHONY: all install test lint format check demo bench soak docs docs-serve dist clean test-gpu test-thorough

all: test

$(STAMP): pyproject.toml constraints.txt
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install $(PIP_FLAGS) --upgrade pip
	$(BIN)/python -m pip install $(PIP_FLAGS) -c constraints.txt -e '.[dev,bench,ray]'
	@touch $(STAMP)

install: $(STAMP)

lint: $(STAMP)
	$(BIN)/ruff format --check tensorrpc tests bench examples
	$(BIN)/ruff check tensorrpc tests bench examples

format: $(STAMP)
	$(BIN)/ruff format tensorrpc tests bench examples
	$(BIN)/ruff check --fix tensorrpc tests bench examples

check: lint
	$(BIN)/mypy

# The suite in worker processes (pytest-xdist; tests/_xdist.py groups and orders the
# tests). `make test WORKERS=0` runs it serially, in this process.
WORKERS ?= 3
# Bytecode caches on (__pycache__/, ignored by git) even where the environment turns them
# off: each worker would otherwise recompile every test module it rewrites for pytest,
# and each test's fresh interpreter the whole package (about 25 s of CPU per run on a
# 2-core machine).
PYTEST := PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest

test: check
	$(PYTEST) -n $(WORKERS)

# Every hypothesis example the tests ask for (`make test` makes a quarter; tests/conftest.py).
test-thorough: check
	TENSORRPC_HYPOTHESIS=thorough $(PYTEST) -n $(WORKERS)

test-gpu: $(STAMP)
	$(PYTEST) -m gpu

demo: $(STAMP)
	$(BIN)/python -m examples.multi_engine_demo

# The benchmark's optional peers (the bench-ray extra: Ray Serve) on a stamp of their own,
# so that `make test` does not install them.
BENCH_STAMP := $(VENV)/.installed-bench-ray

$(BENCH_STAMP): $(STAMP)
	$(BIN)/python -m pip install $(PIP_FLAGS) -c constraints.txt -e '.[dev,bench,ray,bench-ray]'
	@touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	$(BIN)/python -m bench

soak: $(STAMP)
	$(BIN)/python -m bench.soak

docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict

# The site with working links and search at http://127.0.0.1:8000/ (rebuilt on edits).
docs-serve: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve --strict --dev-addr 127.0.0.1:8000

# Wheel and sdist into dist/, built in a venv of their own that holds only the build
# front end and the backend named in pyproject.toml's [build-system] (about 10 MB and
# seconds), not the development environment.
DIST_VENV := .venv-dist
DIST_STAMP := $(DIST_VENV)/.installed

$(DIST_STAMP): pyproject.toml
	@test -x $(DIST_VENV)/bin/python || $(PYTHON) -m venv $(DIST_VENV)
	$(DIST_VENV)/bin/python -m pip install $(PIP_FLAGS) build 'setuptools>=77'
	@touch $(DIST_STAMP)

dist: $(DIST_STAMP)
	$(DIST_VENV)/bin/python -m build --no-isolation --outdir dist

clean:
	rm -rf $(VENV) $(DIST_VENV) build dist site *.egg-info .mypy_cache .ruff_cache .pytest_cache
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
