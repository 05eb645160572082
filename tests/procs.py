"""Start real `pdserve` processes from tests, wait until they are healthy, stop them by PID.

    with PdserveProcess(["serve", "--model", "builtin:tiny"]) as p:
        httpx.get(f"{p.url}/health")

Each process binds 127.0.0.1 on a free port (appended as `--host/--port` unless the caller
passes `port_args=False` and its own flags), logs to a file (a pipe could fill up and block
the child), and is stopped with SIGTERM, then SIGKILL after `grace_s`. A process that dies
or does not become healthy within `startup_timeout_s` raises `ProcessFailed` with the tail
of its log. Several processes (P/D clusters) are just several context managers, e.g. in
a `contextlib.ExitStack`; `free_ports(n)` picks n distinct ports for side channels and the
like (`pdserve.ports`). A process given no port that finds the one picked for it taken
meanwhile is started again on another; health counts only when the process itself listens.

`faults` (pdserve.faults) starts a `serve` process through tests/fault_serve.py instead,
with those faults injected.

`host` and `prefix` place a process elsewhere: `prefix=("ip", "netns", "exec", NS)` runs it in
network namespace NS (`ip netns exec` execs the command, so the PID is still pdserve's own),
and `host` is then an address of that namespace. The health check runs in the calling
thread, so call `start()` from a thread that can reach `host` (tests/test_netns_e2e.py).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

from pdserve.faults import Faults
from pdserve.ports import EXIT_ADDRESS_IN_USE, free_port, free_ports, listens
from tests import fault_serve

__all__ = ["PdserveProcess", "ProcessFailed", "free_port", "free_ports", "greedy_body"]

REPO_ROOT = Path(__file__).resolve().parent.parent
HOST = "127.0.0.1"
_LOG_TAIL_CHARS = 6000
_START_ATTEMPTS = 3  # when the port picked for a process is taken before it binds it


class ProcessFailed(RuntimeError):
    """The process exited early or did not become healthy in time."""


class PdserveProcess:
    """One `python -m pdserve ARGS...` child process, owned by the test that starts it."""

    def __init__(
        self,
        args: Sequence[str],
        *,
        port: int | None = None,
        port_args: bool = True,
        health_path: str = "/health",
        startup_timeout_s: float = 120.0,
        grace_s: float = 10.0,
        env: Mapping[str, str] | None = None,
        host: str = HOST,
        prefix: Sequence[str] = (),
        faults: Faults | None = None,
    ) -> None:
        self._repick = port is None and port_args  # our pick: another is fine if it is taken
        self._base_args, self._host, self._port_args = list(args), host, port_args
        self._use_port(port or free_port())
        self.prefix = list(prefix)  # e.g. ("ip", "netns", "exec", NS), which execs the rest
        if faults is not None and self._base_args[:1] != ["serve"]:
            raise ValueError("faults are injected into `serve` processes only")
        self.faults = faults
        self.health_path = health_path
        self.startup_timeout_s = startup_timeout_s
        self.grace_s = grace_s
        self.env = {**os.environ, **(env or {})}
        self.log_path = Path(tempfile.mkstemp(prefix="pdserve-", suffix=".log")[1])
        self._proc: subprocess.Popen[bytes] | None = None

    def _use_port(self, port: int) -> None:
        self.port = port
        self.url = f"http://{self._host}:{port}"
        flags = ["--host", self._host, "--port", str(port)] if self._port_args else []
        self.args = [*self._base_args, *flags]

    @property
    def pid(self) -> int:
        if self._proc is None:
            raise RuntimeError("process not started")
        return self._proc.pid

    @property
    def returncode(self) -> int | None:
        return None if self._proc is None else self._proc.poll()

    def start(self) -> PdserveProcess:
        """Start the process and wait until `health_path` answers 200."""
        if self._proc is not None:
            raise RuntimeError(f"{self} was already started")
        for _ in range(_START_ATTEMPTS - 1):
            try:
                return self._start_once()
            except ProcessFailed:
                if not (self._repick and self.returncode == EXIT_ADDRESS_IN_USE):
                    raise
            self._use_port(free_port())
        return self._start_once()

    def _start_once(self) -> PdserveProcess:
        cmd = [*self.prefix, sys.executable, "-m", "pdserve", *self.args]
        if self.faults is not None:  # the same `serve`, started by the test-only entry point
            cmd = [*self.prefix, *fault_serve.command(self.faults, self.args[1:])]
        with open(self.log_path, "wb") as log:
            self._proc = subprocess.Popen(
                cmd, cwd=REPO_ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT
            )
        try:
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def wait_healthy(self) -> None:
        """Poll the health endpoint until 200; ProcessFailed (with the log) otherwise."""
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.returncode is not None:
                raise ProcessFailed(f"{self} exited with code {self.returncode}\n{self.log()}")
            try:
                ok = httpx.get(self.url + self.health_path, timeout=2.0).status_code == 200
                if ok and listens(self.pid, self.port):  # not another process on our port
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise ProcessFailed(
            f"{self} not healthy after {self.startup_timeout_s:.0f} s\n{self.log()}"
        )

    def terminate(self) -> None:
        """SIGTERM without waiting, so several processes stop in parallel; `stop()` still
        reaps (and SIGKILLs a straggler)."""
        if self._proc is not None and self._proc.poll() is None:
            os.kill(self._proc.pid, signal.SIGTERM)

    def stop(self) -> int | None:
        """SIGTERM, then SIGKILL after `grace_s`; returns the exit code (idempotent)."""
        if self._proc is None:
            return None
        if self._proc.poll() is None:
            os.kill(self._proc.pid, signal.SIGTERM)
            try:
                self._proc.wait(self.grace_s)
            except subprocess.TimeoutExpired:
                os.kill(self._proc.pid, signal.SIGKILL)
                self._proc.wait()
        return self._proc.returncode

    def log(self) -> str:
        """The tail of the process's combined stdout/stderr."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return text[-_LOG_TAIL_CHARS:]

    def __enter__(self) -> PdserveProcess:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
        if exc is None:
            self.log_path.unlink(missing_ok=True)
        else:
            sys.stderr.write(f"--- log of {self} ({self.log_path}) ---\n{self.log()}\n")

    def __repr__(self) -> str:
        pid = self._proc.pid if self._proc else None
        return f"PdserveProcess(pdserve {' '.join(self.args)}, pid={pid})"


def greedy_body(ids: list[int], max_tokens: int) -> dict[str, Any]:
    """A completion request for the oracle: greedy, exactly `max_tokens`, token ids back."""
    return {
        "prompt": ids,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }


async def complete_all(
    url: str, batch: list[list[int]], max_tokens: int, concurrency: int = 6, timeout: float = 300
) -> list[list[int]]:
    """Greedy token ids of every prompt of `batch` from `url`, `concurrency` at a time."""
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=timeout, trust_env=False) as client:

        async def one(ids: list[int]) -> list[int]:
            async with sem:
                r = await client.post(f"{url}/v1/completions", json=greedy_body(ids, max_tokens))
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["token_ids"]

        return await asyncio.gather(*(one(p) for p in batch))
