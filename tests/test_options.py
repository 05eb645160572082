"""`pdserve.options`: flags derived from config fields, configs built back from the namespace."""

from __future__ import annotations

import argparse
import ast
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pytest

from pdserve.options import add_options, from_args, from_flag, option, positive_int


@dataclass(frozen=True)
class Demo:
    urls: tuple[str, ...] = option(nargs="+", help="one or more URLs")
    name: str = option("x", help="a name (default: %(default)s)")
    count: int = option(3, flag="--n", parse=positive_int, help="how many")
    mode: Literal["a", "b"] = option("a", group="modes", help="a mode")
    limit: float | None = option(None, help="a bound")
    path: Path | None = option(None, help="a path")
    fast: bool = option(False, help="go fast")
    checks: bool = option(True, flag="--no-checks", help="skip the checks")
    cache: bool = option(True, negatable=True, help="cache")
    extra: tuple[str, ...] = option((), append=True, help="one extra each")
    token: str | None = option(None, env="DEMO_TOKEN", help="a secret")
    internal: int = 7  # not a flag


@dataclass(frozen=True)
class Reader:
    name: str = from_flag("--name", "?")
    count: int = from_flag("--n", 0)


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_options(parser, Demo)
    return parser.parse_args(list(argv))


def test_defaults_come_from_the_fields(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DEMO_TOKEN", raising=False)
    cfg = from_args(Demo, _parse("--urls", "u"))
    assert cfg == Demo(urls=("u",))


def test_flags_types_and_actions() -> None:
    argv = ["--name", "y", "--n", "5", "--mode", "b", "--limit", "1.5", "--path", "/p"]
    argv += ["--fast", "--no-checks", "--no-cache", "--urls", "u1", "u2", "--urls", "u3"]
    argv += ["--extra", "e1", "--extra=--e2"]
    cfg = from_args(Demo, _parse(*argv), internal=9)
    assert cfg == Demo(
        name="y",
        count=5,
        mode="b",
        limit=1.5,
        path=Path("/p"),
        fast=True,
        checks=False,
        cache=False,
        urls=("u1", "u2", "u3"),
        extra=("e1", "--e2"),
        internal=9,
    )


@pytest.mark.parametrize("argv", [["--mode", "c"], ["--n", "0"], ["--n", "x"], ["--checks"], []])
def test_bad_values_and_missing_required_flags_are_usage_errors(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        _parse(*argv, *(["--urls", "u"] if argv else []))
    assert exc.value.code == 2


def test_env_default_is_read_when_the_parser_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEMO_TOKEN", "s3")
    assert _parse("--urls", "u").token == "s3"
    assert _parse("--urls", "u", "--token", "t").token == "t"


def test_help_lists_groups_and_choices(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        _parse("--help")
    out = capsys.readouterr().out
    assert "modes:\n  --mode {a,b}" in out
    assert "(default: x)" in out
    assert "--cache, --no-cache" in out
    assert "internal" not in out


def test_a_flag_feeds_fields_of_another_config() -> None:
    args = _parse("--urls", "u", "--name", "z", "--n", "2")
    assert from_args(Reader, args) == Reader(name="z", count=2)


def test_a_field_without_a_command_line_type_is_refused() -> None:
    @dataclass(frozen=True)
    class Bad:
        pairs: dict[str, int] = option(None, help="no argparse type")

    with pytest.raises(TypeError, match="give the option a `parse`"):
        add_options(argparse.ArgumentParser(), Bad)


@dataclass(frozen=True)
class Grid:
    sizes: tuple[int, ...] = option((1, 2), nargs="+", help="sizes")
    names: tuple[str, ...] = option((), nargs="+", help="names")


def test_a_list_flag_replaces_a_non_empty_default_and_extends_an_empty_one() -> None:
    parser = argparse.ArgumentParser()
    add_options(parser, Grid)
    assert from_args(Grid, parser.parse_args([])) == Grid()
    args = parser.parse_args(["--sizes", "3", "--sizes", "4", "5", "--names", "a", "--names", "b"])
    assert from_args(Grid, args) == Grid(sizes=(4, 5), names=("a", "b"))


@dataclass(frozen=True)
class Saving:
    save: str | None = option(None, nargs="?", const="", metavar="FILE", help="save")


def test_an_optional_value_flag_takes_its_const_when_given_alone() -> None:
    parser = argparse.ArgumentParser()
    add_options(parser, Saving)
    assert from_args(Saving, parser.parse_args([])) == Saving(save=None)
    assert from_args(Saving, parser.parse_args(["--save"])) == Saving(save="")
    assert from_args(Saving, parser.parse_args(["--save", "f.json"])) == Saving(save="f.json")
    assert "--save [FILE]" in parser.format_help()


# -- every command declares its flags through options -------------------------------------

PACKAGE = Path(__file__).resolve().parents[1] / "pdserve"

# Modules that may call `add_argument` with a flag, and why.
RAW_FLAG_MODULES = {
    "cli.py": "the subcommands' wiring and --version, no config's",
    "options.py": "the mechanism: it adds every declared option",
    "server/vllm_forms.py": "vLLM's spellings translated into pdserve's flags",
}
# Single flags elsewhere that are no config's setting, and why.
RAW_FLAGS = {
    ("server/serve_args.py", "--config"): "a file of flags, read by cli.py before parsing",
}


def _raw_flags(path: Path) -> list[str]:
    """The flags `path` adds with `add_argument` itself (positionals are allowed anywhere:
    options.py declares flags only); a name that is not a literal counts as a flag."""
    flags = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if node.func.attr != "add_argument":
            continue
        first = node.args[0] if node.args else None
        name = first.value if isinstance(first, ast.Constant) else None
        if not isinstance(name, str) or name.startswith("-"):
            flags.append(name if isinstance(name, str) else "<not a literal>")
    return flags


def test_commands_declare_their_flags_on_configs_only() -> None:
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = path.relative_to(PACKAGE).as_posix()
        if module in RAW_FLAG_MODULES:
            continue
        offenders += [
            f"{module}: {flag}" for flag in _raw_flags(path) if (module, flag) not in RAW_FLAGS
        ]
    assert not offenders, "declare these with option(...) and add_options:\n" + "\n".join(offenders)


def test_the_flag_scan_sees_raw_flags_and_lets_positionals_pass() -> None:
    assert _raw_flags(PACKAGE / "server" / "vllm_forms.py")  # an allowed module's raw flags
    assert _raw_flags(PACKAGE / "server" / "serve_args.py") == ["--config"]
    assert _raw_flags(PACKAGE / "router" / "scrape_targets.py") == []  # its positional only


# -- the namespace stops at the command line -----------------------------------------------

# Modules whose functions may take (or return) an argparse.Namespace, and why. A command's
# arguments module, `*_args.py` (pdserve/cli.py's COMMANDS), may too: it turns the namespace
# into the configs its command runs on.
NAMESPACE_MODULES = {
    "cli.py": "parses the command line, hands the namespace to the command's arguments module",
    "options.py": "the mechanism: `from_args` builds a config from the namespace",
    "server/vllm_forms.py": "vLLM's spellings folded into the namespace before configs exist",
}


def _takes_namespace(node: ast.expr | None) -> bool:
    """Whether an annotation names `Namespace` (`argparse.Namespace`, `Namespace | None`,
    or the same as a string)."""
    if node is None:
        return False
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return _takes_namespace(ast.parse(node.value, mode="eval").body)
    return any(
        (isinstance(n, ast.Name) and n.id == "Namespace")
        or (isinstance(n, ast.Attribute) and n.attr == "Namespace")
        for n in ast.walk(node)
    )


def _namespace_functions(source: str) -> list[str]:
    """The functions of `source` with a parameter or return annotated as a Namespace."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        a = node.args
        params = [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]
        if any(p is not None and _takes_namespace(p.annotation) for p in params):
            found.append(f"{node.name}(...)")
        elif _takes_namespace(node.returns):
            found.append(f"{node.name}() -> Namespace")
    return found


def test_the_namespace_stops_at_the_command_line() -> None:
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = path.relative_to(PACKAGE).as_posix()
        if module in NAMESPACE_MODULES or path.name.endswith("_args.py"):
            continue
        offenders += [f"{module}: {f}" for f in _namespace_functions(path.read_text())]
    assert not offenders, (
        "hand configs down, not argparse's namespace (build them in the command's "
        "*_args.py module):\n" + "\n".join(offenders)
    )


def test_the_namespace_scan_sees_every_spelling() -> None:
    source = """
import argparse
from argparse import Namespace
def a(args: argparse.Namespace) -> int: ...
def b(x: int, *, args: Namespace | None = None) -> None: ...
async def c(args: "argparse.Namespace") -> None: ...
def d(argv: list[str]) -> argparse.Namespace: ...
def e(cfg: object, parser: argparse.ArgumentParser) -> int: ...
"""
    assert _namespace_functions(source) == ["a(...)", "b(...)", "c(...)", "d() -> Namespace"]
    assert _namespace_functions((PACKAGE / "options.py").read_text())  # an allowed module's
