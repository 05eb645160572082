"""`pdserve bench sweep` on its parsed flags: the `SweepConfig` they describe, handed to
`pdserve.bench.sweep.run` with the command line the sweep records; the namespace goes no
further than this module."""

from __future__ import annotations

import argparse
import shlex
import sys
from datetime import datetime
from pathlib import Path

from pdserve.bench import sweep
from pdserve.bench.sweep import SweepConfig, add_arguments
from pdserve.options import from_args

__all__ = ["add_arguments", "config_from_args", "main_from_args"]


def config_from_args(args: argparse.Namespace) -> SweepConfig:
    """SweepConfig of parsed flags; ValueError for an invalid combination."""
    extra = list(args.instance_args)
    if extra[:1] == ["--"]:
        extra = extra[1:]
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    return from_args(
        SweepConfig,
        args,
        out_dir=args.out_dir or Path("results") / f"sweep-{stamp}",
        instance_args=tuple(extra),
        disable_tqdm=args.disable_tqdm or not sys.stderr.isatty(),
    )


def main_from_args(args: argparse.Namespace) -> int:
    """0 when every point ran with no failed request; 1 otherwise; 130 if interrupted; 2 for
    flags that do not go together."""
    try:
        cfg = config_from_args(args)
    except ValueError as exc:
        print(f"pdserve bench sweep: {exc}", file=sys.stderr)
        return 2
    return sweep.run(cfg, shlex.join(["pdserve", *sys.argv[1:]]))
