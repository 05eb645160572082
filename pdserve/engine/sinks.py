"""The per-request output queues of an engine handle, fed from a thread that is not the
requests' event loop (the engine thread of `AsyncEngine`, the reader thread of
`EngineCoreClient`).

Ownership: a request's sink exists from `open` (in `generate`, on the request's loop) to
`close` (when its stream ends, whichever way); outputs for a request without a sink are
dropped (it was aborted or its client went away). `deliver` may run on any thread.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass

from pdserve.engine.types import FinishReason, RequestOutput


@dataclass
class Sink:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[RequestOutput]


class Sinks:
    """Sinks by request id, under one lock (module doc)."""

    def __init__(self) -> None:
        self._sinks: dict[str, Sink] = {}
        self._lock = threading.Lock()

    def open(self, request_id: str) -> Sink:
        """A sink on the running loop; ValueError if `request_id` already has one."""
        sink = Sink(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            if request_id in self._sinks:
                raise ValueError(f"duplicate request id {request_id!r}")
            self._sinks[request_id] = sink
        return sink

    async def stream(
        self, request_id: str, submit: Callable[[], None], abort: Callable[[str], None]
    ) -> AsyncIterator[RequestOutput]:
        """One request's outputs: open its sink, `submit()` it (which may raise: engine dead,
        say), then yield its outputs up to the finished one. Closing the iterator early
        closes the sink and calls `abort(request_id)`, which frees its KV blocks."""
        sink = self.open(request_id)
        try:
            submit()
        except BaseException:
            self.close(request_id)
            raise
        finished = False
        try:
            while not finished:
                out = await sink.queue.get()
                finished = out.finished
                yield out
        finally:
            self.close(request_id)
            if not finished:
                abort(request_id)

    def close(self, request_id: str) -> None:
        with self._lock:
            self._sinks.pop(request_id, None)

    def deliver(self, outputs: Iterable[RequestOutput]) -> set[asyncio.AbstractEventLoop]:
        """Hand `outputs` to their requests' loops, in order; returns the loops that got one.

        One `call_soon_threadsafe` per loop, not per output: each one writes the loop's
        self-pipe, a system call that drops the GIL, and the loop thread takes it then; with
        many streams the calling thread paid that hand-off once per stream.
        """
        batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, RequestOutput]]] = {}
        with self._lock:
            for out in outputs:
                sink = self._sinks.get(out.request_id)
                if sink is not None:
                    batches.setdefault(sink.loop, []).append((sink.queue, out))
        return {loop for loop, batch in batches.items() if post(loop, _put_all, batch)}

    def fail_all(self, message: str, reason: FinishReason) -> None:
        """End every open stream with a finished output carrying `message`."""
        with self._lock:
            sinks = list(self._sinks.items())
        for rid, sink in sinks:
            out = RequestOutput(
                request_id=rid,
                new_token_ids=[],
                new_text="",
                finished=True,
                finish_reason=reason,
                error=message,
            )
            post(sink.loop, sink.queue.put_nowait, out)


def _put_all(batch: list[tuple[asyncio.Queue, RequestOutput]]) -> None:
    """Runs on the loop: one step's outputs into their requests' queues, in step order."""
    for q, out in batch:
        q.put_nowait(out)


def post(loop: asyncio.AbstractEventLoop, fn: Callable[..., object], *args: object) -> bool:
    """Schedule `fn(*args)` on `loop` from any thread; False if the loop is closed (its
    consumers are gone with it: a client's `asyncio.run` that ended, a server shut down)."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # "Event loop is closed"
        return False
    return True
