"""`pdserve up --ray`: the cluster of `pdserve up` on Ray, with an optional planner.

Prints the same table as `pdserve up` (role, URL, PID of the process that serves it, its
node), then watches: each restart or move Ray makes is printed with the instance's new
row, and with `--planner` each planner decision too (`pdserve.cluster.planner_loop`). Ctrl-C
or SIGTERM stops the actors (and a local Ray cluster).
"""

from __future__ import annotations

import logging
import secrets
import sys
import time
from dataclasses import dataclass

from pdserve.cluster.ray_cluster import RayCluster, RayClusterConfig
from pdserve.cluster.registry import InstanceRecord
from pdserve.launcher import TOKEN_ENV
from pdserve.planner.config import PlannerConfig
from pdserve.stop_request import StopCheck, StopRequest

WATCH_INTERVAL_S = 1.0


@dataclass(frozen=True)
class RayUpCommand:
    """What `pdserve up --ray` runs (built from its flags by pdserve.cluster.up_args): a P/D
    cluster on Ray, and the planner's config with `--planner` (None: no planner)."""

    cluster: RayClusterConfig
    planner: PlannerConfig | None = None


def main(up: RayUpCommand) -> int:
    """Start on Ray, print the table, watch (and plan) until a stop signal."""
    logging.basicConfig(level=logging.INFO, format="pdserve up: %(message)s")
    config, planner = up.cluster, up.planner
    token = config.cluster.cluster_token or secrets.token_hex(16)
    cluster = RayCluster(config, token)
    stop = StopRequest()
    with stop.installed():
        try:
            print("pdserve up: starting on Ray", flush=True)
            cluster.start()
            stop.armed = True
            print_table(cluster)
            _watch(cluster, stop.requested, planner)
            print("pdserve up: stopping", flush=True)
            return 0
        except KeyboardInterrupt:
            print("pdserve up: stopping", flush=True)
            return 0
        except (RuntimeError, TimeoutError) as exc:
            print(f"pdserve up: {exc}", file=sys.stderr, flush=True)
            return 1
        finally:
            stop.armed = True  # a second Ctrl-C must not cut the stop short
            cluster.stop()


def _watch(cluster: RayCluster, stop: StopCheck, planner: PlannerConfig | None) -> None:
    from pdserve.cluster.planner_loop import RayPlannerLoop

    loop = RayPlannerLoop(cluster, planner) if planner is not None else None
    next_plan = time.monotonic() + (loop.cfg.interval_s if loop else 0.0)
    while not stop.wait(WATCH_INTERVAL_S):
        changes = cluster.changes()
        for line in changes:
            print(f"pdserve up: {line}", flush=True)
        if changes:
            print_table(cluster)
        if loop is not None and time.monotonic() >= next_plan:
            if loop.step().changes:
                print_table(cluster)
            next_plan = time.monotonic() + loop.cfg.interval_s


def print_table(cluster: RayCluster) -> None:
    """The status table: the router, then every instance's current incarnation."""
    print(f"\npdserve up: ready on Ray\n  URL      {cluster.router_url}", flush=True)
    print(f"  {'router':<8} {cluster.router_url:<26} pid {cluster.router_pid:<8}", flush=True)
    for r in cluster.records():
        print(status_row(r), flush=True)
    print(f"  cluster token: in ${TOKEN_ENV} of each actor", flush=True)


def status_row(r: InstanceRecord) -> str:
    """One instance's row: role, URL, PID, node, restarts."""
    return (
        f"  {r.role:<8} {r.url:<26} pid {r.pid:<8} node {r.node_ip} ({r.node_id[:8]}) "
        f"restarts {r.restarts}"
    )
