"""Lanes: one worker thread per remote instance, so a dead or slow one delays only its own jobs.

A `Lanes` pool runs jobs keyed by a remote instance's side-channel address. Each key gets
its own thread (its lane), started on the first job for that key and ended after `idle_s`
without one; a lane runs its jobs one at a time, in the order they were submitted. At most
`max_lanes` lanes exist at once: `submit` refuses a job for a new key beyond that, so
hostile params naming many addresses cannot start unbounded threads.

Ownership: a submitted job belongs to the lane until `run(job)` returns; `run` must never
raise (it reports its own failures). `drop(address)` retires the lane of an address given
up on: it runs the jobs already queued (their requests are gone, so `run` returns at once)
and ends, and a later job for that address starts a new lane. `close()` lets each lane
finish the jobs already queued, then ends it (waiting a bounded time: a job stuck in a
handshake is not waited for).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from pdserve.threads import Thread
from pdserve.transfer.side_channel import Address

J = TypeVar("J")


@dataclass
class _Lane(Generic[J]):
    """The jobs for one remote instance and the thread that runs them."""

    jobs: queue.SimpleQueue[J | None] = field(default_factory=queue.SimpleQueue)
    thread: threading.Thread | None = None


class Lanes(Generic[J]):
    """Per-address worker threads (see module doc); thread-safe."""

    def __init__(self, run: Callable[[J], None], name: str, max_lanes: int, idle_s: float) -> None:
        self._run = run
        self._name = name
        self.max_lanes = max_lanes
        self._idle_s = idle_s
        self._lanes: dict[Address, _Lane[J]] = {}
        self._lock = threading.Lock()
        self._closed = False

    def __len__(self) -> int:
        return len(self._lanes)

    def submit(self, address: Address, job: J) -> bool:
        """Queue `job` on the lane of `address`, starting one if needed; False if the pool
        is full (or closed) and this would need a new lane: the caller fails the job."""
        with self._lock:
            lane = self._lanes.get(address)
            if lane is None:
                if self._closed or len(self._lanes) >= self.max_lanes:
                    return False
                lane = self._lanes[address] = _Lane()
                lane.thread = Thread(
                    target=self._loop,
                    args=(address, lane),
                    name=f"{self._name}-{address[0]}:{address[1]}",
                    daemon=True,
                )
                lane.thread.start()
            lane.jobs.put(job)  # under the lock: an idle lane cannot retire past this job
        return True

    def _loop(self, address: Address, lane: _Lane[J]) -> None:
        while True:
            try:
                job = lane.jobs.get(timeout=self._idle_s)
            except queue.Empty:
                with self._lock:
                    if lane.jobs.empty():
                        if self._lanes.get(address) is lane:  # not dropped and replaced
                            del self._lanes[address]
                        return
                continue
            if job is None:
                return
            self._run(job)

    def drop(self, address: Address) -> None:
        """Retire the lane of `address` after the jobs already queued (module doc)."""
        with self._lock:
            lane = self._lanes.pop(address, None)
            if lane is not None:
                lane.jobs.put(None)

    def close(self, timeout: float = 2.0) -> None:
        """Stop every lane after its current job; wait up to `timeout` s for them in all."""
        with self._lock:
            self._closed = True
            lanes = list(self._lanes.values())
            for lane in lanes:
                lane.jobs.put(None)
        deadline = time.monotonic() + timeout
        for lane in lanes:
            if lane.thread is not None:
                lane.thread.join(max(0.0, deadline - time.monotonic()))
