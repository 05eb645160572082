"""The discrete-event core: a clock, a heap of timed callbacks, and FIFO servers.

Events at the same time run in the order they were scheduled (a sequence number breaks
ties), so a run is a pure function of its inputs: no wall clock, no randomness here.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable
from typing import Any


class EventLoop:
    """Simulated time in seconds; `at`/`after` schedule a callback, `run` plays them."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = itertools.count()
        self.events_run = 0

    def at(self, time: float, fn: Callable[..., None], *args: Any) -> None:
        """Run `fn(*args)` at `time` (not before now)."""
        if time < self.now or math.isnan(time):
            raise ValueError(f"cannot schedule at {time} before now ({self.now})")
        heapq.heappush(self._heap, (time, next(self._seq), fn, args))

    def after(self, delay: float, fn: Callable[..., None], *args: Any) -> None:
        self.at(self.now + delay, fn, *args)

    def run(self, until: float = math.inf) -> None:
        """Play events in time order until none is left or the next is after `until`."""
        while self._heap and self._heap[0][0] <= until:
            time, _, fn, args = heapq.heappop(self._heap)
            self.now = time
            self.events_run += 1
            fn(*args)

    def pending(self) -> int:
        return len(self._heap)


class FifoServer:
    """A resource that serves one job at a time in arrival order (a thread, a link).

    `reserve(ready, duration)` books the next job: it starts when both the resource is free
    and the job is ready, and returns (start, end). Jobs must be booked in the order the
    resource takes them; the booking is computed at once, no event is needed.
    """

    def __init__(self) -> None:
        self.free_at = 0.0
        self.busy_time = 0.0

    def reserve(self, ready: float, duration: float) -> tuple[float, float]:
        start = max(self.free_at, ready)
        self.free_at = start + duration
        self.busy_time += duration
        return start, self.free_at
