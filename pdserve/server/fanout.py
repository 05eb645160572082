"""`n` > 1: one engine request per choice, as vLLM does.

Choice i runs as its own engine request `<id>-<i>` whose seed, when the client gave one, is
`seed + i` (vLLM's rule), so a seeded request with `n` choices is reproducible and choice i
equals what a request with n = 1 and seed `seed + i` would get. The choices share nothing
in the engine: each computes the prompt (the prompt's KV is not shared between them).

Streaming merges the choices' outputs in arrival order, each tagged with its index. Closing
the merged iterator closes every child's, which aborts what is still running.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing

import msgspec

from pdserve.engine.types import EngineRequest, RequestOutput


def child_requests(er: EngineRequest, n: int) -> list[EngineRequest]:
    """The engine requests of `n` choices of `er` (just `er` when n is 1)."""
    if n == 1:
        return [er]
    seed = er.params.seed
    return [
        msgspec.structs.replace(
            er,
            request_id=f"{er.request_id}-{i}",
            params=msgspec.structs.replace(er.params, seed=None if seed is None else seed + i),
        )
        for i in range(n)
    ]


_DONE = object()


async def merged(
    streams: Sequence[AsyncIterator[RequestOutput]],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice index, output) from every stream as they come; the first exception of any
    stream is raised here (the others are closed)."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as only:
            async for out in only:
                yield 0, out
        return
    queue: asyncio.Queue[tuple[int, object]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async with aclosing(stream) as outs:
                async for out in outs:
                    await queue.put((i, out))
        except Exception as exc:  # handed to the consumer, which re-raises it
            await queue.put((i, exc))
        await queue.put((i, _DONE))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            i, item = await queue.get()
            if item is _DONE:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                assert isinstance(item, RequestOutput)
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
