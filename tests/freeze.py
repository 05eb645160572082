"""Freeze a process with SIGSTOP and wait until the freeze has taken effect.

`kill(pid, SIGSTOP)` returns once the signal is queued. The group stop begins only when one
of the target's threads is scheduled and takes the signal; until then its other threads
keep running. On a loaded machine that window is long enough for a receiver thread to take
a whole 2 MiB write and acknowledge it (a CI run saw exactly that), so a test that needs a
frozen peer waits here until every thread of it reports the stopped state.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path


def _thread_states(pid: int) -> list[str]:
    states = []
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        with contextlib.suppress(OSError):  # a thread that exited meanwhile
            # The state follows the command name, which may itself hold ")" or spaces.
            states.append(stat.read_text().rsplit(")", 1)[1].split()[0])
    return states


def is_frozen(pid: int) -> bool:
    """Every thread of `pid` is stopped (T) or traced (t); a zombie (Z) counts as frozen."""
    states = _thread_states(pid)
    return bool(states) and all(s in ("T", "t", "Z", "X") for s in states)


def freeze(pid: int, timeout_s: float = 10.0) -> None:
    """SIGSTOP `pid` and return once all its threads are stopped; TimeoutError otherwise."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    while not is_frozen(pid):
        if time.monotonic() > deadline:
            raise TimeoutError(f"process {pid} not stopped {timeout_s:g} s after SIGSTOP")
        time.sleep(0.001)


@contextlib.contextmanager
def frozen(pid: int) -> Iterator[None]:
    """`pid` frozen for the block; SIGCONT afterwards, even on failure."""
    try:
        freeze(pid)
        yield
    finally:
        os.kill(pid, signal.SIGCONT)
