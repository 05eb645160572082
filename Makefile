# pdserve: `make demo` and `make test` work on a fresh machine with only Python.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
TORCH  := torch==2.13.0

.PHONY: venv test test-fast lint format demo clean

venv: $(STAMP)

# torch first (a CPU build lies on this machine's disk), so nothing drags in a CUDA build.
# nixl is optional: installed where the platform has wheels, skipped elsewhere.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH)
	$(PIP) install -q -e '.[test,ray]'
	-$(PIP) install -q 'nixl-cu12>=0.7' || echo "nixl not installed: the tcp transport still works"
	touch $(STAMP)

test: venv
	$(PY) -m ruff check pdserve tests scripts
	$(PY) -m pytest -q -ra --durations=15

test-fast: venv
	$(PY) -m pytest -q -m "not slow"

lint: venv
	$(PY) -m ruff check pdserve tests scripts
	$(PY) -m ruff format --check pdserve tests scripts

format: venv
	$(PY) -m ruff format pdserve tests scripts
	$(PY) -m ruff check --fix pdserve tests scripts

demo: venv
	$(PY) -m pdserve.demo

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
