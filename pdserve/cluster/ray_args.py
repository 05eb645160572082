"""The `pdserve up` flags for Ray (`--ray` and what goes with it), and for the planner.

Here rather than in the launcher so that the launcher's flags stay one list and this
module imports nothing of Ray's: `pdserve up --help` works without Ray installed.
"""

from __future__ import annotations

import argparse

from pdserve.planner.config import PlannerConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the Ray and planner groups to `pdserve up`'s parser."""
    group = parser.add_argument_group(
        "ray",
        "Run the instances and the router as Ray actors (pip install 'pdserve[ray]'; "
        "docs/multi-host.md). Ray places them, restarts a crashed one and takes a leaving "
        "node's with it; the router learns every change.",
    )
    group.add_argument("--ray", action="store_true", help="start the cluster on Ray")
    group.add_argument(
        "--ray-address",
        metavar="ADDRESS",
        help="join this running Ray cluster (host:port of its GCS); without it a local, "
        "loopback-only one is started and stopped with the cluster",
    )
    group.add_argument(
        "--ray-num-cpus",
        type=int,
        metavar="N",
        help="CPUs of the local Ray cluster (default: Ray's count)",
    )
    group.add_argument(
        "--actor-cpus",
        type=float,
        default=1.0,
        metavar="N",
        help="CPUs each instance actor asks for (default: %(default)s; also its --threads)",
    )
    _add_planner_arguments(parser)


def _add_planner_arguments(parser: argparse.ArgumentParser) -> None:
    d = PlannerConfig()
    group = parser.add_argument_group(
        "planner",
        "With --ray: change the number of prefill and decode instances, within bounds, "
        "from measured TTFT and TPOT against targets and the instances' queues and KV use "
        "(docs/multi-host.md, 'Planner').",
    )
    group.add_argument("--planner", action="store_true", help="turn the planner on")
    group.add_argument("--ttft-target", type=float, default=d.ttft_target_s, metavar="S")
    group.add_argument("--tpot-target", type=float, default=d.tpot_target_s, metavar="S")
    group.add_argument("--planner-percentile", type=int, choices=(50, 90), default=d.percentile)
    group.add_argument("--planner-interval", type=float, default=d.interval_s, metavar="S")
    group.add_argument("--min-prefill", type=int, default=d.min_prefill, metavar="N")
    group.add_argument("--max-prefill", type=int, default=d.max_prefill, metavar="N")
    group.add_argument("--min-decode", type=int, default=d.min_decode, metavar="N")
    group.add_argument("--max-decode", type=int, default=d.max_decode, metavar="N")
    group.add_argument(
        "--max-instances",
        type=int,
        default=d.max_total,
        metavar="N",
        help="prefill plus decode instances at most (default: %(default)s)",
    )


def planner_config_from_args(args: argparse.Namespace) -> PlannerConfig:
    """The `PlannerConfig` of parsed `pdserve up` flags (ValueError if inconsistent)."""
    return PlannerConfig(
        ttft_target_s=args.ttft_target,
        tpot_target_s=args.tpot_target,
        percentile=args.planner_percentile,
        interval_s=args.planner_interval,
        min_prefill=args.min_prefill,
        max_prefill=args.max_prefill,
        min_decode=args.min_decode,
        max_decode=args.max_decode,
        max_total=args.max_instances,
    )
