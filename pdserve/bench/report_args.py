"""`pdserve bench report` on its parsed flags: the `ReportConfig` they describe, handed to
`pdserve.bench.report.run`; the namespace goes no further than this module."""

from __future__ import annotations

import argparse

from pdserve.bench import report
from pdserve.bench.report import ReportConfig, add_arguments
from pdserve.options import from_args

__all__ = ["add_arguments", "main_from_args"]


def main_from_args(args: argparse.Namespace) -> int:
    """Write the report of the parsed arguments and print its summary."""
    return report.run(from_args(ReportConfig, args, results=tuple(args.results)))
