"""Connecting to Ray: a cluster to join, or a local one kept on loopback.

Network hygiene: a local cluster is started with `node_ip_address=127.0.0.1` and with
`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` in the environment; measured with ray 2.60, that
keeps the GCS, the raylet, the runtime-env agent and every worker listening on 127.0.0.1
only (without them some listen on all interfaces or on the host's address). The dashboard
is off. Token authentication stays on: `RAY_AUTH_MODE=token`, with a token made here for
a local cluster (in the environment of this process and of the Ray processes it starts,
never written to ~/.ray), or the caller's `RAY_AUTH_TOKEN` / `~/.ray/auth_token` when
joining one.

The environment variables are set in this process because Ray reads them from there (and
hands them to the processes it starts); `connect` is called once per process.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.options import option

log = logging.getLogger(__name__)

RAY_GROUP = "ray"  # where `pdserve up --help` lists the Ray flags

LOOPBACK = "127.0.0.1"
RAY_TOKEN_ENV = "RAY_AUTH_TOKEN"


@dataclass(frozen=True)
class RayConnection:
    """How `pdserve up --ray` reaches Ray."""

    address: str | None = option(  # a running cluster ("host:port"); None: start a local one
        None,
        flag="--ray-address",
        group=RAY_GROUP,
        metavar="ADDRESS",
        help="join this running Ray cluster (host:port of its GCS); without it a local, "
        "loopback-only one is started and stopped with the cluster",
    )
    num_cpus: int | None = option(  # a local cluster's CPUs (None: Ray's count)
        None,
        flag="--ray-num-cpus",
        group=RAY_GROUP,
        metavar="N",
        help="CPUs of the local Ray cluster (default: Ray's count)",
    )
    temp_dir: Path | None = None  # a local cluster's session folder (None: Ray's default)
    namespace: str = "pdserve"

    @property
    def local(self) -> bool:
        return self.address is None


def ray_environment(local: bool) -> dict[str, str]:
    """The variables `connect` sets: token authentication, and for a local cluster
    loopback-only services. (`RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0` makes Ray a one-node
    cluster, which is what keeps it on loopback; nodes that join another cluster, as in
    docs/multi-host.md, need it unset or 1.)"""
    env = {"RAY_AUTH_MODE": "token", "RAY_USAGE_STATS_ENABLED": "0"}
    if local:
        env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    if local and not os.environ.get(RAY_TOKEN_ENV):
        env[RAY_TOKEN_ENV] = secrets.token_hex(32)
    return env


def connected() -> bool:
    """Whether this process is connected to Ray already, without importing Ray (which
    would read its settings before `connect` has set them)."""
    ray = sys.modules.get("ray")
    return ray is not None and bool(ray.is_initialized())


@dataclass(frozen=True)
class RaySession:
    """What `connect` did, for `disconnect`: whether it started a local cluster."""

    local: bool


def connect(conn: RayConnection) -> RaySession:
    """`ray.init` for `conn`: join `address`, or start a local loopback cluster that
    `disconnect` stops again."""
    session = RaySession(local=conn.local)
    # Ray reads its settings once, when imported: set them first. If Ray was imported
    # already, have it read the authentication mode and token again (what `ray.init` does
    # when it turns token authentication on); `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER` it does
    # not read again, and a local cluster then registers the host's address instead of
    # loopback, which is why callers ask `connected()` (it does not import Ray).
    imported = "ray" in sys.modules
    os.environ.update(ray_environment(conn.local))
    import ray

    if imported:
        from ray._raylet import AuthenticationTokenLoader, Config

        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()
    if conn.local:
        ray.init(
            _node_ip_address=LOOPBACK,
            include_dashboard=False,
            num_cpus=conn.num_cpus,
            _temp_dir=str(conn.temp_dir) if conn.temp_dir else None,
            namespace=conn.namespace,
            log_to_driver=False,
        )
    else:
        ray.init(address=conn.address, namespace=conn.namespace, log_to_driver=False)
    return session


def disconnect(session: RaySession, grace_s: float = 10.0) -> None:
    """Leave Ray; a local cluster started by `connect` stops with it, every process of it:
    those still there `grace_s` after `ray.shutdown()` are killed (by PID). Ray stops its
    GCS and raylet, but a worker that was still starting, or one whose `ray.kill` had not
    arrived yet, can outlive them, orphaned."""
    import psutil  # the ray extra
    import ray

    ours = _ray_processes(ray) if session.local else []
    ray.shutdown()
    _, alive = psutil.wait_procs(ours, timeout=grace_s)
    for proc in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            name = proc.name()
            log.warning("Ray's process %d (%s) outlived the cluster: killing it", proc.pid, name)
            proc.kill()
    psutil.wait_procs(alive, timeout=grace_s)


def _ray_processes(ray: Any) -> list[Any]:
    """The local cluster's processes (psutil.Process): this process's children that run
    Ray's programs (GCS, raylet, monitors), and everything below them (the workers)."""
    import psutil

    ray_dir = os.path.dirname(ray.__file__)
    found = []
    for child in psutil.Process().children():
        with contextlib.suppress(psutil.Error):
            if any(ray_dir in arg for arg in child.cmdline()):
                found += [child, *child.children(recursive=True)]
    return found
