"""`pdserve up`: a local P/D cluster (prefill and decode instances plus a router) on one host.

`Cluster` is the programmatic form used by tests and benchmark sweeps:

    with Cluster(ClusterConfig(kv_transfer="push")) as cluster:
        client = OpenAI(base_url=f"{cluster.router_url}/v1", api_key="none")

`pdserve up`'s flags are declared on `ClusterConfig`; pdserve.cluster.up_args puts them on
the parser and builds the config back, so this module never sees argparse's namespace.

Processes: the cluster owns every process it starts and nothing else. Each child runs in its
own session (so a Ctrl-C in the terminal reaches only the launcher, which then stops the
children in order) and is stopped by its PID: SIGTERM, then SIGKILL after `stop_timeout_s`.
If start-up fails half-way, what was started is stopped before the error propagates.

Cores: when the launcher may use at least as many cores as there are instances, each
instance gets its own equal share (2 cores, 1P1D: P on core 0, D on core 1), pinned with
`sched_setaffinity` on the child's PID right after it starts (before the interpreter has
made any thread, so every later thread inherits it) and told `--threads` to match. The
router shares the prefill instances' cores: left unpinned, the scheduler moves it onto the
decode core whenever P is busy, which measurably slows decoding (docs/results.md,
"keep load generators and the router off D's core"). `check_pinning` verifies every thread
afterwards.

`cores` (`--cores`) narrows the cores shared out to a given list; with fewer cores than
instances, every instance is pinned to all of them. `--monolithic --cores 0` is the baseline
with one prefill instance's compute (`mono1` in `pdserve bench sweep`).

Monolithic (`--monolithic`): one `--role both` instance and no router; `router_url` is then
the instance's URL, so a benchmark reaches the floor through the same API.

Engine (`--engine vllm`): every instance is `pdserve serve --engine vllm`, which becomes
vLLM's OpenAI server in the same process (pdserve.vllm.instance), with the KV connector
`--connector` names (pdserve's, or vLLM's NixlConnector / NixlPushConnector) listening on
the instance's side-channel port under the engine id `<role>-<index>`; the router is told
so (`--engine vllm`, and each prefill instance's `--prefill-peer`, which a push D leg names).
Table, pinning, logs and supervision are the same.

Cluster token: every instance and the router get one in `$PDSERVE_CLUSTER_TOKEN` (the
config's, else the launcher's own environment's, else a fresh `secrets.token_hex`), so
side-channel and transport authentication is on in every local cluster (the router uses it
for its authenticated calls to the instances); it travels in the environment, never on a
command line (those are logged and visible in `ps`). `pdserve up` writes it, mode 0600,
to `<log dir>/cluster-token` for instances started by hand later.

Ports: the launcher picks every port of a start at once, all distinct (`pdserve.ports`). A
child that finds one taken anyway (another process got there between the pick and the bind)
exits with `EXIT_ADDRESS_IN_USE`, and the whole start is tried again on new ports. Health
counts only when the child itself listens on its port, not some other process there.

Restarts: each P/D instance gets fixed HTTP and side-channel ports, so
`restart_instance(name)` (SIGKILL by PID, then the same command again) brings it back
where routers and peers look for it, as a new incarnation. `respawn(name)` does the same
for an instance or the router without waiting for health; the router keeps its port too.

Supervision: `pdserve up` on one host (pdserve.cluster.local_up, above this module and
pdserve.supervisor) hands the started cluster to a `pdserve.supervisor.Supervisor`, which
restarts any child that dies.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from pdserve.config import API_KEY_ENV, TOKEN_ENV, LogLevel, Role, TransferMode, TransportKind
from pdserve.http_client import Client, HttpError
from pdserve.logdir import LogDirError, private_dir, private_file
from pdserve.options import option
from pdserve.ports import EXIT_ADDRESS_IN_USE, free_ports, listens
from pdserve.router.config import PolicyName
from pdserve.vllm.instance import Connector, Engine

log = logging.getLogger(__name__)

InstanceRole = Role
_LOG_TAIL_LINES = 30
TOKEN_FILE = "cluster-token"
START_ATTEMPTS = 3  # cluster starts tried when a child's port was taken (see ClusterError)


class ClusterError(RuntimeError):
    """The cluster could not start (the message carries the failing process's log tail).

    `port_in_use`: a child exited because a port the launcher picked for it was taken
    meanwhile; starting again on other ports may well work (`Cluster.start` does,
    `START_ATTEMPTS` times). A port the user gave (`ClusterConfig.port`) is not retried.
    """

    def __init__(self, message: str, *, port_in_use: bool = False) -> None:
        super().__init__(message)
        self.port_in_use = port_in_use


def _core_list(text: str) -> tuple[int, ...]:
    try:
        cores = tuple(int(c) for c in text.split(",") if c.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of cores: {text!r}") from None
    if not cores or min(cores) < 0:
        raise argparse.ArgumentTypeError(f"not a list of core numbers: {text!r}")
    return cores


@dataclass(frozen=True)
class ClusterConfig:
    """What `pdserve up` starts. `kv_transfer=None` means monolithic (one instance)."""

    # `--kv-transfer` is one of two flags of which `up` needs one (`--monolithic` the other).
    kv_transfer: TransferMode | None = option(
        "push", flag_default=None, required=False, help="P/D transfer mode"
    )
    num_prefill: int = option(1, flag="--prefill", metavar="N", help="prefill instances")
    num_decode: int = option(1, flag="--decode", metavar="M", help="decode instances")
    transport: TransportKind = option(
        "tcp", help="the instances' KV transport (default: %(default)s)"
    )
    engine: Engine = option(  # the instances' (module doc)
        "pdserve",
        help="the instances' engine: pdserve's, or vLLM's OpenAI server (needs a Hugging "
        "Face --model directory and a vLLM python) (default: %(default)s)",
    )
    connector: Connector = option(  # with engine "vllm": whose KV connector vLLM runs
        "pdserve",
        help="--engine vllm: pdserve's KV transfer inside vLLM (with --transport), or vLLM's "
        "own NixlConnector (pull) / NixlPushConnector (push) (default: %(default)s)",
    )
    vllm_python: str | None = option(  # with engine "vllm": None, `pdserve serve`'s default
        None,
        metavar="PATH",
        help="--engine vllm: python of a venv with vLLM (default: `pdserve serve`'s)",
    )
    model: str | None = option(  # None: the instances' default model
        None, help="passed to every instance (default: theirs)"
    )
    host: str = option(  # where the router (or the monolithic instance) listens
        "127.0.0.1", help="where the router listens"
    )
    port: int | None = option(  # its port; None: a free one
        None, flag_default=8000, help="the router's port"
    )
    policy: PolicyName = option(
        "round_robin",
        help="the router's choice of instance (docs/router.md; default: %(default)s)",
    )
    api_key: str | None = option(  # given to every child as PDSERVE_API_KEY
        None,
        env=API_KEY_ENV,
        help=f"cluster API key, given to every process (default: ${API_KEY_ENV})",
    )
    cluster_token: str | None = option(  # None: $PDSERVE_CLUSTER_TOKEN, else a random one
        None,
        env=TOKEN_ENV,
        help="shared secret of the instances' side channels and transports (default: "
        f"${TOKEN_ENV}, else a random one, written to <log dir>/{TOKEN_FILE})",
    )
    request_timeout_s: float | None = option(  # the router's; None: its default
        None, flag="--request-timeout", metavar="S", help="the router's"
    )
    local_prefill_below: int | None = option(  # the router's; None: its default (64)
        None,
        metavar="N",
        help="the router prefills prompts under N tokens on the decode instance, skipping the "
        "transfer (0: never; default: the router's, 64)",
    )
    router_log_level: LogLevel | None = option(  # the router's; None: its default (info)
        None,
        help="the router's (default: info); debug logs its per-request handoff trace "
        "(pdserve.tracelog), like '-- --log-level debug' does for the instances",
    )
    log_dir: Path | None = option(  # None: a new temporary directory
        None,
        help="one log file per process and the cluster token; created with mode 0700, or an "
        "existing folder of yours that nobody else may access (default: a temporary folder, "
        "deleted on a clean exit unless --keep-logs)",
    )
    instance_args: tuple[str, ...] = ()  # appended to every instance's command line
    pin_cores: bool = option(True, flag="--no-pin", help="do not pin instances to cores")
    # The cores the cluster may use (shared out as above); None: the launcher's own affinity.
    # `(0,)` with `kv_transfer=None` is the one-core monolithic baseline, P's compute alone.
    cores: tuple[int, ...] | None = option(
        None,
        parse=_core_list,
        metavar="LIST",
        help="use only these cores, shared out as without it, e.g. '0' or '0,1' (default: all "
        "this process may use); '--monolithic --cores 0' is the one-core baseline",
    )
    startup_timeout_s: float = option(
        300.0,
        flag="--startup-timeout",
        metavar="S",
        help="how long a start (or a restart) may take to become healthy (default: %(default)s)",
    )
    stop_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.kv_transfer is not None and (self.num_prefill < 1 or self.num_decode < 1):
            raise ValueError("a P/D cluster needs at least one prefill and one decode instance")
        if self.cores is not None and not self.cores:
            raise ValueError("cores: give at least one core, or None for all of them")

    @property
    def monolithic(self) -> bool:
        return self.kv_transfer is None


@dataclass(frozen=True)
class InstanceSpec:
    """One instance to start; what an instance command factory is given."""

    role: InstanceRole
    index: int
    host: str
    port: int
    kv_transfer: TransferMode | None
    transport: str
    model: str | None
    cores: tuple[int, ...] | None  # pinned to these; None: unpinned
    extra_args: tuple[str, ...]
    side_port: int | None = None  # P/D side-channel port; None: the instance picks one
    engine: Engine = "pdserve"
    connector: Connector = "pdserve"
    vllm_python: str | None = None

    @property
    def threads(self) -> int | None:
        """Compute threads to ask for: one per pinned core, else the instance's default."""
        return len(self.cores) if self.cores else None

    @property
    def name(self) -> str:
        return f"{self.role}-{self.index}"


InstanceCommand = Callable[[InstanceSpec], list[str]]


def serve_command(spec: InstanceSpec) -> list[str]:
    """The `pdserve serve` command line of an instance."""
    cmd = [sys.executable, "-m", "pdserve", "serve"]
    if spec.role != "both":  # "both" is serve's default; leaving it out keeps old builds usable
        cmd += ["--role", spec.role]
    if spec.kv_transfer is not None:
        cmd += ["--kv-transfer", spec.kv_transfer, "--transport", spec.transport]
    if spec.model is not None:
        cmd += ["--model", spec.model]
    cmd += ["--host", spec.host, "--port", str(spec.port)]
    if spec.threads is not None and not _has_flag(spec.extra_args, "--threads"):
        cmd += ["--threads", str(spec.threads)]
    if spec.side_port is not None and not _has_flag(spec.extra_args, "--side-channel-port"):
        cmd += ["--side-channel-port", str(spec.side_port)]
    return cmd + _engine_args(spec) + list(spec.extra_args)


def _engine_args(spec: InstanceSpec) -> list[str]:
    """`--engine vllm` and what goes with it; nothing for pdserve's engine."""
    if spec.engine == "pdserve":
        return []
    cmd = ["--engine", spec.engine, "--connector", spec.connector]
    if spec.vllm_python is not None:
        cmd += ["--vllm-python", spec.vllm_python]
    if spec.kv_transfer is not None:  # the id the router gives D for this P (push)
        cmd += ["--engine-id", spec.name]
    return cmd


def prefill_peer(spec: InstanceSpec) -> str:
    """A vLLM prefill instance as the router's `--prefill-peer` names it."""
    return f"{spec.name}@127.0.0.1:{spec.side_port}"


def _has_flag(args: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(f"{flag}=") for a in args)


@dataclass
class ManagedProcess:
    """A child process the cluster started and will stop."""

    name: str  # "prefill-0", "decode-1", "both-0", "router"
    role: str
    url: str
    popen: subprocess.Popen[bytes]
    cores: tuple[int, ...] | None  # pinned to these; None: unpinned
    log_path: Path
    spec: InstanceSpec | None = None  # how to start it again (instances only)
    restarts: int = 0  # times it was started again after the first
    # Whether the launcher picked its ports (a taken one is worth another start; a port
    # the user asked for is not).
    ports_picked: bool = True

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        """Not exited yet (reaps it if it has)."""
        return self.popen.poll() is None

    def kill_leftovers(self) -> None:
        """After it exited: SIGKILL what is left of a vLLM instance's session (its engine
        core and worker). vLLM's engine core does not die with its API server, and a
        leftover one would keep the side-channel port a restart needs. The child was started
        as the leader of its own session, so its process group is the instance's own."""
        if self.spec is None or self.spec.engine != "vllm" or self.alive():
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)

    def log_tail(self, lines: int = _LOG_TAIL_LINES) -> str:
        """The last lines of its log file."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as exc:
            return f"(no log: {exc})"
        return "\n".join(text.splitlines()[-lines:])


def assign_cores(count: int, available: Sequence[int]) -> list[tuple[int, ...]] | None:
    """Equal disjoint shares of `available` for `count` instances; None if too few cores."""
    if count < 1 or len(available) < count:
        return None
    per = len(available) // count
    cores = sorted(available)
    return [tuple(cores[i * per : (i + 1) * per]) for i in range(count)]


class Cluster:
    """A local cluster of instance processes and a router; see the module docstring."""

    def __init__(
        self,
        config: ClusterConfig,
        *,
        instance_command: InstanceCommand | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.config = config
        self._instance_command = instance_command  # None: `serve_command`
        self._env = dict(os.environ if env is None else env)
        # A temporary folder (mode 0700) is the cluster's own: `remove_log_dir` may delete it.
        self.log_dir_is_temporary = config.log_dir is None
        self.log_dir = config.log_dir or Path(tempfile.mkdtemp(prefix="pdserve-up-"))
        self.cluster_token = (
            config.cluster_token or self._env.get(TOKEN_ENV) or secrets.token_hex(16)
        )
        self.instances: list[ManagedProcess] = []
        self.router: ManagedProcess | None = None

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> Cluster:
        """Start everything and wait until all of it is healthy (bounded). Ports are picked
        anew and everything started again when a child finds a port taken (a race with
        other processes that picking ports ahead cannot close), up to `START_ATTEMPTS`."""
        try:
            private_dir(self.log_dir)
        except LogDirError as exc:
            raise ClusterError(str(exc)) from None
        deadline = time.monotonic() + self.config.startup_timeout_s
        for _ in range(START_ATTEMPTS - 1):
            try:
                return self._start_once(deadline)
            except ClusterError as exc:
                if not exc.port_in_use:
                    raise
                log.warning("a port was taken (%s); starting again on other ports", exc)
        return self._start_once(deadline)

    def _start_once(self, deadline: float) -> Cluster:
        """One start on freshly picked ports; on failure, stops what it started."""
        self.instances, self.router = [], None
        *ports, router_port = free_ports(self._ports_needed() + 1)
        try:
            for spec in self.instance_specs(ports):
                self.instances.append(self._start_instance(spec))
            if not self.config.monolithic:
                self.router = self._start_router(self.config.port or router_port)
            _wait_healthy(self.instances, deadline)
            if self.router is not None:  # ready once it has admitted every instance
                _wait_healthy([self.router], deadline, ready=router_sees_all)
        except BaseException:
            self.stop()
            raise
        for problem in self.check_pinning():
            log.warning("%s", problem)
        return self

    def stop(self) -> None:
        """Stop every process started (router first), by PID: SIGTERM, then SIGKILL."""
        procs = [p for p in (self.router, *reversed(self.instances)) if p is not None]
        for p in procs:
            if p.alive():
                p.popen.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.config.stop_timeout_s
        for p in procs:
            try:
                p.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s (pid %d) ignored SIGTERM: killing it", p.name, p.pid)
                p.popen.kill()
                p.popen.wait()
            p.kill_leftovers()

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def process(self, name: str) -> ManagedProcess:
        """The instance or router called `name` ("router" for the router); KeyError if none."""
        if self.router is not None and name == self.router.name:
            return self.router
        return self.instance(name)

    def instance(self, name: str) -> ManagedProcess:
        """The instance called `name` ("prefill-0", "decode-1", "both-0"); KeyError if none."""
        for p in self.instances:
            if p.name == name:
                return p
        raise KeyError(f"no instance {name!r}; have {[p.name for p in self.instances]}")

    def kill_instance(self, name: str, sig: int = signal.SIGKILL) -> ManagedProcess:
        """Send `sig` (default SIGKILL) to the instance's PID and reap it."""
        p = self.instance(name)
        if p.alive():
            os.kill(p.pid, sig)
        p.popen.wait()
        return p

    def restart_instance(self, name: str, timeout_s: float | None = None) -> ManagedProcess:
        """Start `name` again with the same command, ports and cores (SIGKILL first if it is
        still running) and wait until it is healthy; the new process replaces the old one
        in `instances`. Its log goes on in the same file."""
        new = self.respawn(name)
        deadline = time.monotonic() + (timeout_s or self.config.startup_timeout_s)
        _wait_healthy([new], deadline)
        return new

    def respawn(self, name: str) -> ManagedProcess:
        """Start the instance or router `name` again on its ports and cores (SIGKILL and reap
        first if it still runs) and return at once, without waiting for its health (the
        caller polls `is_healthy`). The new process replaces the old one, where `stop` finds
        it. (A KeyboardInterrupt raised inside this call could leave the new process out of
        `stop`'s reach; `pdserve up` therefore turns signals into a stop request instead.)"""
        old = self.process(name)
        if old.alive():
            old.popen.kill()
        old.popen.wait()
        old.kill_leftovers()
        if old is self.router:
            self.router = self._start_router(_port_of(old.url), restarts=old.restarts + 1)
            return self.router
        if old.spec is None:
            raise RuntimeError(f"{name} has no spec to restart from")
        new = self._start_instance(old.spec, restarts=old.restarts + 1)
        self.instances[self.instances.index(old)] = new
        return new

    # -- queries --------------------------------------------------------------------------

    @property
    def router_url(self) -> str:
        """Where clients go: the router, or the single instance when monolithic."""
        if self.router is not None:
            return self.router.url
        if self.instances:
            return self.instances[0].url
        raise RuntimeError("the cluster is not started")

    @property
    def processes(self) -> list[ManagedProcess]:
        """Every process started, instances first, router last."""
        return [*self.instances, *([self.router] if self.router else [])]

    def first_dead(self) -> ManagedProcess | None:
        """A process that has exited, if any."""
        return next((p for p in self.processes if not p.alive()), None)

    def wait(self, poll_s: float = 0.5) -> ManagedProcess:
        """Block until a child exits; return it (the caller then stops the rest)."""
        while (dead := self.first_dead()) is None:
            time.sleep(poll_s)
        return dead

    def check_pinning(self) -> list[str]:
        """Threads of pinned instances allowed outside their cores (should be none)."""
        problems = []
        for p in self.instances:
            if p.cores is None or not p.alive():
                continue
            for tid, allowed in _thread_affinities(p.pid):
                if not allowed <= set(p.cores):
                    problems.append(
                        f"{p.name} (pid {p.pid}) thread {tid} may run on cores "
                        f"{sorted(allowed)}, not only {list(p.cores)}"
                    )
        return problems

    # -- starting -------------------------------------------------------------------------

    def _roles(self) -> list[InstanceRole]:
        c = self.config
        return ["both"] if c.monolithic else ["prefill"] * c.num_prefill + ["decode"] * c.num_decode

    def _ports_needed(self) -> int:
        """Ports `instance_specs` takes: HTTP and side channel per P/D instance."""
        return len(self._roles()) * (1 if self.config.monolithic else 2)

    def _usable_cores(self) -> list[int]:
        """The cores shared out among the instances: the config's, else all this process may
        use. Raises ClusterError for a core this process may not use."""
        allowed = sorted(os.sched_getaffinity(0))
        if self.config.cores is None:
            return allowed
        if bad := sorted(set(self.config.cores) - set(allowed)):
            raise ClusterError(f"cores {bad} are not available (this process may use {allowed})")
        return sorted(set(self.config.cores))

    def _core_shares(self, count: int) -> list[tuple[int, ...]] | None:
        """Each instance's cores: equal disjoint shares when there are enough; else, with
        `cores` given, every instance on all of them (still inside what was asked for)."""
        usable = self._usable_cores()
        shares = assign_cores(count, usable)
        if shares is None and self.config.cores is not None:
            shares = [tuple(usable)] * count
        return shares

    def instance_specs(self, ports: Sequence[int] | None = None) -> list[InstanceSpec]:
        """What to start, in start order (prefill first), with ports and cores assigned.
        `ports`: `_ports_needed()` distinct free ports to use (default: picked here)."""
        c = self.config
        roles = self._roles()
        free = iter(ports if ports is not None else free_ports(self._ports_needed()))
        shares = self._core_shares(len(roles)) if c.pin_cores else None
        index: dict[str, int] = {}
        specs = []
        pd = not c.monolithic
        for i, role in enumerate(roles):
            index[role] = index.get(role, -1) + 1
            port = next(free)
            if c.monolithic and c.port:
                port = c.port
            host = c.host if c.monolithic else "127.0.0.1"
            cores = shares[i] if shares else None
            specs.append(
                InstanceSpec(
                    role,
                    index[role],
                    host,
                    port,
                    c.kv_transfer,
                    c.transport,
                    c.model,
                    cores,
                    c.instance_args,
                    side_port=next(free) if pd else None,
                    engine=c.engine,
                    connector=c.connector,
                    vllm_python=c.vllm_python,
                )
            )
        return specs

    def _start_instance(self, spec: InstanceSpec, restarts: int = 0) -> ManagedProcess:
        cmd = (self._instance_command or serve_command)(spec)
        url = f"http://{_connect_host(spec.host)}:{spec.port}"
        env = {**self._child_env(threads=spec.threads), TOKEN_ENV: self.cluster_token}
        proc = self._spawn(spec.name, spec.role, cmd, env, url, spec.cores, append=restarts > 0)
        proc.spec, proc.restarts = spec, restarts
        proc.ports_picked = not (self.config.monolithic and self.config.port)
        if spec.cores is not None:
            os.sched_setaffinity(proc.pid, spec.cores)
        return proc

    def _start_router(self, port: int, restarts: int = 0) -> ManagedProcess:
        c = self.config
        urls = {r: [p.url for p in self.instances if p.role == r] for r in ("prefill", "decode")}
        cmd = [
            sys.executable,
            "-m",
            "pdserve",
            "router",
            "--prefill",
            *urls["prefill"],
            "--decode",
            *urls["decode"],
            "--kv-transfer",
            str(c.kv_transfer),
            "--policy",
            c.policy,
            "--host",
            c.host,
            "--port",
            str(port),
        ]
        if c.request_timeout_s is not None:
            cmd += ["--request-timeout", str(c.request_timeout_s)]
        if c.local_prefill_below is not None:
            cmd += ["--local-prefill-below", str(c.local_prefill_below)]
        if c.router_log_level is not None:
            cmd += ["--log-level", c.router_log_level]
        if c.engine == "vllm":
            cmd += ["--engine", "vllm", "--connector", c.connector, "--prefill-peer"]
            cmd += [prefill_peer(p.spec) for p in self.instances if p.role == "prefill" and p.spec]
        url = f"http://{_connect_host(c.host)}:{port}"
        cores = self._prefill_cores()
        # The router gets the cluster token too (for authenticated calls to the instances),
        # in its environment like theirs.
        env = {**self._child_env(threads=None), TOKEN_ENV: self.cluster_token}
        proc = self._spawn("router", "router", cmd, env, url, cores, append=restarts > 0)
        proc.ports_picked, proc.restarts = c.port is None, restarts
        if cores is not None:
            os.sched_setaffinity(proc.pid, cores)
        return proc

    def _prefill_cores(self) -> tuple[int, ...] | None:
        """The cores of the pinned prefill instances (the router's), or None if unpinned."""
        cores = [c for p in self.instances if p.role == "prefill" for c in (p.cores or ())]
        return tuple(sorted(set(cores))) or None

    def remove_log_dir(self) -> bool:
        """Delete the log folder if the cluster made it (a temporary one); True if deleted."""
        if not self.log_dir_is_temporary:
            return False
        shutil.rmtree(self.log_dir, ignore_errors=True)
        return True

    def write_token_file(self) -> Path:
        """The cluster token in `<log dir>/cluster-token`, a new file readable by the owner
        only (`pdserve.logdir.private_file`)."""
        path = self.log_dir / TOKEN_FILE
        with os.fdopen(private_file(path), "w") as f:
            f.write(self.cluster_token + "\n")
        return path

    def _child_env(self, threads: int | None) -> dict[str, str]:
        env = {**self._env, "PYTHONUNBUFFERED": "1"}
        if self.config.api_key:
            env["PDSERVE_API_KEY"] = self.config.api_key
        if threads is not None:  # keep OpenMP/MKL pools within the instance's cores
            env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
        return env

    def _spawn(
        self,
        name: str,
        role: str,
        cmd: list[str],
        env: dict[str, str],
        url: str,
        cores: tuple[int, ...] | None,
        append: bool = False,
    ) -> ManagedProcess:
        log_path = self.log_dir / f"{name}.log"
        with os.fdopen(private_file(log_path, append), "wb") as out:
            out.write(f"$ {' '.join(cmd)}\n".encode())
            out.flush()
            popen = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        log.info("started %s (pid %d): %s", name, popen.pid, " ".join(cmd))
        return ManagedProcess(name, role, url, popen, cores, log_path)


def _connect_host(bind_host: str) -> str:
    return "127.0.0.1" if bind_host in ("0.0.0.0", "", "::") else bind_host


def _port_of(url: str) -> int:
    return urlsplit(url).port or 80


def _thread_affinities(pid: int) -> Iterator[tuple[int, set[int]]]:
    with contextlib.suppress(FileNotFoundError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):  # the thread may have ended meanwhile
                yield int(tid), os.sched_getaffinity(int(tid))


def _wait_healthy(
    procs: Sequence[ManagedProcess],
    deadline: float,
    ready: Callable[[Client, ManagedProcess], bool] | None = None,
) -> None:
    """Return when every process is `ready` (default `is_healthy`); raise ClusterError with
    the log tail of the first process that exits or of those not ready at the deadline."""
    ready = ready or is_healthy
    pending = list(procs)
    with Client(timeout_s=1.0) as client:
        while pending:
            for p in list(pending):
                if not p.alive():
                    raise ClusterError(
                        f"{p.name} (pid {p.pid}) exited with code "
                        f"{p.popen.returncode} during start-up; log "
                        f"{p.log_path}:\n{p.log_tail()}",
                        port_in_use=p.ports_picked and p.popen.returncode == EXIT_ADDRESS_IN_USE,
                    )
                if ready(client, p):
                    pending.remove(p)
            if pending and time.monotonic() > deadline:
                tails = "\n".join(f"--- {p.name} ({p.log_path}):\n{p.log_tail()}" for p in pending)
                names = ", ".join(p.name for p in pending)
                raise ClusterError(f"not healthy in time: {names}\n{tails}")
            if pending:
                time.sleep(0.2)


def router_sees_all(client: Client, p: ManagedProcess) -> bool:
    """The router answers /health 200 having admitted every instance: a router that serves
    degraded (no prefill instance admitted yet: it would prefill on decode) is not ready
    for a cluster that is just starting."""
    try:
        r = client.get(f"{p.url}/health")
        body = r.json()
        complete = all(body[role]["healthy"] == body[role]["total"] for role in _ROLES)
    except (HttpError, ValueError, KeyError, TypeError):
        return False
    return r.status == 200 and complete and listens(p.pid, _port_of(p.url))


_ROLES = ("prefill", "decode")


def is_healthy(client: Client, p: ManagedProcess) -> bool:
    """`p` answers /health 200, and it is `p` that answers: a process that another one
    beat to its port must not pass for healthy on that one's answers."""
    try:
        ok = client.get(f"{p.url}/health").status == 200
    except HttpError:
        return False
    return ok and listens(p.pid, _port_of(p.url))
