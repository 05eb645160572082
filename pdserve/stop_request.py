"""How a long-running command (`pdserve up`, local or on Ray) turns Ctrl-C, SIGTERM and
SIGHUP into a stop: while it starts, the first signal raises KeyboardInterrupt (the start
stops what it started); once armed, and after that first interrupt, a signal only sets a
`StopFlag` that the command's loop checks between two rounds, so a signal never lands
between starting a child and recording it, nor a second one inside the stop the first began.

Why not `threading.Event`: a Python signal handler runs in the main thread between two
bytecodes, possibly inside that thread's own `Event.wait`, at a point where it holds the
event's (non-reentrant) lock; `Event.set` in the handler then waits for that lock forever.
`pdserve up` hung on SIGTERM that way (once in a CI run). A `StopFlag` takes no lock.
"""

from __future__ import annotations

import contextlib
import signal
import time
from collections.abc import Iterator
from typing import Protocol

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_TICK_S = 0.05  # how often `StopFlag.wait` looks: the most a stop is noticed late


class StopCheck(Protocol):
    """What a polling loop needs of its stop request (`StopFlag`, or a `threading.Event`
    where no signal handler sets it)."""

    def is_set(self) -> bool: ...

    def wait(self, timeout: float) -> bool: ...


class StopFlag:
    """A stop request that a signal handler may set: a plain attribute, no lock."""

    def __init__(self) -> None:
        self._set = False

    def set(self) -> None:
        self._set = True

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float) -> bool:
        """Sleep until set or `timeout` seconds have passed; whether it is set."""
        deadline = time.monotonic() + timeout
        while not self._set and (left := deadline - time.monotonic()) > 0:
            time.sleep(min(_TICK_S, left))
        return self._set


class StopRequest:
    """The stop signals' handler for one command (owned by its `main`): KeyboardInterrupt
    until `armed`, then `requested` is set. Raising arms it: a second signal that arrives
    while the command handles the first (printing, stopping its children) must not raise
    again out of that handling (it did once in CI, exit -2 instead of 0)."""

    def __init__(self) -> None:
        self.requested = StopFlag()
        self.armed = False

    def on_signal(self, signum: int, frame: object) -> None:
        if not self.armed:
            self.armed = True
            raise KeyboardInterrupt(signal.Signals(signum).name)
        self.requested.set()

    @contextlib.contextmanager
    def installed(self) -> Iterator[StopRequest]:
        """`on_signal` handles the stop signals within the block (the previous handlers
        are back after it)."""
        previous = {s: signal.signal(s, self.on_signal) for s in STOP_SIGNALS}
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
