"""The `pdserve up` flags for Ray (`--ray` and what goes with it), and for the planner.

Here rather than in the launcher so that the launcher knows nothing of Ray; this module
imports nothing of Ray's either (the configs are plain dataclasses): `pdserve up --help`
works without Ray installed. The flags are declared on the configs they set.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from pdserve.cluster.ray_cluster import RayClusterConfig
from pdserve.cluster.ray_local import RAY_GROUP, RayConnection
from pdserve.launcher import ClusterConfig
from pdserve.options import add_options, from_args, option
from pdserve.planner.config import PLANNER_GROUP, PlannerConfig


@dataclass(frozen=True)
class UpOnRay:
    """Whether `pdserve up` runs on Ray, and with the planner (`pdserve.cluster.up_args` chooses
    by them)."""

    ray: bool = option(False, help="start the cluster on Ray")
    planner: bool = option(False, help="turn the planner on")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the Ray and planner groups to `pdserve up`'s parser."""
    group = parser.add_argument_group(
        RAY_GROUP,
        "Run the instances and the router as Ray actors (pip install 'pdserve[ray]'; "
        "docs/multi-host.md). Ray places them, restarts a crashed one and takes a leaving "
        "node's with it; the router learns every change.",
    )
    add_options(group, UpOnRay, only=("ray",))
    add_options(parser, RayConnection)
    add_options(parser, RayClusterConfig)
    group = parser.add_argument_group(
        PLANNER_GROUP,
        "With --ray: change the number of prefill and decode instances, within bounds, "
        "from measured TTFT and TPOT against targets and the instances' queues and KV use "
        "(docs/multi-host.md, 'Planner').",
    )
    add_options(group, UpOnRay, only=("planner",))
    add_options(parser, PlannerConfig)


def up_on_ray(args: argparse.Namespace) -> UpOnRay:
    """Whether parsed `pdserve up` flags ask for Ray and the planner."""
    return from_args(UpOnRay, args)


def ray_config_from_args(args: argparse.Namespace, cluster: ClusterConfig) -> RayClusterConfig:
    """The `RayClusterConfig` of parsed `pdserve up --ray` flags, for `cluster` (the
    launcher's flags' config, pdserve.cluster.up_args)."""
    connection = from_args(RayConnection, args)
    return from_args(RayClusterConfig, args, cluster=cluster, connection=connection)


def planner_config_from_args(args: argparse.Namespace) -> PlannerConfig:
    """The `PlannerConfig` of parsed `pdserve up` flags (ValueError if inconsistent)."""
    return from_args(PlannerConfig, args)
