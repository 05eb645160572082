"""Logging what strangers send: escaped, truncated, and not once per frame.

A peer or client can put anything in a string we log (an engine id with a newline forges a
log line, a 1 MB one writes a 1 MB line) and can send 20,000 bad frames to get 20,000
warnings. `shown` makes a peer-supplied string safe to log; `Throttled` logs the first
occurrence of a warning at once and then at most one line per interval, with the count of
those it held back.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

MAX_SHOWN_CHARS = 120


def shown(value: object, limit: int = MAX_SHOWN_CHARS) -> str:
    """`value` as one printable line: control characters escaped, cut to `limit` chars."""
    text = str(value)
    cut = len(text) > limit
    escaped = text[:limit].encode("unicode_escape").decode("ascii")
    return f"{escaped}...({len(text)} chars)" if cut else escaped


class Throttled:
    """One warning line per `interval_s` at most for one kind of event (any thread).

    The first event is logged at once; later ones within the interval are counted, and the
    next line that goes out says how many were held back.
    """

    def __init__(
        self,
        logger: logging.Logger,
        interval_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._log = logger
        self._interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._next = -float("inf")
        self._held = 0
        self.count = 0  # events seen in all

    def warning(self, msg: str, *args: object) -> bool:
        """Log `msg % args` unless a line went out less than `interval_s` ago; True if
        logged."""
        with self._lock:
            self.count += 1
            now = self._clock()
            if now < self._next:
                self._held += 1
                return False
            held, self._held = self._held, 0
            self._next = now + self._interval_s
        suffix = f" (and {held} more like it in the last {self._interval_s:g} s)" if held else ""
        self._log.warning(msg + suffix, *args)
        return True
