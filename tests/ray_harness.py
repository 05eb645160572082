"""Helpers of the Ray tests: a loopback Ray session, the monolithic reference, network checks."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import httpx

PROMPTS = (
    "The capital of France is " * 12,
    "Once upon a time, in a land far away, " * 9,
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, " * 3,
)
LOOPBACK = ("127.0.0.1", "[::ffff:127.0.0.1]", "[::1]", "::1", "::ffff:127.0.0.1")


def complete(url: str, prompt: str, max_tokens: int = 12, timeout: float = 180.0) -> str:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=timeout, trust_env=False)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def descendants(root: int) -> set[int]:
    """`root` and every process below it (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo.extend(children.get(pid, []))
    return found


def sockets_of(pids: set[int]) -> Iterator[tuple[str, str, str, int]]:
    """(state, local address, peer address, pid) of every TCP socket of `pids` (`ss`)."""
    out = subprocess.run(["ss", "-tanpH"], capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        fields = line.split()
        for pid in map(int, re.findall(r"pid=(\d+)", line)):
            if pid in pids:
                yield fields[0], fields[3], fields[4], pid


def host_of(address: str) -> str:
    return address.rsplit(":", 1)[0]


def non_loopback(pids: set[int]) -> list[str]:
    """Sockets of `pids` bound to, or talking to, anything but loopback."""
    bad = []
    for state, local, peer, pid in sockets_of(pids):
        hosts = [host_of(local)] + ([] if state == "LISTEN" else [host_of(peer)])
        if any(h not in LOOPBACK for h in hosts):
            bad.append(f"pid {pid} {state} {local} -> {peer}")
    return bad


def process_lines(pids: Iterable[int]) -> list[str]:
    """`pid state command` of each process of `pids` still there (for failure messages)."""
    lines = []
    for pid in sorted(pids):
        try:
            state = (Path(f"/proc/{pid}") / "stat").read_text().rsplit(")", 1)[1].split()[0]
            cmd = (Path(f"/proc/{pid}") / "cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            continue
        lines.append(f"{pid} {state} {cmd.decode(errors='replace')[:160]}")
    return lines


def wait_for(check: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.25)


def ray_available() -> bool:
    """Without importing it: Ray reads its authentication mode at import."""
    return importlib.util.find_spec("ray") is not None


def this_pid() -> int:
    return os.getpid()
