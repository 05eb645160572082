"""The flags of `pdserve sim` (declared on `SimCommand` and `pdserve bench serve`'s configs,
listed by `pdserve.sim.cli.add_arguments`) and the configs built from them; the namespace
goes no further than this module."""

from __future__ import annotations

import argparse
import sys

from pdserve.bench.arrivals import ArrivalConfig
from pdserve.bench.dataset import RandomDatasetConfig
from pdserve.bench.metrics import parse_goodput
from pdserve.bench.serve import BenchConfig
from pdserve.options import from_args
from pdserve.sim import cli
from pdserve.sim.cli import SimCommand, add_arguments

__all__ = ["add_arguments", "main_from_args", "workload_from_args"]

DEFAULT_NUM_PROMPTS = 100


def workload_from_args(args: argparse.Namespace) -> BenchConfig:
    """The simulated workload of parsed flags (`pdserve bench serve`'s); ValueError if bad."""
    return from_args(
        BenchConfig,
        args,
        model=None,  # `--model` is the simulated model's profile here, not a served name
        random=from_args(RandomDatasetConfig, args),
        num_prompts=args.num_prompts or (None if args.dataset_path else DEFAULT_NUM_PROMPTS),
        arrivals=from_args(ArrivalConfig, args),
        goodput=tuple(parse_goodput(args.goodput).items()),
    )


def main_from_args(args: argparse.Namespace) -> int:
    """`pdserve sim` on its parsed flags: simulate, print the summary, save JSONs and the
    report as asked; 1 for a workload that cannot be built."""
    cmd = from_args(SimCommand, args)
    try:
        workload = workload_from_args(args)
    except ValueError as exc:
        print(f"pdserve sim: {exc}", file=sys.stderr)
        return 1
    return cli.run(cmd, workload)
