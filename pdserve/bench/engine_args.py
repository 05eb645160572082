"""`pdserve bench engine` on its parsed flags: the `EngineBenchConfig` they describe, handed
to `pdserve.bench.engine.run`; the namespace goes no further than this module."""

from __future__ import annotations

import argparse

from pdserve.bench import engine
from pdserve.bench.engine import EngineBenchConfig, add_arguments
from pdserve.options import from_args

__all__ = ["add_arguments", "main_from_args"]


def main_from_args(args: argparse.Namespace) -> int:
    """Measure every model of the parsed flags, print the table (or JSON)."""
    return engine.run(from_args(EngineBenchConfig, args))
