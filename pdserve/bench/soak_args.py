"""`pdserve bench soak` on its parsed flags: the `SoakConfig` they describe (`SoakCommand`'s
flags folded into its fields), handed to `pdserve.bench.soak.run`; the namespace goes no
further than this module."""

from __future__ import annotations

import argparse
import sys

from pdserve.bench import soak
from pdserve.bench.soak import SoakCommand, SoakConfig, add_arguments
from pdserve.bench.soak_traffic import TrafficConfig
from pdserve.options import from_args

__all__ = ["add_arguments", "config_from_args", "main_from_args"]


def config_from_args(args: argparse.Namespace) -> SoakConfig:
    """SoakConfig of parsed flags; ValueError for an invalid combination."""
    cmd = from_args(SoakCommand, args)
    extra = list(args.instance_args)
    return from_args(
        SoakConfig,
        args,
        duration_s=cmd.duration_min * 60,
        traffic=from_args(TrafficConfig, args),
        restart_at=None if not cmd.restart or args.kill_every else args.restart_at,
        instance_args=tuple(extra[1:] if extra[:1] == ["--"] else extra),
        progress=False if cmd.disable_tqdm else None,
    )


def main_from_args(args: argparse.Namespace) -> int:
    """Run the soak of the parsed flags; 2 for flags that do not go together (as for a soak
    that could not run)."""
    try:
        cfg = config_from_args(args)
    except ValueError as exc:
        print(f"pdserve bench soak: {exc}", file=sys.stderr)
        return 2
    return soak.run(cfg)
