"""Ending a leg when its instance is ejected, instead of waiting for `request_timeout_s`.

The health monitor sets a leg's `ejected` event (`pdserve.router.health`) when the
instance stops answering health checks; a SIGSTOPped or wedged instance keeps its TCP
connections open, so without this the leg would wait for the router's request timeout.
Each awaited step of a leg (P's answer, D's first token, every chunk of D's stream) is
raced against that event: if the event wins the step is cancelled (which closes its
upstream request, aborting it on the instance) and `InstanceEjected` is raised for the
dispatcher to turn into an error naming the instance.

A relayed stream gets a grace period: an instance can be ejected only because it answered
`/health` too slowly under load while still streaming, and ending streams that are making
progress would turn a false ejection into lost requests. So a stream read is ended only
when the instance has been ejected *and* then stays silent for `grace_s`.

A stream's reads go through `StreamWatch`, not `until_ejected`: racing every chunk costs a
task and an `asyncio.wait` per token, which was a large part of the router's CPU per relayed
token (docs/results.md, "the router reads streams through `StreamWatch`"). The watch reads
directly and only arms a timer once the instance is ejected; the timer cancels the read in
progress if the stream stays silent.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

T = TypeVar("T")


class InstanceEjected(Exception):
    """The leg's instance was ejected by the health monitor while the leg waited on it."""


async def until_ejected(work: Awaitable[T], ejected: asyncio.Event) -> T:
    """`work`'s result, unless `ejected` is set first: then `work` is cancelled (and waited
    for) and `InstanceEjected` raised. Cancelling the caller cancels `work` too. (A relayed
    stream, which gets a grace period, is read through `StreamWatch` instead.)"""
    task = asyncio.ensure_future(work)
    waiter = asyncio.ensure_future(ejected.wait())
    try:
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiter.cancel()
        if not task.done():  # ejected, or the caller was cancelled
            task.cancel()
            await asyncio.wait({task})
    if task.cancelled() and ejected.is_set():
        raise InstanceEjected
    return task.result()


class StreamWatch:
    """Reads a leg's stream chunk by chunk, ending it with `InstanceEjected` once `ejected`
    is set and the stream then stays silent for `grace_s`. Owned by the one task that reads
    (`next` must always be called from that task); holds only a timer while ejected.

    Until the ejection the cost per chunk is one `anext` and a clock read. After it, a timer
    checks for silence: it cancels the read in progress (the task's cancel is taken back and
    turned into `InstanceEjected`), or, if the reader is elsewhere (e.g. blocked sending to a
    slow client), makes the next `next` raise at once.
    """

    def __init__(self, chunks: AsyncIterator[bytes], ejected: asyncio.Future[Any], grace_s: float):
        self._chunks = chunks
        self._grace_s = grace_s
        self._loop = asyncio.get_running_loop()
        self._task: asyncio.Task[Any] | None = None
        self._reading = False
        self._last = self._loop.time()  # when the last chunk came (or the watch started)
        self._timer: asyncio.TimerHandle | None = None
        self._silent = False  # ejected and silent for grace_s: the stream is over
        self._cancelled_read = False  # the timer cancelled a read in progress
        ejected.add_done_callback(self._on_ejected)

    def _on_ejected(self, fut: asyncio.Future[Any]) -> None:
        if not fut.cancelled():
            self._arm(self._loop.time())

    def _arm(self, since: float) -> None:
        self._timer = self._loop.call_at(since + self._grace_s, self._check)

    def _check(self) -> None:
        now = self._loop.time()
        if now - self._last < self._grace_s:  # it spoke after the ejection: watch on
            self._arm(self._last)
            return
        self._silent = True
        if self._reading and self._task is not None:
            self._cancelled_read = True
            self._task.cancel()

    async def next(self) -> bytes | None:
        """The next chunk, or None at the end of the stream; raises `InstanceEjected`."""
        if self._silent:
            raise InstanceEjected
        self._task = self._task or asyncio.current_task()
        self._reading = True
        try:
            chunk = await anext(self._chunks, None)
        except asyncio.CancelledError:
            if not self._cancelled_read:
                raise
            self._cancelled_read = False
            # Take back our cancel; one from elsewhere (client gone) still stands.
            if self._task is not None and self._task.uncancel() > 0:
                raise
            raise InstanceEjected from None
        finally:
            self._reading = False
        self._last = self._loop.time()
        return chunk

    def close(self) -> None:
        """Stop the timer (the stream is over)."""
        if self._timer is not None:
            self._timer.cancel()
