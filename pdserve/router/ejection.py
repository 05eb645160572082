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
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

T = TypeVar("T")


class InstanceEjected(Exception):
    """The leg's instance was ejected by the health monitor while the leg waited on it."""


async def until_ejected(work: Awaitable[T], ejected: asyncio.Event, grace_s: float = 0.0) -> T:
    """`work`'s result, unless `ejected` is set and `work` is still pending `grace_s` later:
    then `work` is cancelled (and waited for) and `InstanceEjected` raised. Cancelling the
    caller cancels `work` too."""
    waiter = asyncio.ensure_future(ejected.wait())
    try:
        return await race_ejection(work, waiter, grace_s)
    finally:
        waiter.cancel()


async def race_ejection(work: Awaitable[T], waiter: asyncio.Future[Any], grace_s: float) -> T:
    """Like `until_ejected`, with an ejection waiter the caller owns (one for a whole stream
    rather than a new one per chunk); the waiter is left running."""
    task = asyncio.ensure_future(work)
    try:
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        if not task.done() and grace_s > 0:
            await asyncio.wait({task}, timeout=grace_s)
    finally:
        if not task.done():  # ejected and silent, or the caller was cancelled
            task.cancel()
            await asyncio.wait({task})
    if task.cancelled() and waiter.done():
        raise InstanceEjected
    return task.result()
