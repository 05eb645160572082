"""The README's quick start, followed in order as a new user would: `serve`, `up`, then
`bench serve` against each, every command as written except that the ports the README
names (8100 for the instance, 8000 for `up`'s router) become free ones. The commands after
those (a sweep, a 10-minute soak, the simulator) take minutes to hours: their command lines
are checked to parse as written. Then the README's Python snippet runs as written.

Every process binds 127.0.0.1 and is stopped by its PID (SIGTERM, then SIGKILL)."""

from __future__ import annotations

import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import pytest

from pdserve.cli import parse_args
from pdserve.ports import free_ports

README = Path(__file__).resolve().parent.parent / "README.md"
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def quick_start() -> tuple[list[list[str]], str]:
    """The pdserve command lines of the quick start's bash block, and its Python block."""
    text = README.read_text().split("## Quick start", 1)[1].split("\n## ", 1)[0]
    bash = re.search(r"```bash\n(.*?)```", text, re.S)
    python = re.search(r"```python\n(.*?)```", text, re.S)
    assert bash and python, "the quick start has a bash and a python block"
    lines = [line.split("#", 1)[0].strip() for line in bash.group(1).splitlines()]
    commands = [shlex.split(line) for line in lines if line.startswith(".venv/bin/pdserve")]
    return [c[1:] for c in commands], python.group(1)


def with_ports(argv: list[str], ports: dict[str, str]) -> list[str]:
    out = [ports.get(a, a) for a in argv]
    return [re.sub(r":(8000|8100)\b", lambda m: ":" + ports[m.group(1)], a) for a in out]


@contextmanager
def running(argv: list[str], log: Path, ready: str | None = None) -> Iterator[subprocess.Popen]:
    """`python -m pdserve ARGV` until the block ends; waits for `ready` on its output."""
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pdserve", *argv],
            stdout=subprocess.PIPE if ready else out,
            stderr=subprocess.STDOUT,
            text=True,
        )
    try:
        if ready:
            assert proc.stdout is not None
            seen = []
            while ready not in (line := proc.stdout.readline()):
                assert line, "".join(seen)  # it exited before it was ready
                seen.append(line)
        yield proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"exited with {proc.returncode}"
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url} never became healthy")


def test_the_quick_start_runs_as_written(tmp_path: Path) -> None:
    commands, python = quick_start()
    serve, up, bench_cluster, bench_instance, *rest = commands
    assert serve[0] == "serve" and up[0] == "up" and bench_cluster[:2] == ["bench", "serve"]
    instance_port, router_port = map(str, free_ports(2))
    ports = {"8100": instance_port, "8000": router_port}
    serve = with_ports(serve, ports)
    up = [*with_ports(up, ports), "--port", router_port]  # the README relies on the default
    with ExitStack() as stack:
        instance = stack.enter_context(running(serve, tmp_path / "serve.log"))
        wait_healthy(f"http://127.0.0.1:{instance_port}", instance)
        stack.enter_context(running(up, tmp_path / "up.log", ready="Ctrl-C stops everything"))
        for bench in (bench_cluster, bench_instance):
            argv = [*with_ports(bench, ports), "--disable-tqdm"]
            run = subprocess.run(
                [sys.executable, "-m", "pdserve", *argv], capture_output=True, text=True
            )
            assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
            assert re.search(r"Successful requests:\s+50\b", run.stdout), run.stdout[-2000:]
    for argv in rest:  # minutes to hours each: they must at least parse as written
        parse_args(argv)
    run = subprocess.run([sys.executable, "-c", python], capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.strip(), run.stderr[-2000:]
