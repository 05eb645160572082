"""tests/vllm: PdserveConnector inside real vLLM servers. Needs the .venv-vllm interpreter.

Run with `make test` (it builds .venv-vllm when missing) or
`.venv-vllm/bin/python -m pytest -o addopts= tests/vllm`. Under any interpreter without
vLLM every test here is skipped, with the reason.
"""

from __future__ import annotations

import importlib.util

import pytest

HAS_VLLM = importlib.util.find_spec("vllm") is not None
SKIP_REASON = (
    "vLLM is not installed in this interpreter: build it with `make venv-vllm` and run "
    "`.venv-vllm/bin/python -m pytest -o addopts= tests/vllm`"
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/vllm/" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.vllm)
            item.add_marker(pytest.mark.slow)
            if not HAS_VLLM:
                item.add_marker(pytest.mark.skip(reason=SKIP_REASON))
