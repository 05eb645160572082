"""`pdserve up` on one host: start a `pdserve.launcher.Cluster`, print where it is, and
supervise it (pdserve.supervisor) until Ctrl-C or SIGTERM, or until it cannot serve any more.

After the start, `main` hands the cluster to a `Supervisor`, which restarts any child that
dies (with backoff, giving up after `--max-restarts` failures within `--restart-window`) and
prints a status line for each restart and return. `up` ends with exit status 1 only once
the cluster cannot serve (router, every decode instance or the monolithic instance given
up); Ctrl-C or SIGTERM stops every child by PID, one being restarted included: once the
cluster is supervised, a signal only asks the supervisor's loop to return
(`pdserve.stop_request`), so it never interrupts a restart between the child's start and its
recording.

Here, above both the launcher and the supervisor, so that neither imports the other's user.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.launcher import Cluster, ClusterConfig, ClusterError, ManagedProcess
from pdserve.restarts import GiveUp, RestartPolicy
from pdserve.server.exposure import up_warning
from pdserve.stop_request import StopRequest
from pdserve.supervisor import ChildBack, ChildFailed, Event, Supervisor, describe

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LocalUpCommand:
    """What `pdserve up` runs on one host (built from its flags by pdserve.cluster.up_args):
    the cluster, how its children are restarted, and whether a clean exit keeps a temporary
    log folder."""

    cluster: ClusterConfig
    restarts: RestartPolicy = field(default_factory=RestartPolicy)
    keep_logs: bool = False


def main(up: LocalUpCommand) -> int:
    """Start the cluster, print where it is, and supervise it (restarting children that die)
    until Ctrl-C or SIGTERM, or until it cannot serve any more (exit status 1)."""
    logging.basicConfig(level=logging.INFO, format="pdserve up: %(message)s")
    policy = up.restarts
    cluster = Cluster(up.cluster)
    if warning := up_warning(cluster.config.host, cluster.config.api_key):
        log.warning("WARNING: %s", warning)  # this format shows no level name
    supervisor = lambda: Supervisor(cluster, policy, on_event=_printer(cluster))  # noqa: E731
    stop = StopRequest()
    status = 1
    try:
        with stop.installed():
            try:
                print(f"pdserve up: starting; logs in {cluster.log_dir}", flush=True)
                status = _run(cluster, supervisor, stop)
            finally:
                stop.armed = True  # a second Ctrl-C must not cut the stop short
                cluster.stop()
    finally:
        _after_stop(cluster, status, keep_logs=up.keep_logs)
    return status


def _run(cluster: Cluster, supervisor: Callable[[], Supervisor], stop: StopRequest) -> int:
    """Start, then supervise until told to stop (0) or the cluster cannot serve (1). The
    supervisor is made once the cluster has started: it watches the children it finds."""
    try:
        cluster.start()
        stop.armed = True  # before the summary: a caller may signal as soon as it reads it
        _print_summary(cluster, cluster.write_token_file())
        if supervisor().run(stop.requested) is not None:
            return 1  # the cluster cannot serve any more (the supervisor said why)
        print("pdserve up: stopping", flush=True)
        return 0
    except KeyboardInterrupt:
        print("pdserve up: stopping", flush=True)
        return 0
    except ClusterError as exc:
        print(f"pdserve up: {exc}", file=sys.stderr, flush=True)
        return 1


def _printer(cluster: Cluster) -> Callable[[Event], None]:
    return lambda event: _print_event(cluster, event)


def _after_stop(cluster: Cluster, status: int, keep_logs: bool) -> None:
    """A clean exit deletes the temporary log folder (unless kept); a failure keeps it."""
    if status == 0 and not keep_logs and cluster.remove_log_dir():
        print("pdserve up: stopped; logs removed (--keep-logs keeps them)", flush=True)
    elif cluster.log_dir.exists():
        print(f"pdserve up: stopped; logs in {cluster.log_dir}", flush=True)


def _print_summary(cluster: Cluster, token_path: Path) -> None:
    c = cluster.config
    what = "monolithic" if c.monolithic else f"kv-transfer {c.kv_transfer}, policy {c.policy}"
    if c.engine == "vllm":
        what += ", engine vllm" + ("" if c.monolithic else f", connector {c.connector}")
    print(f"\npdserve up: ready ({what})\n  URL      {cluster.router_url}", flush=True)
    for p in cluster.processes:
        print(_status_row(p))
    print(f"  cluster token in {token_path}", flush=True)
    print("Ctrl-C stops everything.", flush=True)


def _status_row(p: ManagedProcess) -> str:
    """One process's line of the status table (printed again after each restart)."""
    cores = ",".join(map(str, p.cores)) if p.cores else "-"
    return (
        f"  {p.role:<8} {p.url:<24} pid {p.pid:<8} cores {cores:<6} "
        f"restarts {p.restarts:<3} log {p.log_path}"
    )


def _print_event(cluster: Cluster, event: Event) -> None:
    """A supervisor's event as `pdserve up` status lines: restarts on stdout (with the
    process's updated table row once it is back), give-ups and the end on stderr."""
    line = f"pdserve up: {describe(event)}"
    if isinstance(event, ChildBack):
        print(f"{line}\n{_status_row(cluster.process(event.name))}", flush=True)
    elif isinstance(event, ChildFailed) and not isinstance(event.verdict, GiveUp):
        print(line, flush=True)
    else:
        tail = ""
        if isinstance(event, ChildFailed):
            tail = f" Its log ends:\n{cluster.process(event.name).log_tail()}"
        print(f"{line}{tail}", file=sys.stderr, flush=True)
