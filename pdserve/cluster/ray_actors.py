"""The actors of a Ray cluster: the registry, one per instance, the router.

Each instance actor's process is the instance: `pdserve serve` runs in it (HTTP server,
engine, connector and transport, exactly as in a process of `pdserve up`), on ports picked
on the actor's node when the process starts. Ray owns the process: it places it, restarts
it after a crash (`max_restarts`; the constructor then runs again, on new ports, and
registers the new incarnation) and kills it. If the server inside stops on its own (its
engine died), the process exits, so that the failure is Ray's to handle like a crash.

The router actor serves the OpenAI front door from its process too, on the node it was
placed on (the head node, by `RayCluster`), and follows the registry
(`pdserve.router.membership`). The classes here are plain; `remote_classes` makes them
Ray actor classes (imported lazily, so this module loads without Ray).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Literal

from pdserve.cluster.registry import InstanceRecord, Registry
from pdserve.faults import NO_FAULTS, Faults
from pdserve.http_client import Client, HttpError
from pdserve.launcher import TOKEN_ENV
from pdserve.ports import bind_socket, free_ports
from pdserve.router.membership import Membership
from pdserve.threads import Thread

log = logging.getLogger(__name__)

ActorRole = Literal["prefill", "decode", "both"]
HEALTH_POLL_S = 0.2


@dataclass(frozen=True)
class InstanceActorSpec:
    """One instance actor: what `pdserve serve` is told, less the host and ports."""

    name: str
    role: ActorRole
    kv_transfer: Literal["pull", "push"] | None
    transport: str
    model: str | None
    threads: int
    extra_args: tuple[str, ...] = ()
    startup_timeout_s: float = 300.0
    faults: Faults = NO_FAULTS  # tests only (pdserve.faults)

    def serve_argv(self, host: str, port: int, side_port: int) -> list[str]:
        argv = ["--role", self.role, "--host", host, "--port", str(port)]
        if self.kv_transfer is not None:
            argv += ["--kv-transfer", self.kv_transfer, "--transport", self.transport]
            argv += ["--kv-host", host, "--side-channel-port", str(side_port)]
        if self.model is not None:
            argv += ["--model", self.model]
        return [*argv, "--threads", str(self.threads), *self.extra_args]


def node_ip() -> str:
    """The address of the Ray node this process runs on (127.0.0.1 on a loopback cluster).

    The node's own record, not `ray.util.get_node_ip_address()`: that one picks the address
    of the host's default route, which a loopback cluster on a host with a network does not
    listen on."""
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node.get("NodeID") == node_id:
            return str(node["NodeManagerAddress"])
    return ray.util.get_node_ip_address()


class InstanceHost:
    """One pdserve instance in this actor process; see the module doc."""

    def __init__(self, spec: InstanceActorSpec, cluster_token: str, registry: Any) -> None:
        import ray

        from pdserve.server.serve import main as serve_main
        from pdserve.server.serve_args import config_from_argv

        os.environ[TOKEN_ENV] = cluster_token  # what `pdserve serve` reads
        host = node_ip()
        port, side_port = free_ports(2, host)
        cfg = config_from_argv(spec.serve_argv(host, port, side_port))
        self.url = f"http://{host}:{port}"
        server = Thread(target=serve_main, args=(cfg, spec.faults), name="pdserve-serve")
        server.start()
        Thread(target=_exit_after, args=(server,), daemon=True).start()
        _wait_serving(self.url, server, spec.startup_timeout_s)
        ctx = ray.get_runtime_context()
        record = InstanceRecord(
            spec.name, _registry_role(spec.role), self.url, os.getpid(), ctx.get_node_id(), host
        )
        self._record = ray.get(registry.register.remote(record)) if registry else record

    def record(self) -> InstanceRecord:
        """Where this incarnation serves (the registry's copy, with its restart count)."""
        return self._record


def _registry_role(role: ActorRole) -> Literal["prefill", "decode"]:
    return "prefill" if role == "prefill" else "decode"


def _exit_after(server: threading.Thread) -> None:
    """The server stopped by itself: end the process, so Ray restarts it."""
    server.join()
    log.error("the instance's server stopped: exiting so that Ray restarts this actor")
    os._exit(1)


def _wait_serving(url: str, server: threading.Thread, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    with Client(timeout_s=2.0) as client:
        while time.monotonic() < deadline:
            if not server.is_alive():
                raise RuntimeError(f"the instance at {url} stopped during start-up")
            try:
                if client.get(f"{url}/health").status == 200:
                    return
            except HttpError:
                pass
            time.sleep(HEALTH_POLL_S)
    raise RuntimeError(f"the instance at {url} was not healthy within {timeout_s:.0f} s")


@dataclass(frozen=True)
class RouterActorSpec:
    """The router actor: what `pdserve router` is told, less the instances' URLs."""

    kv_transfer: Literal["pull", "push"]
    policy: str = "round_robin"
    host: str = "127.0.0.1"
    port: int | None = None  # None: a free one
    api_key: str | None = None
    request_timeout_s: float | None = None
    local_prefill_below: int | None = None
    log_level: str = "info"


class RegistrySource:
    """The router's membership source backed by the registry actor."""

    def __init__(self, registry: Any) -> None:
        self._registry = registry

    async def current(self) -> Membership:
        return await self._registry.membership.remote()

    async def acknowledge(self, version: int) -> None:
        await self._registry.acknowledge.remote(version)


class RouterHost:
    """The router in this actor process, following the registry; see the module doc."""

    def __init__(self, spec: RouterActorSpec, cluster_token: str, registry: Any) -> None:
        import ray

        from pdserve.httpd.bootstrap import LISTEN_BACKLOG

        records = ray.get(registry.records.remote())
        config = _router_config(spec, cluster_token, records)
        sock = bind_socket(config.host, config.port)
        sock.listen(LISTEN_BACKLOG)
        self.url = f"http://{config.host}:{config.port}"
        server = Thread(
            target=_serve_router,
            args=(config, sock, spec.log_level, RegistrySource(registry)),
            name="pdserve-router",
        )
        server.start()
        Thread(target=_exit_after, args=(server,), daemon=True).start()
        _wait_serving(self.url, server, 60.0)
        self.pid = os.getpid()

    def where(self) -> tuple[str, int]:
        """The router's URL and PID."""
        return self.url, self.pid


def _router_config(spec: RouterActorSpec, token: str, records: list[InstanceRecord]) -> Any:
    from pdserve.router.config import RouterConfig

    urls = {r: tuple(x.url for x in records if x.role == r) for r in ("prefill", "decode")}
    optional: dict[str, Any] = {}
    if spec.request_timeout_s is not None:
        optional["request_timeout_s"] = spec.request_timeout_s
    if spec.local_prefill_below is not None:
        optional["local_prefill_below"] = spec.local_prefill_below
    return RouterConfig(
        prefill_urls=urls["prefill"],
        decode_urls=urls["decode"],
        kv_transfer=spec.kv_transfer,
        policy=spec.policy,  # type: ignore[arg-type]
        host=spec.host,
        port=spec.port or free_ports(1, spec.host)[0],
        api_key=spec.api_key,
        cluster_token=token,
        **optional,
    )


def _serve_router(config: Any, sock: Any, log_level: str, source: RegistrySource) -> None:
    from pdserve.router.serve import serve_on

    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    serve_on(config, sock, log_level, membership=source)


def remote_classes() -> tuple[Any, Any, Any]:
    """The Ray actor classes of `Registry`, `InstanceHost` and `RouterHost`."""
    import ray

    return ray.remote(Registry), ray.remote(InstanceHost), ray.remote(RouterHost)
