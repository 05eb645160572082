"""Keeping a started `Cluster` serving: a child that dies is started again on its ports.

`Supervisor` watches every child of a cluster (prefill, decode, monolithic instances and the
router). When one exits, its `RestartBudget` (`pdserve.restarts`) decides: start it again
after a backoff, with the same command, ports and cores (`Cluster.respawn`: a new process,
so for an instance a new incarnation), or give up on it after too many failures within a
window. The routers' health checks do the rest: they eject the dead instance and admit it
again once it answers. A restart that never becomes healthy within the cluster's
`startup_timeout_s` is killed and counts as another failure.

Every child moves through `ChildState`s on its own: one `poll` looks at each child once and
never waits on any of them (a health probe is one bounded HTTP call), so a slow restart
never holds up another child's. `run` polls until the cluster is lost (or told to stop);
`background` runs that loop on a thread, for tests and the soak bench.

Giving up: on a prefill instance the cluster goes on (`NoPrefillLeft` once none is left:
the router then prefills on the decode instances); without the router, any decode instance
or (monolithic) the instance, it cannot serve: `run` returns the `Loss` and the caller
stops the cluster.

Ownership: the cluster owns the processes and stops them; the supervisor owns each child's
state and budget and the event list, all behind one lock (`kill` may come from another
thread). Stop the supervisor before stopping the cluster, or it restarts what is stopped.
"""

from __future__ import annotations

import contextlib
import enum
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from pdserve.http_client import Client
from pdserve.launcher import Cluster, ManagedProcess, is_healthy
from pdserve.restarts import GiveUp, Restart, RestartBudget, RestartPolicy, Verdict
from pdserve.stop_request import StopCheck
from pdserve.threads import Thread


class ChildState(enum.Enum):
    RUNNING = "running"  # started and healthy once (or since the cluster started)
    WAITING = "waiting"  # dead; restarted at its due time
    STARTING = "starting"  # restarted; not healthy yet
    GIVEN_UP = "given up"  # dead for good


class Loss(enum.Enum):
    """Why the cluster cannot serve any more."""

    ROUTER = "the router was given up"
    DECODE = "every decode instance was given up"
    INSTANCE = "the instance was given up"  # monolithic


@dataclass(frozen=True)
class Died:
    """The child exited by itself (or was killed) with `code` (-N: signal N)."""

    code: int


@dataclass(frozen=True)
class NeverHealthy:
    """A restart did not answer /health within `after_s`; the supervisor killed it."""

    after_s: float


Failure = Died | NeverHealthy


@dataclass(frozen=True)
class ChildFailed:
    name: str
    pid: int
    failure: Failure
    verdict: Verdict
    policy: RestartPolicy


@dataclass(frozen=True)
class ChildBack:
    name: str
    pid: int
    restarts: int  # times started again since the cluster started


@dataclass(frozen=True)
class NoPrefillLeft:
    """Every prefill instance was given up; decode instances go on serving alone."""


@dataclass(frozen=True)
class ClusterLost:
    loss: Loss


Event = ChildFailed | ChildBack | NoPrefillLeft | ClusterLost
Probe = Callable[[Client, ManagedProcess], bool]  # is this (restarted) child healthy?


def describe(event: Event) -> str:
    """One status line for `event` (without the command's prefix)."""
    match event:
        case ChildFailed(name, pid, failure, verdict, policy):
            what = (
                f"exited with code {failure.code}"
                if isinstance(failure, Died)
                else f"was not healthy {failure.after_s:.0f} s after its restart; killed it"
            )
            window = f"in {policy.window_s:g} s"
            if isinstance(verdict, Restart):
                then = (
                    f"restarting in {verdict.delay_s:g} s (restart {verdict.attempt} of "
                    f"{policy.max_restarts} {window})"
                )
            else:
                then = (
                    f"giving up on it ({verdict.failures} failures {window}, more than the "
                    f"{policy.max_restarts} restarts allowed)"
                )
            return f"{name} (pid {pid}) {what}; {then}"
        case ChildBack(name, pid, restarts):
            return f"{name} back (pid {pid}, restarts {restarts})"
        case NoPrefillLeft():
            return (
                "every prefill instance was given up; going on without them (the router "
                "prefills on the decode instances)"
            )
        case ClusterLost(loss):
            return f"{loss.value}; the cluster cannot serve: stopping it"
    raise TypeError(f"not an event: {event!r}")


@dataclass
class _Child:
    """One child's supervision (owned by `Supervisor`, under its lock)."""

    name: str
    role: str
    budget: RestartBudget
    state: ChildState = ChildState.RUNNING
    due: float = 0.0  # WAITING: when to restart; STARTING: when it was started


class Supervisor:
    """Restarts the children of a started `Cluster`; see the module docstring."""

    def __init__(
        self,
        cluster: Cluster,
        policy: RestartPolicy | None = None,
        *,
        on_event: Callable[[Event], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        probe: Probe = is_healthy,
        health_timeout_s: float = 1.0,
    ) -> None:
        self.cluster = cluster
        self.policy = policy or RestartPolicy()
        self.events: list[Event] = []  # everything reported, in order
        self.lost: Loss | None = None
        self._on_event = on_event
        self._clock = clock
        self._probe = probe
        self._health_timeout_s = health_timeout_s
        self._lock = threading.Lock()
        self._children = {
            p.name: _Child(p.name, p.role, RestartBudget(self.policy)) for p in cluster.processes
        }

    # -- queries (any thread) -------------------------------------------------------------

    def state(self, name: str) -> ChildState:
        with self._lock:
            return self._children[name].state

    def running_pid(self, name: str) -> int | None:
        """The child's PID while it is RUNNING (healthy since its last start), else None."""
        with self._lock:
            if self._children[name].state is not ChildState.RUNNING:
                return None
            return self.cluster.process(name).pid

    def all_running(self) -> bool:
        with self._lock:
            return all(c.state is ChildState.RUNNING for c in self._children.values())

    def restarts(self) -> dict[str, int]:
        """Times each child was started again."""
        with self._lock:
            return {name: self.cluster.process(name).restarts for name in self._children}

    def given_up(self) -> list[str]:
        with self._lock:
            return [c.name for c in self._children.values() if c.state is ChildState.GIVEN_UP]

    # -- actions --------------------------------------------------------------------------

    def kill(self, name: str, sig: int = signal.SIGKILL) -> int | None:
        """Send `sig` to the child's PID if it is RUNNING (never to a PID already reaped);
        the PID signalled, else None. The next `poll` sees it die and restarts it."""
        with self._lock:
            if self._children[name].state is not ChildState.RUNNING:
                return None
            proc = self.cluster.process(name)
            if not proc.alive():
                return None
            os.kill(proc.pid, sig)
            return proc.pid

    def poll(self, client: Client | None = None) -> Loss | None:
        """Look at every child once and act on what changed; the `Loss` once the cluster
        cannot serve (then nothing more is restarted)."""
        with self._lock, contextlib.ExitStack() as stack:
            if client is None:
                client = stack.enter_context(self._client())
            for child in self._children.values():
                if self.lost is None:
                    self._step(child, client)
            return self.lost

    def run(self, stop: StopCheck | None = None, poll_s: float = 0.2) -> Loss | None:
        """Poll until the cluster is lost (returned) or `stop` is set (None)."""
        stop = stop or threading.Event()
        with self._client() as client:
            while not stop.is_set():
                if (lost := self.poll(client)) is not None:
                    return lost
                stop.wait(poll_s)
        return None

    @contextlib.contextmanager
    def background(self, poll_s: float = 0.2) -> Iterator[Supervisor]:
        """`run` on a thread for the duration of the block (stopped and joined at its end,
        before the caller stops the cluster)."""
        stop = threading.Event()
        thread = Thread(target=self.run, args=(stop, poll_s), name="supervisor")
        thread.start()
        try:
            yield self
        finally:
            stop.set()
            thread.join()

    # -- one child ------------------------------------------------------------------------

    def _client(self) -> Client:
        return Client(timeout_s=self._health_timeout_s)

    def _step(self, child: _Child, client: Client) -> None:
        proc = self.cluster.process(child.name)
        now = self._clock()
        match child.state:
            case ChildState.RUNNING if not proc.alive():
                self._failed(child, proc, Died(proc.popen.returncode), now)
            case ChildState.WAITING if now >= child.due:
                self.cluster.respawn(child.name)
                child.state, child.due = ChildState.STARTING, now
            case ChildState.STARTING:
                self._starting(child, proc, client, now)

    def _starting(self, child: _Child, proc: ManagedProcess, client: Client, now: float) -> None:
        if not proc.alive():
            self._failed(child, proc, Died(proc.popen.returncode), now)
        elif self._probe(client, proc):
            child.state = ChildState.RUNNING
            self._emit(ChildBack(child.name, proc.pid, proc.restarts))
        elif now - child.due > self.cluster.config.startup_timeout_s:
            proc.popen.kill()
            proc.popen.wait()
            self._failed(child, proc, NeverHealthy(now - child.due), now)

    def _failed(self, child: _Child, proc: ManagedProcess, failure: Failure, now: float) -> None:
        verdict = child.budget.failed(now)
        self._emit(ChildFailed(child.name, proc.pid, failure, verdict, self.policy))
        match verdict:
            case Restart(delay_s):
                child.state, child.due = ChildState.WAITING, now + delay_s
            case GiveUp():
                child.state = ChildState.GIVEN_UP
                self._check_loss(child.role)

    def _check_loss(self, role: str) -> None:
        alive = [
            c
            for c in self._children.values()
            if c.role == role and c.state is not ChildState.GIVEN_UP
        ]
        if alive:
            return
        if role == "prefill":
            self._emit(NoPrefillLeft())
            return
        self.lost = {"router": Loss.ROUTER, "decode": Loss.DECODE}.get(role, Loss.INSTANCE)
        self._emit(ClusterLost(self.lost))

    def _emit(self, event: Event) -> None:
        self.events.append(event)
        if self._on_event is not None:
            self._on_event(event)
