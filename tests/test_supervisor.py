"""The restart policy and the supervisor's decisions, without processes (fake clock, fake
children), then with the launcher's real processes and fake instances (`pdserve up` too)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from pdserve.launcher import TOKEN_ENV, Cluster, ClusterConfig, ManagedProcess
from pdserve.restarts import GiveUp, Restart, RestartBudget, RestartPolicy
from pdserve.supervisor import (
    ChildBack,
    ChildFailed,
    ChildState,
    ClusterLost,
    Died,
    Loss,
    NeverHealthy,
    NoPrefillLeft,
    Supervisor,
    describe,
)
from tests.test_launcher_cluster import _assert_gone, _pids, _run_up, fake_command

# -- the policy -----------------------------------------------------------------------------


def test_backoff_doubles_to_the_cap_then_gives_up() -> None:
    budget = RestartBudget(RestartPolicy(max_restarts=5, window_s=300, backoff_max_s=3))
    verdicts = [budget.failed(now) for now in (0, 1, 2, 3, 4, 5)]
    assert verdicts[:5] == [
        Restart(0.5, 1),
        Restart(1.0, 2),
        Restart(2.0, 3),
        Restart(3.0, 4),  # capped
        Restart(3.0, 5),
    ]
    assert verdicts[5] == GiveUp(failures=6)


def test_failures_older_than_the_window_are_forgotten() -> None:
    budget = RestartBudget(RestartPolicy(max_restarts=2, window_s=10))
    assert budget.failed(0) == Restart(0.5, 1)
    assert budget.failed(5) == Restart(1.0, 2)
    assert budget.recent(9.9) == 2 and budget.recent(10.0) == 1  # the one at 0 has left
    assert budget.failed(10) == Restart(1.0, 2)  # 5 and 10 are within the window
    assert budget.failed(11) == GiveUp(failures=3)
    later = RestartBudget(RestartPolicy(max_restarts=2, window_s=10))
    assert [later.failed(t) for t in (0, 20, 40, 60)] == [Restart(0.5, 1)] * 4


def test_zero_restarts_gives_up_at_once_and_bad_policies_are_refused() -> None:
    assert RestartBudget(RestartPolicy(max_restarts=0)).failed(0) == GiveUp(failures=1)
    for bad in (
        {"max_restarts": -1},
        {"window_s": 0},
        {"backoff_s": 5, "backoff_max_s": 1},
        {"backoff_s": -1},
    ):
        with pytest.raises(ValueError):
            RestartPolicy(**bad)


def test_status_lines() -> None:
    policy = RestartPolicy()
    restart = ChildFailed("decode-0", 123, Died(-9), Restart(0.5, 1), policy)
    assert describe(restart) == (
        "decode-0 (pid 123) exited with code -9; restarting in 0.5 s (restart 1 of 5 in 300 s)"
    )
    give_up = ChildFailed("prefill-0", 7, NeverHealthy(300.0), GiveUp(6), policy)
    text = describe(give_up)
    assert "not healthy 300 s after its restart" in text and "giving up on it" in text
    assert describe(ChildBack("decode-0", 456, 1)) == "decode-0 back (pid 456, restarts 1)"
    assert "decode instances" in describe(NoPrefillLeft())
    assert "every decode instance" in describe(ClusterLost(Loss.DECODE))


# -- the supervisor's decisions, with fake children ------------------------------------------


class FakePopen:
    """Stands in for a child's Popen: dies when told."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            self.returncode = -9

    def wait(self, timeout: float | None = None) -> int | None:
        return self.returncode


@dataclass
class FakeCluster:
    """The part of `Cluster` a supervisor uses; `respawn` makes a new fake process."""

    roles: list[str]
    config: ClusterConfig = field(default_factory=lambda: ClusterConfig(startup_timeout_s=60))
    procs: dict[str, ManagedProcess] = field(default_factory=dict)
    pids: int = 100

    def __post_init__(self) -> None:
        counts: dict[str, int] = {}
        for role in self.roles:
            index = counts[role] = counts.get(role, -1) + 1
            name = role if role == "router" else f"{role}-{index}"
            self.procs[name] = self._new(name, role, 0)

    def _new(self, name: str, role: str, restarts: int) -> ManagedProcess:
        self.pids += 1
        popen = FakePopen(self.pids)
        proc = ManagedProcess(name, role, "http://x", popen, None, Path("/dev/null"))  # type: ignore[arg-type]
        proc.restarts = restarts
        return proc

    @property
    def processes(self) -> list[ManagedProcess]:
        return list(self.procs.values())

    def process(self, name: str) -> ManagedProcess:
        return self.procs[name]

    def respawn(self, name: str) -> ManagedProcess:
        old = self.procs[name]
        self.procs[name] = self._new(name, old.role, old.restarts + 1)
        return self.procs[name]

    def die(self, name: str, code: int = -9) -> None:
        self.procs[name].popen.returncode = code


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _supervisor(
    roles: list[str], policy: RestartPolicy, healthy: set[str] | None = None
) -> tuple[Supervisor, FakeCluster, Clock]:
    cluster, clock = FakeCluster(roles), Clock()
    ok = healthy if healthy is not None else set(cluster.procs)
    sup = Supervisor(
        cluster,  # type: ignore[arg-type]
        policy,
        clock=clock,
        probe=lambda client, p: p.name in ok,
    )
    return sup, cluster, clock


def test_a_dead_child_is_restarted_after_its_backoff_and_comes_back() -> None:
    sup, cluster, clock = _supervisor(["prefill", "decode", "router"], RestartPolicy())
    old = cluster.process("decode-0")
    assert sup.poll() is None and sup.events == []
    cluster.die("decode-0")
    sup.poll()
    assert sup.events == [ChildFailed("decode-0", old.pid, Died(-9), Restart(0.5, 1), sup.policy)]
    assert sup.state("decode-0") is ChildState.WAITING and sup.running_pid("decode-0") is None
    clock.now += 0.4
    sup.poll()
    assert cluster.process("decode-0") is old  # not before its backoff
    clock.now += 0.1
    sup.poll()
    new = cluster.process("decode-0")
    assert new is not old and new.restarts == 1 and sup.state("decode-0") is ChildState.STARTING
    sup.poll()
    assert sup.events[-1] == ChildBack("decode-0", new.pid, 1)
    assert sup.running_pid("decode-0") == new.pid and sup.all_running()
    assert sup.restarts() == {"prefill-0": 0, "decode-0": 1, "router": 0}


def test_a_restart_that_never_gets_healthy_is_killed_and_counted() -> None:
    sup, cluster, clock = _supervisor(["prefill", "decode", "router"], RestartPolicy(), set())
    cluster.die("prefill-0")
    sup.poll()
    clock.now += 0.5
    sup.poll()  # restarted
    restarted = cluster.process("prefill-0")
    clock.now += 61  # past startup_timeout_s
    sup.poll()
    assert restarted.popen.returncode == -9
    event = sup.events[-1]
    assert isinstance(event, ChildFailed) and event.failure == NeverHealthy(61.0)
    assert event.verdict == Restart(1.0, 2)


def test_giving_up_on_every_prefill_goes_on_and_on_every_decode_stops() -> None:
    policy = RestartPolicy(max_restarts=0)
    sup, cluster, _ = _supervisor(["prefill", "prefill", "decode", "decode", "router"], policy)
    cluster.die("prefill-0")
    assert sup.poll() is None and sup.given_up() == ["prefill-0"]
    cluster.die("prefill-1")
    assert sup.poll() is None and isinstance(sup.events[-1], NoPrefillLeft)
    cluster.die("decode-1")
    assert sup.poll() is None  # decode-0 still serves
    cluster.die("decode-0", code=1)
    assert sup.poll() is Loss.DECODE and sup.lost is Loss.DECODE
    assert sup.events[-1] == ClusterLost(Loss.DECODE)
    cluster.die("router")
    assert sup.poll() is Loss.DECODE and sup.events[-1] == ClusterLost(Loss.DECODE)


def test_giving_up_on_the_router_or_the_monolithic_instance_stops() -> None:
    sup, cluster, _ = _supervisor(["prefill", "decode", "router"], RestartPolicy(max_restarts=0))
    cluster.die("router")
    assert sup.poll() is Loss.ROUTER
    mono, cluster, _ = _supervisor(["both"], RestartPolicy(max_restarts=0))
    cluster.die("both-0")
    assert mono.poll() is Loss.INSTANCE


def test_kill_signals_only_a_running_child() -> None:
    sup, cluster, _ = _supervisor(["prefill", "decode", "router"], RestartPolicy())
    cluster.die("decode-0")
    sup.poll()
    assert sup.kill("decode-0") is None  # dead, waiting for its restart: no PID to signal


# -- real processes (fake instances, the real router) ----------------------------------------


@pytest.mark.slow  # a 3-process cluster, two restarts
@pytest.mark.timeout(120)
def test_supervisor_restarts_an_instance_and_the_router_on_their_ports(tmp_path: Path) -> None:
    config = ClusterConfig(kv_transfer="push", log_dir=tmp_path, port=None, startup_timeout_s=60)
    with (
        Cluster(config, instance_command=fake_command) as cluster,
        Supervisor(cluster).background(poll_s=0.05) as sup,
    ):
        router = cluster.router
        assert router is not None
        environ = Path(f"/proc/{router.pid}/environ").read_bytes().split(b"\0")
        assert f"{TOKEN_ENV}={cluster.cluster_token}".encode() in environ
        assert cluster.cluster_token not in " ".join(router.popen.args)  # type: ignore[arg-type]
        for name in ("decode-0", "router"):
            old = cluster.process(name)
            assert sup.kill(name) == old.pid
            new = _wait_back(sup, name, old.pid)
            assert new.url == old.url and new.restarts == 1 and old.popen.returncode == -9
        assert httpx.get(f"{cluster.router_url}/health", timeout=5).status_code == 200
        assert sup.restarts() == {"prefill-0": 0, "decode-0": 1, "router": 1}
        procs = cluster.processes
    assert all(p.popen.returncode is not None for p in procs)
    # Stopped by SIGTERM, not killed after ignoring it: a restart inherits no blocked signal.
    assert all(p.popen.returncode != -signal.SIGKILL for p in procs), procs


def _wait_back(sup: Supervisor, name: str, old_pid: int, timeout: float = 60) -> ManagedProcess:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pid = sup.running_pid(name)
        if pid is not None and pid != old_pid:
            return sup.cluster.process(name)
        time.sleep(0.05)
    raise AssertionError(f"{name} not back: {sup.events}")


def _read_until(proc: subprocess.Popen[str], text: str, lines: list[str]) -> None:
    assert proc.stdout is not None
    while text not in (lines[-1] if lines else ""):
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"no {text!r} before the end:\n" + "".join(lines))
        lines.append(line)


@pytest.mark.slow  # `pdserve up` with fake instances
@pytest.mark.timeout(120)
def test_up_restarts_a_killed_child_and_sigterm_stops_all(tmp_path: Path) -> None:
    proc, lines = _run_up(tmp_path, "--kv-transfer", "pull")
    try:
        pids = _pids(lines)
        os.kill(pids["prefill"], signal.SIGKILL)
        _read_until(proc, "prefill-0 back", lines)
        text = "".join(lines)
        assert f"prefill-0 (pid {pids['prefill']}) exited with code -9; restarting in 0.5 s" in text
        assert "(restart 1 of 5 in 300 s)" in text
        new_pid = int(lines[-1].split("pid ")[1].split(",")[0])
        assert proc.stdout is not None
        row = proc.stdout.readline()  # the updated table row
        assert row.split()[0] == "prefill" and f"pid {new_pid} " in row and "restarts 1 " in row
        assert new_pid != pids["prefill"] and proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        _stop_up(proc)
    for pid in (*pids.values(), new_pid):
        _assert_gone(pid)


@pytest.mark.slow  # `pdserve up` with fake instances
@pytest.mark.timeout(120)
def test_up_stops_with_status_1_once_no_decode_instance_is_left(tmp_path: Path) -> None:
    proc, lines = _run_up(tmp_path, "--kv-transfer", "push", "--max-restarts", "0")
    try:
        pids = _pids(lines)
        os.kill(pids["decode"], signal.SIGKILL)
        assert proc.wait(30) == 1
        out = proc.stdout.read() if proc.stdout else ""
    finally:
        _stop_up(proc)
    assert "decode-0" in out and "giving up on it" in out
    assert "every decode instance was given up" in out
    for pid in pids.values():
        _assert_gone(pid)


def _processes_with(*parts: str) -> list[int]:
    """PIDs of live processes whose command line contains every one of `parts`."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and all(p in cmdline for p in parts):
            found.append(int(entry.name))
    return found


@pytest.mark.slow  # `pdserve up` with fake instances
@pytest.mark.timeout(120)
def test_sigterm_during_a_restart_stops_the_restarted_child_too(tmp_path: Path) -> None:
    proc, lines = _run_up(tmp_path, "--kv-transfer", "push")
    try:
        pids = _pids(lines)
        row = next(line for line in lines if line.split()[:1] == ["decode"])
        port = row.split()[1].rsplit(":", 1)[1]
        os.kill(pids["decode"], signal.SIGKILL)
        _read_until(proc, "restarting in 0.5 s", lines)
        deadline = time.monotonic() + 30
        while not _processes_with("test_router_fake_instance.py", "--port", port):
            assert time.monotonic() < deadline, "the restart never started"
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)  # the restarted child has just started: stop now
        assert proc.wait(30) == 0
    finally:
        _stop_up(proc)
    for pid in pids.values():
        _assert_gone(pid)
    assert _processes_with("test_router_fake_instance.py", "--port", port) == []


def _stop_up(proc: subprocess.Popen[str]) -> None:
    """After a failure: SIGTERM first, so that `pdserve up` still stops its children."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
