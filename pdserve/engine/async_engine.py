"""Asyncio-facing handle on the engine loop, which runs in its own thread.

Ownership: the engine thread owns the scheduler, the block pool and every KV block.
The front end (HTTP handlers on the asyncio loop) never touches them; it submits
`EngineRequest`s and aborts through a thread-safe inbox and receives `RequestOutput`s
through one asyncio queue per request. Handing an output over is
`loop.call_soon_threadsafe`, which does not block.

One bounded exception, the outputs of a P/D handoff: on D the first token of a request whose
KV came from a prefill instance, on P the answer of a finished prefill leg (with its
`kv_transfer_params`). The engine thread would go straight on to its next step, and the
event loop, which has to format and send that output, shares the instance's core and the
GIL with it: on an idle D the first token left 3.3 ms (median) after the engine made it,
most of a decode step (scripts/bench/perf/handoff_hops.py breaks the handoff down). So
after handing such an output over, the engine thread waits until the loop has run its
consumer (the HTTP write), at most `flush_s`: a stuck or flooded loop costs the engine no
more than that.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable

import msgspec

from pdserve.engine.commands import Abort, Add, Command, Release, Stop
from pdserve.engine.engine import LLMEngine
from pdserve.engine.handle import EngineDeadError, EngineInfo
from pdserve.engine.loop import EngineLoop
from pdserve.engine.sinks import Sinks, post
from pdserve.engine.types import (
    EngineRequest,
    EngineStats,
    FinishReason,
    LiveRequest,
    RequestOutput,
)
from pdserve.threads import Thread
from pdserve.tracelog import hop
from pdserve.transfer.params import KVTransferParams
from pdserve.transfer.release import ReleaseAuth, check_release
from pdserve.transfer.stats import ConnectorMetrics

__all__ = ["AsyncEngine", "EngineDeadError"]


class _Wake(msgspec.Struct, frozen=True):
    """Connector threads post this so the engine thread polls them without waiting."""


# Bound on the engine thread's wait for the event loop to send a handoff's output (module doc).
FLUSH_S = 0.002


class AsyncEngine:
    """Runs the engine loop (pdserve.engine.loop) in a dedicated thread and streams outputs
    to asyncio callers (an `EngineHandle`); it is the loop's `LoopIO`. `engine` is for tests
    and the engine thread: the front end goes through the handle's methods only."""

    def __init__(self, engine: LLMEngine, flush_s: float = FLUSH_S) -> None:
        self.engine = engine
        self.info: EngineInfo = engine.info()
        self.tokenizer = engine.tokenizer
        self.flush_s = flush_s
        self._inbox: queue.SimpleQueue[Command | _Wake] = queue.SimpleQueue()
        self._sinks = Sinks()
        loop = EngineLoop(engine, self)
        self._thread = Thread(target=loop.run, name="pdserve-engine", daemon=True)
        self._stopping = threading.Event()
        self.error: BaseException | None = None

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread (idempotent)."""
        if not self._thread.is_alive() and not self._stopping.is_set():
            self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine thread; in-flight requests end with ABORT."""
        self._stopping.set()
        self._inbox.put(Stop())
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def is_alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    # -- requests --------------------------------------------------------------------------
    def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Submit `request` and yield its outputs until the finished one.

        Closing the iterator early (client disconnect, task cancelled) aborts the request,
        which frees its KV blocks in the engine thread.
        """
        return self._sinks.stream(request.request_id, lambda: self._submit(request), self.abort)

    def _submit(self, request: EngineRequest) -> None:
        if not self.is_alive:
            raise EngineDeadError(f"engine is not running: {self.error!r}")
        self._inbox.put(Add(request))

    def abort(self, request_id: str) -> None:
        """Abort a request from any thread; its stream ends with FinishReason.ABORT."""
        self._inbox.put(Abort(request_id))

    def stats(self) -> EngineStats:
        """A snapshot of queue and KV-block counters (read without locking: ints only)."""
        return self.engine.stats()

    # -- reads for the front end (racy but harmless; see pdserve.engine.handle) -------------
    def live_requests(self) -> list[LiveRequest]:
        return self.engine.live_requests()

    def connector_metrics(self) -> ConnectorMetrics | None:
        c = self.engine.connector
        return c.metrics() if c is not None else None

    def transfer_in_use(self, transfer_id: str) -> bool:
        c = self.engine.connector
        return c is not None and c.transfer_in_use(transfer_id)

    def peer_num_blocks(self, engine_id: str, incarnation: str) -> int | None:
        c = self.engine.connector
        return c.remote_num_blocks(engine_id, incarnation) if c is not None else None

    def check_params(self, params: KVTransferParams) -> None:
        if self.engine.connector is not None:
            self.engine.connector.check_params(params)

    def check_release(self, transfer_id: str, signature: str | None) -> ReleaseAuth:
        c = self.engine.connector
        return check_release(c.cfg.cluster_token if c else None, transfer_id, signature)

    def release_transfer(self, transfer_id: str) -> None:
        """Queue the router's release for the engine thread (any thread)."""
        self._inbox.put(Release(transfer_id))

    # -- the engine loop's side (LoopIO; the engine thread calls all but `wake`) ----------
    def running(self) -> bool:
        return not self._stopping.is_set()

    def receive(self, block: bool) -> list[Command]:
        """Queued commands; when `block`, waits up to half a second for one (or a wake-up)."""
        commands: list[Command] = []
        while True:
            try:
                item = self._inbox.get(block=block, timeout=0.5 if block else None)
            except queue.Empty:
                return commands
            block = False
            if not isinstance(item, _Wake):
                commands.append(item)
            if isinstance(item, Stop):
                return commands

    def deliver(self, outputs: list[RequestOutput]) -> None:
        self._deliver(outputs)

    def handoff(self, outputs: list[RequestOutput]) -> None:
        self._deliver_handoff(outputs)

    def stepped(self, outputs: list[RequestOutput]) -> None:
        if any(o.finished and o.kv_transfer_params is not None for o in outputs):
            self._deliver_handoff(outputs)  # P: prefill legs done
        else:
            self._deliver(outputs)

    def idle(self) -> None:
        pass

    def wake(self) -> None:
        self._inbox.put(_Wake())

    def finish(self, error: BaseException | None) -> None:
        self.error = error
        if error is not None:
            self._sinks.fail_all(f"engine stopped: {error!r}", FinishReason.ERROR)
        else:
            self._sinks.fail_all("engine shut down", FinishReason.ABORT)

    def _deliver(self, outputs: list[RequestOutput]) -> set[asyncio.AbstractEventLoop]:
        """Hand `outputs` to their requests' loops (one wake-up per loop and step,
        `Sinks.deliver`); returns the loops that got one."""
        for out in outputs:
            if out.num_output_tokens == 1:
                hop(out.request_id, "d.deliver")
        return self._sinks.deliver(outputs)

    def _deliver_handoff(self, outputs: list[RequestOutput]) -> None:
        """Deliver the outputs of a handoff (D: the connector's events, i.e. P's first tokens
        or transfer failures; P: finished prefill legs) and wait until each loop has run their
        consumers, at most `flush_s` (module doc)."""
        loops = self._deliver(outputs)
        if not loops or self.flush_s <= 0:
            return
        sent = threading.Semaphore(0)
        posted = [loop for loop in loops if post(loop, _after_consumers, loop, sent.release)]
        deadline = time.monotonic() + self.flush_s
        for _ in posted:
            if not sent.acquire(timeout=max(0.0, deadline - time.monotonic())):
                return


def _after_consumers(loop: asyncio.AbstractEventLoop, done: Callable[[], None]) -> None:
    """Runs on `loop` right after the outputs queued before it were put: their getters'
    wake-ups are scheduled already, so a callback scheduled now runs after them."""
    loop.call_soon(done)
