"""The transfer core imports nothing from any engine (pdserve.transfer.adapter is the
only way they talk), directly or through what it imports."""

from __future__ import annotations

import ast
import pkgutil
import subprocess
import sys
from pathlib import Path

import pdserve.transfer

ENGINES = ("pdserve.engine", "pdserve.vllm", "vllm")
CORE = Path(pdserve.transfer.__file__).parent


def _imported(tree: ast.AST, package: str) -> list[str]:
    """Absolute names of the modules a file imports (resolving relative imports)."""
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            module = ".".join(p for p in (base, node.module or "") if p)
            names += [module] + [f"{module}.{a.name}" for a in node.names]
    return names


def _is_engine(name: str) -> bool:
    return any(name == e or name.startswith(e + ".") for e in ENGINES)


def test_no_core_file_imports_an_engine() -> None:
    files = sorted(CORE.rglob("*.py"))
    assert len(files) > 10  # the walk found the core (connector, push, pull, transports...)
    offenders = {}
    for path in files:
        package = ".".join(("pdserve", *path.relative_to(CORE.parent).parent.parts))
        bad = [n for n in _imported(ast.parse(path.read_text()), package) if _is_engine(n)]
        if bad:
            offenders[str(path.relative_to(CORE.parent))] = bad
    assert offenders == {}


def test_the_check_sees_an_engine_import() -> None:
    """The static check above catches each form of import it must refuse."""
    for src, package in [
        ("from pdserve.engine.request import Request", "pdserve.transfer"),
        ("import pdserve.engine.engine", "pdserve.transfer"),
        ("from ..engine import request", "pdserve.transfer"),
        ("from ...engine.request import Request", "pdserve.transfer.transport"),
        ("if True:\n    from pdserve.engine import types", "pdserve.transfer"),
    ]:
        assert any(_is_engine(n) for n in _imported(ast.parse(src), package)), src
    assert not any(_is_engine(n) for n in _imported(ast.parse("import pdserve.kv"), "x"))


def test_importing_the_core_loads_no_engine() -> None:
    """Transitively too: a fresh interpreter imports every core module, then looks."""
    modules = [m.name for m in pkgutil.walk_packages([str(CORE)], "pdserve.transfer.")]
    assert "pdserve.transfer.connector" in modules and "pdserve.transfer.adapter" in modules
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        f"print(sorted(m for m in sys.modules if m.startswith({ENGINES!r})))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]"
