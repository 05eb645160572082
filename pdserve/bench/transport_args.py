"""`pdserve bench transport` on its parsed flags: the `TransportBenchConfig` they describe,
handed to `pdserve.bench.transport.run`; the namespace goes no further than this module."""

from __future__ import annotations

import argparse

from pdserve.bench import transport
from pdserve.bench.transport import TransportBenchConfig, add_arguments
from pdserve.options import from_args

__all__ = ["add_arguments", "main_from_args"]


def main_from_args(args: argparse.Namespace) -> int:
    """Run the benchmark of the parsed flags; 2 when the backend is unavailable."""
    return transport.run(from_args(TransportBenchConfig, args))
