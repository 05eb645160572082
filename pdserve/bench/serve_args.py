"""`pdserve bench serve` on its parsed flags: the `BenchConfig` they describe (`ServerAddress`
folded into its URL and endpoint), where the result goes and where the client runs, handed to
`pdserve.bench.serve.run`; the namespace goes no further than this module."""

from __future__ import annotations

import argparse
import sys

from pdserve.bench import serve
from pdserve.bench.arrivals import ArrivalConfig
from pdserve.bench.dataset import MultiTurnConfig, RandomDatasetConfig
from pdserve.bench.metrics import parse_goodput
from pdserve.bench.serve import (
    BenchConfig,
    BenchProcess,
    ResultOutput,
    ServerAddress,
    add_arguments,
)
from pdserve.options import from_args

__all__ = ["add_arguments", "config_from_args", "main_from_args"]


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """BenchConfig from parsed flags; ValueError for an invalid combination."""
    address = from_args(ServerAddress, args)
    return from_args(
        BenchConfig,
        args,
        base_url=args.base_url or f"http://{address.host}:{address.port}",
        endpoint=address.endpoint(args.endpoint),
        random=from_args(RandomDatasetConfig, args),
        multiturn=from_args(MultiTurnConfig, args),
        arrivals=from_args(ArrivalConfig, args),
        goodput=tuple(parse_goodput(args.goodput).items()),
    )


def main_from_args(args: argparse.Namespace) -> int:
    """Run, print the summary, save the JSON if asked. 1 if nothing completed, 2 for flags
    that do not go together."""
    try:
        output = from_args(ResultOutput, args)
        cfg = config_from_args(args)
    except ValueError as exc:
        print(f"pdserve bench serve: error: {exc}", file=sys.stderr)
        return 2
    return serve.run(cfg, output, from_args(BenchProcess, args))
