"""`pdserve` command line: one subcommand per job, each implemented in its own module.

Each command has an arguments module (`*_args.py`, named below) that exposes
`add_arguments(parser)`, optionally `check_args(args, parser)`, and
`main_from_args(args) -> int`, which turns the parsed namespace into the command's frozen
configs and runs the command's own `main`/`run` on them: the namespace stops there
(tests/test_options.py checks that no other module takes one). They are imported lazily so
that `pdserve --help` stays fast and a missing optional dependency (nixl) only matters to the
command that needs it.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from types import ModuleType

from pdserve import __version__

# (command, its arguments module, one-line help)
COMMANDS: tuple[tuple[str, str, str], ...] = (
    ("serve", "pdserve.server.serve_args", "run one instance (monolithic, prefill or decode)"),
    ("router", "pdserve.router.serve_args", "run the OpenAI-compatible P/D router"),
    (
        "up",
        "pdserve.cluster.up_args",
        "start a P/D cluster (instances + router), locally or on Ray",
    ),
    ("sim", "pdserve.sim.sim_args", "simulate a P/D cluster: pull vs push"),
)
BENCH_COMMANDS: tuple[tuple[str, str, str], ...] = (
    ("serve", "pdserve.bench.serve_args", "replay traffic against an OpenAI-compatible endpoint"),
    ("sweep", "pdserve.bench.sweep_args", "grid of input lengths x rates x modes, with report"),
    ("engine", "pdserve.bench.engine_args", "prefill/decode tokens/s of the engine alone"),
    ("transport", "pdserve.bench.transport_args", "KV transport bandwidth and latency"),
    ("report", "pdserve.bench.report_args", "Markdown table and plots from result JSONs"),
    (
        "soak",
        "pdserve.bench.soak_args",
        "minutes of aborted, P-restarted traffic; leaks and wrong outputs",
    ),
    (
        "make-checkpoint",
        "pdserve.bench.make_checkpoint_args",
        "write a random Hugging Face checkpoint of a given shape (for comparisons)",
    ),
)


# Packages only the tools need, by the extra that installs them (pyproject.toml): the serving
# commands (serve, router, up) never import them.
TOOL_EXTRAS: dict[str, str] = {"matplotlib": "bench", "tqdm": "bench"}


class MissingExtra(SystemExit):
    """A tool command was run without the extra that installs its packages."""


def _missing_extra(exc: ModuleNotFoundError, module: str) -> MissingExtra | None:
    package = (exc.name or "").split(".")[0]
    extra = TOOL_EXTRAS.get(package)
    if extra is None:
        return None
    if module.startswith("pdserve.sim"):
        extra = "sim"
    return MissingExtra(
        f"pdserve: this command needs the '{extra}' extra (missing package {package!r}); "
        f"install it with: pip install 'pdserve[{extra}]'"
    )


def _import_command(module: str) -> ModuleType:
    """The command's module; a missing tool-only package becomes a clear message (exit 1)."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        missing = _missing_extra(exc, module)
        if missing is None:
            raise
        raise missing from exc


def _add(
    sub: argparse._SubParsersAction, name: str, module: str, help_: str, load: bool
) -> argparse.ArgumentParser:
    parser = sub.add_parser(name, help=help_, description=help_)
    parser.set_defaults(_module=module, _parser=parser)
    if load:  # only the chosen command's module is imported (fast --help, isolated failures)
        _import_command(module).add_arguments(parser)
    return parser


def build_parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The parser; the subcommand named in `argv` gets its full set of flags."""
    words = [a for a in argv if not a.startswith("-")]
    parser = argparse.ArgumentParser(
        prog="pdserve",
        description="Prefill/decode disaggregated LLM serving with push-based KV transfer.",
    )
    parser.add_argument("--version", action="version", version=f"pdserve {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module, help_ in COMMANDS:
        _add(sub, name, module, help_, load=words[:1] == [name])
    bench = sub.add_parser("bench", help="benchmarks", description="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", metavar="BENCH", required=True)
    for name, module, help_ in BENCH_COMMANDS:
        _add(bench_sub, name, module, help_, load=words[:2] == ["bench", name])
    return parser


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """Parse a full `pdserve ...` command line (without the program name). Errors in a
    subcommand's flags are reported with that subcommand's usage; `serve --config FILE`
    reads flags from a YAML file first (those on the command line win)."""
    argv = _with_config_file(list(argv))
    args, extra = build_parser(argv).parse_known_args(argv)
    parser: argparse.ArgumentParser = args._parser
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    check = getattr(_import_command(args._module), "check_args", None)
    if check is not None:
        check(args, parser)
    return args


def _with_config_file(argv: list[str]) -> list[str]:
    """`argv` with the flags of `serve --config FILE` put before the command line's own."""
    if argv[:1] != ["serve"]:
        return argv
    path = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)
    if path is None and "--config" in argv[:-1]:
        path = argv[argv.index("--config") + 1]
    if path is None:
        return argv
    from pdserve.server.vllm_forms import config_file_args

    try:
        return ["serve", *config_file_args(path), *argv[1:]]
    except ValueError as exc:
        build_parser(argv).parse_known_args(["serve"])[0]._parser.error(str(exc))
        raise  # not reached: error() exits


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `pdserve` console script."""
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    command = _import_command(args._module)
    try:
        return int(command.main_from_args(args) or 0)
    except ModuleNotFoundError as exc:  # a tool that imports a package when it needs it
        missing = _missing_extra(exc, args._module)
        if missing is None:
            raise
        raise missing from exc


if __name__ == "__main__":
    sys.exit(main())
