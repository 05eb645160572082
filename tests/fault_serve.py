"""Test-only entry point: `pdserve serve` with faults injected (pdserve.faults).

    python -m tests.fault_serve --faults '{"step_delay_s": 0.04}' [pdserve serve flags ...]

Runs the normal instance (`pdserve.server.serve.main`) with a `Faults` built from the JSON
object (its field names); everything after `--faults JSON` is parsed exactly as `pdserve serve`
parses it. Tests that need a faulty subprocess start this (tests/procs.py: `faults=`), and
the benchmarks that slow one instance on purpose (scripts/bench/routing) do too. Run it from
the repository root.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable, Sequence

import msgspec

from pdserve.faults import Faults
from pdserve.launcher import InstanceSpec, serve_command


def command(faults: Faults, serve_args: Sequence[str]) -> list[str]:
    """The command line of `pdserve serve SERVE_ARGS...` with `faults` injected (this file
    run by its path: it works from any directory)."""
    return [sys.executable, __file__, "--faults", faults_json(faults), *serve_args]


def instance_command(faults: Faults) -> Callable[[InstanceSpec], list[str]]:
    """A `pdserve.launcher.Cluster` instance command: every instance with `faults`."""

    def cmd(spec: InstanceSpec) -> list[str]:
        argv = serve_command(spec)
        head = argv.index("serve") + 1  # [python, -m, pdserve, serve, ...]
        return command(faults, argv[head:])

    return cmd


def faults_json(faults: Faults) -> str:
    """`faults` as this entry point's `--faults` takes it."""
    return msgspec.json.encode(faults).decode()


def main(argv: Sequence[str] | None = None) -> int:
    from pdserve.cli import parse_args
    from pdserve.server.serve_args import main_from_args

    argv = list(sys.argv[1:] if argv is None else argv)
    pre = argparse.ArgumentParser(prog="python -m tests.fault_serve")
    pre.add_argument("--faults", required=True, help="a Faults as a JSON object")
    ours, rest = pre.parse_known_args(argv)
    return main_from_args(parse_args(["serve", *rest]), _parse_faults(pre, ours.faults))


def _parse_faults(parser: argparse.ArgumentParser, text: str) -> Faults:
    try:
        given = msgspec.json.decode(text)
        unknown = set(given) - {f.name for f in dataclasses.fields(Faults)}
        if unknown:
            raise ValueError(f"unknown faults {sorted(unknown)}")
        return msgspec.convert(given, Faults)
    except (msgspec.MsgspecError, ValueError, TypeError) as exc:
        parser.error(f"--faults: {exc}")
        raise  # not reached: error() exits


if __name__ == "__main__":
    sys.exit(main())
