"""`RayCluster`: a P/D cluster whose instances and router are Ray actors.

Owners: the cluster (one per `pdserve up --ray`, or per test) creates the registry, the
instance actors and the router actor, and kills them in `stop`; Ray places them, restarts
a crashed one (`max_restarts`, a new incarnation that registers itself) and takes the
actors of a node that leaves with it. The router learns every change from the registry
(`pdserve.router.membership`). What the cluster adds to Ray:

- placement preference: prefill instances on one half of the alive nodes and decode
  instances on the other (soft node affinity: Ray may place or restart them elsewhere),
  the router and the registry on the driver's node; each instance asks for `actor_cpus`
  CPUs and, on a node that has GPUs, one GPU;
- scaling: `add_instance` and `remove_instance`, which drains first (the registry marks it
  draining, the router acknowledges that it picks it no more, the instance's own `/load`
  shows nothing running, waiting or held), then kills the actor;
- `changes`: what moved or restarted since the last call, for `pdserve up`'s table, and
  actors found dead for good (their node left, or `max_restarts` used up) removed from
  the registry, so the router ejects them.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import msgspec

from pdserve import http_client
from pdserve.cluster.ray_actors import (
    InstanceActorSpec,
    RouterActorSpec,
    remote_classes,
)
from pdserve.cluster.ray_local import (
    RAY_GROUP,
    RayConnection,
    RaySession,
    connect,
    connected,
    disconnect,
)
from pdserve.cluster.registry import InstanceRecord
from pdserve.faults import NO_FAULTS, Faults
from pdserve.http_client import Client, HttpError
from pdserve.launcher import ClusterConfig
from pdserve.options import from_flag, option
from pdserve.server.load_report import LoadReport
from pdserve.transfer.cluster_auth import route_headers

log = logging.getLogger(__name__)

Role = Literal["prefill", "decode"]
DRAIN_POLL_S = 0.25
DRAIN_IDLE_POLLS = 3  # consecutive idle /load answers before an instance is stopped


@dataclass(frozen=True)
class RayClusterConfig:
    """What `pdserve up --ray` starts: the cluster as without Ray, and Ray's side."""

    cluster: ClusterConfig
    connection: RayConnection = field(default_factory=RayConnection)
    actor_cpus: float = option(
        1.0,
        group=RAY_GROUP,
        metavar="N",
        help="CPUs each instance actor asks for (default: %(default)s; also its --threads)",
    )
    max_restarts: int = from_flag("--max-restarts", 3)  # `pdserve up`'s, for each actor
    drain_timeout_s: float = 120.0
    faults: Faults = NO_FAULTS  # tests only (pdserve.faults): injected into every instance


@dataclass
class _Actor:
    name: str
    role: Role
    handle: Any
    record: InstanceRecord


class RayCluster:
    """See the module doc. Not thread-safe: one driver thread calls it."""

    def __init__(self, config: RayClusterConfig, cluster_token: str) -> None:
        self.config = config
        self.cluster_token = cluster_token
        self._actors: dict[str, _Actor] = {}
        self._next_index: dict[Role, int] = {"prefill": 0, "decode": 0}
        self._registry: Any = None
        self._router: Any = None
        self.router_url = ""
        self.router_pid = 0
        self._connected = False
        self._session: RaySession | None = None  # set when `start` connected

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> RayCluster:
        """Connect to Ray, start the registry, the instances (in parallel) and the router;
        returns once the router has admitted every instance. Stops what it started if any
        of it fails."""
        if not connected():
            self._session = connect(self.config.connection)
        self._connected = True
        import ray

        try:
            registry_cls, _, _ = remote_classes()
            # On the driver's node, like the router: its state must outlive any other node.
            here = ray.get_runtime_context().get_node_id()
            self._registry = registry_cls.options(
                num_cpus=0, scheduling_strategy=_soft_affinity(here, soft=False)
            ).remote()
            c = self.config.cluster
            pending = [self._create("prefill") for _ in range(c.num_prefill)]
            pending += [self._create("decode") for _ in range(c.num_decode)]
            for actor in pending:
                self._await_record(actor)
            self._start_router()
            self.wait_router_sees(len(pending))
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Kill the router, the instances and the registry; leave Ray if `start` connected
        (a local cluster stops with it; a caller's connection is left to the caller)."""
        import ray

        if not self._connected:
            return
        for handle in (self._router, *(a.handle for a in self._actors.values()), self._registry):
            if handle is not None:
                ray.kill(handle, no_restart=True)
        self._actors.clear()
        self._router = self._registry = None
        if self._session is not None:
            disconnect(self._session)
            self._session = None
        self._connected = False

    def __enter__(self) -> RayCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- scaling --------------------------------------------------------------------------

    def add_instance(self, role: Role) -> InstanceRecord:
        """Start one more instance of `role`; returns once it has registered (the router
        admits it within a health round)."""
        return self._await_record(self._create(role))

    def remove_instance(self, name: str) -> None:
        """Drain `name` (module doc), then kill its actor and forget it."""
        import ray

        actor = self._actors[name]
        version = ray.get(self._registry.set_draining.remote(name))
        deadline = time.monotonic() + self.config.drain_timeout_s
        while ray.get(self._registry.acknowledged.remote()) < version:
            _before(deadline, f"the router did not stop picking {name}")
            time.sleep(DRAIN_POLL_S)
        self._wait_idle(actor, deadline)
        ray.kill(actor.handle, no_restart=True)
        ray.get(self._registry.remove.remote(name))
        del self._actors[name]
        log.info("%s drained and stopped", name)

    def names(self, role: Role) -> list[str]:
        """The instances of `role` the cluster runs, oldest first."""
        return [a.name for a in self._actors.values() if a.role == role]

    # -- state ----------------------------------------------------------------------------

    def records(self) -> list[InstanceRecord]:
        """Every instance's current incarnation, as registered."""
        import ray

        return sorted(ray.get(self._registry.records.remote()), key=_table_order)

    def changes(self) -> list[str]:
        """What happened since the last call: restarts and moves (as registered), and
        actors dead for good (removed, so the router ejects them). One line each."""
        import ray

        lines = []
        current = {r.name: r for r in ray.get(self._registry.records.remote())}
        for name, actor in list(self._actors.items()):
            new = current.get(name)
            if new is not None and new.pid != actor.record.pid:
                where = "moved to" if new.node_id != actor.record.node_id else "back on"
                lines.append(f"{name} restarted by Ray (restart {new.restarts}), {where} node")
                actor.record = new
            elif not _alive(actor.handle):
                ray.get(self._registry.remove.remote(name))
                del self._actors[name]
                lines.append(f"{name} is gone for good (its node left or it used up its restarts)")
        return lines

    def load(self, name: str) -> LoadReport | None:
        """`name`'s current `/load` (None if it does not answer)."""
        return _load(self._actors[name].record.url, self.cluster_token)

    def wait_router_sees(self, count: int, timeout_s: float | None = None) -> None:
        """Wait until the router has admitted `count` instances."""
        deadline = time.monotonic() + (timeout_s or self.config.cluster.startup_timeout_s)
        with Client(timeout_s=2.0) as client:
            while True:
                try:
                    body = client.get(f"{self.router_url}/health").json()
                    if sum(body[r]["healthy"] for r in ("prefill", "decode")) == count:
                        return
                except (HttpError, ValueError, KeyError, TypeError):
                    pass
                _before(deadline, f"the router did not admit {count} instances")
                time.sleep(DRAIN_POLL_S)

    # -- starting -------------------------------------------------------------------------

    def _create(self, role: Role) -> _Actor:
        _, instance_cls, _ = remote_classes()
        c = self.config.cluster
        index = self._next_index[role]
        self._next_index[role] += 1
        name = f"{role}-{index}"
        spec = InstanceActorSpec(
            name,
            role,
            c.kv_transfer,
            c.transport,
            c.model,
            threads=max(1, math.floor(self.config.actor_cpus)),
            extra_args=c.instance_args,
            startup_timeout_s=c.startup_timeout_s,
            faults=self.config.faults,
        )
        node = self._preferred_node(role, index)
        options: dict[str, Any] = {
            "num_cpus": self.config.actor_cpus,
            "max_restarts": self.config.max_restarts,
            "max_task_retries": 0,
        }
        if node is not None:
            options["scheduling_strategy"] = _soft_affinity(node["NodeID"])
            if node.get("Resources", {}).get("GPU"):
                options["num_gpus"] = 1
        handle = instance_cls.options(**options).remote(spec, self.cluster_token, self._registry)
        placeholder = InstanceRecord(name, role, "", 0, "", "")
        actor = _Actor(name, role, handle, placeholder)
        self._actors[name] = actor
        return actor

    def _await_record(self, actor: _Actor) -> InstanceRecord:
        import ray

        actor.record = ray.get(actor.handle.record.remote())
        return actor.record

    def _preferred_node(self, role: Role, index: int) -> dict[str, Any] | None:
        """Prefill on the first half of the alive nodes (the driver's first), decode on
        the second; None with one node (nothing to prefer)."""
        import ray

        here = ray.get_runtime_context().get_node_id()
        nodes = sorted(
            (n for n in ray.nodes() if n["Alive"]), key=lambda n: (n["NodeID"] != here, n["NodeID"])
        )
        if len(nodes) < 2:
            return None
        half = (len(nodes) + 1) // 2
        group = nodes[:half] if role == "prefill" else nodes[half:]
        return group[index % len(group)]

    def _start_router(self) -> None:
        import ray

        _, _, router_cls = remote_classes()
        c = self.config.cluster
        spec = RouterActorSpec(
            kv_transfer=c.kv_transfer or "push",
            policy=c.policy,
            host=c.host,
            port=c.port,
            api_key=c.api_key,
            request_timeout_s=c.request_timeout_s,
            local_prefill_below=c.local_prefill_below,
            log_level=c.router_log_level or "info",
        )
        here = ray.get_runtime_context().get_node_id()
        self._router = router_cls.options(
            num_cpus=0,
            max_restarts=self.config.max_restarts,
            scheduling_strategy=_soft_affinity(here, soft=False),
        ).remote(spec, self.cluster_token, self._registry)
        self.router_url, self.router_pid = ray.get(self._router.where.remote())

    def _wait_idle(self, actor: _Actor, deadline: float) -> None:
        idle = 0
        while idle < DRAIN_IDLE_POLLS:
            _before(deadline, f"{actor.name} did not finish its requests")
            report = _load(actor.record.url, self.cluster_token)
            busy = report is None or (
                report.num_running + report.num_waiting + report.num_waiting_for_kv > 0
                or report.kv_blocks_used > 0
            )
            idle = 0 if busy else idle + 1
            time.sleep(DRAIN_POLL_S)


def with_counts(config: RayClusterConfig, num_prefill: int, num_decode: int) -> RayClusterConfig:
    """`config` with other instance counts."""
    cluster = replace(config.cluster, num_prefill=num_prefill, num_decode=num_decode)
    return replace(config, cluster=cluster)


def _table_order(r: InstanceRecord) -> tuple[bool, str]:
    return (r.role != "prefill", r.name)


def _soft_affinity(node_id: str, soft: bool = True) -> Any:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(node_id=node_id, soft=soft)


def _alive(handle: Any, attempts: int = 10) -> bool:
    """False once Ray says the actor is dead for good. Calls made before Ray has noticed
    the death (a node that left: seconds) fail with ActorDiedError even if Ray then
    restarts it, so only fresh calls that keep failing that way for about 15 s count; a
    call to a restarting actor waits."""
    import ray

    for attempt in range(attempts):
        try:
            ray.get(handle.record.remote(), timeout=5.0)
            return True
        except (ray.exceptions.GetTimeoutError, ray.exceptions.ActorUnavailableError):
            return True
        except ray.exceptions.ActorDiedError:
            if attempt + 1 < attempts:
                time.sleep(1.5)
    return False


def _load(url: str, token: str) -> LoadReport | None:
    try:
        headers = route_headers(token, "/load")
        r = http_client.get(f"{url}/load", headers, timeout_s=2.0)
        r.raise_for_status()
        return msgspec.json.decode(r.body, type=LoadReport)
    except (HttpError, msgspec.DecodeError):
        return None


def _before(deadline: float, what: str) -> None:
    if time.monotonic() > deadline:
        raise TimeoutError(what)
