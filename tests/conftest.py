"""Suite-wide test settings.

Hypothesis: no per-example deadline and no "too slow" health check. Both are wall-clock
limits (200 ms per example, about a second to generate data) that a loaded CI machine (2
cores shared with several server processes) misses now and then, which fails a property
test that found no counterexample. A hang is still caught by pytest-timeout. Tests that
set their own `@settings` keep every other default; this profile only changes these two.
"""

from __future__ import annotations

import ast
import multiprocessing.process
import os
import subprocess
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("pdserve", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("pdserve")


# The unit tier (`make test-fast`): every test that starts no process. A test module that
# imports one of these starts processes (or drives a helper that does), so its tests get the
# `process` marker here; a test elsewhere that starts one anyway fails in the unit tier (the
# guard below), so the marker cannot silently go stale. Servers on threads are allowed.
PROCESS_IMPORTS = frozenset(
    {"subprocess", "multiprocessing", "procs", "transport_peer", "pdserve.engine.core_client"}
)
UNIT_TIER_ENV = "PDSERVE_UNIT_TIER"  # set by `make test-fast`: turns the guard on


def _imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def _starts_processes(path: Path, cache: dict[Path, bool]) -> bool:
    if path not in cache:
        imported = _imported_modules(path)
        cache[path] = any(
            name == root or name.startswith(root + ".")
            for name in imported
            for root in PROCESS_IMPORTS
        )
    return cache[path]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    cache: dict[Path, bool] = {}
    for item in items:
        if _starts_processes(item.path, cache):
            item.add_marker(pytest.mark.process)


@pytest.fixture(autouse=True)
def _no_processes_in_the_unit_tier(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not os.environ.get(UNIT_TIER_ENV) or request.node.get_closest_marker("process"):
        return

    def refuse(*_args: object, **_kwargs: object) -> None:
        raise RuntimeError(
            f"{request.node.nodeid} starts a process: mark it @pytest.mark.process "
            "(the unit tier, `make test-fast`, starts none)"
        )

    monkeypatch.setattr(subprocess.Popen, "_execute_child", refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
