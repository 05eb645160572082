"""The serving path needs only the core dependencies; a tool run without its extra says so.

`pdserve serve`, `router` and `up` must work from `pip install pdserve`, so no module they
can load may import a package that only the `bench` / `sim` extras install
(pyproject.toml). A fresh interpreter with those packages made unimportable imports every
such module and builds the three commands' parsers. (Checking `sys.modules` instead would
not work: torch imports tqdm by itself where it is installed, and runs without it.) A tool
command whose package is missing exits with the extra's name.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pdserve import cli

TOOL_ONLY = sorted(cli.TOOL_EXTRAS)
TEST_ONLY = ["httpx"]  # the `test` extra's HTTP client: pdserve's own is aiohttp
SERVING_PACKAGES = (
    "pdserve.model",
    "pdserve.kv",
    "pdserve.transfer",
    "pdserve.engine",
    "pdserve.server",
    "pdserve.router",
)
SERVING_MODULES = ("pdserve.cli", "pdserve.launcher", "pdserve.supervisor", "pdserve.offline")

PROBE = """
import importlib, json, pkgutil, sys
for name in {tools!r}:
    sys.modules[name] = None  # `import name` raises ModuleNotFoundError, as if not installed
from pdserve import cli
loaded, skipped = [], []
for name in {modules!r}:
    importlib.import_module(name); loaded.append(name)
for pkg in {packages!r}:
    for info in pkgutil.walk_packages(importlib.import_module(pkg).__path__, pkg + "."):
        try:
            importlib.import_module(info.name); loaded.append(info.name)
        except ImportError as exc:  # an optional backend (nixl) that is not installed
            if (exc.name or "").split(".")[0] not in ("nixl", "nixl_cu12"):
                raise
            skipped.append(info.name)
for command in ("serve", "router", "up"):
    cli.build_parser([command])
print(json.dumps({{"loaded": loaded, "skipped": skipped}}))
"""


def test_serving_modules_need_no_tool_or_test_package() -> None:
    tools = TOOL_ONLY + TEST_ONLY
    code = PROBE.format(modules=SERVING_MODULES, packages=SERVING_PACKAGES, tools=tools)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=240, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    for module in ("pdserve.server.app", "pdserve.router.app", "pdserve.engine.engine"):
        assert module in report["loaded"]


@pytest.mark.parametrize(
    ("argv", "module", "extra"),
    [
        (["bench", "serve", "--help"], "pdserve.bench.serve_args", "bench"),
        (["sim", "--help"], "pdserve.sim.sim_args", "sim"),
    ],
)
def test_tool_without_its_extra_names_the_extra(
    argv: list[str], module: str, extra: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)  # `import tqdm` now fails as if absent
    for name in [m for m in sys.modules if m.startswith(("pdserve.bench", "pdserve.sim"))]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    assert f"pip install 'pdserve[{extra}]'" in str(exited.value.code)
    assert "'tqdm'" in str(exited.value.code)


def test_a_serving_command_does_not_hide_a_missing_core_package(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "yaml", None)
    monkeypatch.delitem(sys.modules, "pdserve.server.vllm_forms", raising=False)
    with pytest.raises(ModuleNotFoundError):
        cli.main(["serve", "--config", "x.yaml"])
