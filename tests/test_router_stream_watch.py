"""`StreamWatch`: a relayed stream ends on ejection + silence, and only then."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from pdserve.router.ejection import InstanceEjected, StreamWatch

pytestmark = pytest.mark.timeout(30)


async def _stream(items: list[bytes], gap_s: float, stall_s: float = 0.0) -> AsyncIterator[bytes]:
    for i, item in enumerate(items):
        await asyncio.sleep(stall_s if i == len(items) - 1 else gap_s)
        yield item


async def _read_all(watch: StreamWatch) -> list[bytes]:
    out = []
    while (chunk := await watch.next()) is not None:
        out.append(chunk)
    return out


def test_without_ejection_every_chunk_is_read_and_the_end_is_none() -> None:
    async def main() -> list[bytes]:
        ejected: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        watch = StreamWatch(_stream([b"a", b"b", b"c"], 0.01), ejected, grace_s=0.05)
        try:
            return await _read_all(watch)
        finally:
            watch.close()

    assert asyncio.run(main()) == [b"a", b"b", b"c"]


def test_ejected_and_silent_for_the_grace_ends_the_read_in_progress() -> None:
    async def main() -> tuple[list[bytes], float]:
        loop = asyncio.get_running_loop()
        ejected: asyncio.Future[None] = loop.create_future()
        # the third chunk would come only after 5 s: the stream is stalled
        watch = StreamWatch(_stream([b"a", b"b", b"c"], 0.0, stall_s=5.0), ejected, 0.1)
        got = [await watch.next(), await watch.next()]
        t0 = loop.time()
        loop.call_later(0.05, ejected.set_result, None)
        with pytest.raises(InstanceEjected):
            await watch.next()
        assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]
        return got, loop.time() - t0  # type: ignore[return-value]

    got, waited = asyncio.run(main())
    assert got == [b"a", b"b"]
    assert 0.15 <= waited < 2.0  # ejection at 0.05 s, then 0.1 s of silence


def test_a_stream_that_speaks_again_within_the_grace_is_left_to_finish() -> None:
    async def main() -> list[bytes]:
        ejected: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        ejected.set_result(None)  # ejected from the start, but it keeps talking
        watch = StreamWatch(_stream([b"x"] * 8, 0.05), ejected, grace_s=0.2)
        try:
            return await _read_all(watch)
        finally:
            watch.close()

    assert asyncio.run(main()) == [b"x"] * 8


def test_silence_while_the_reader_is_elsewhere_ends_the_next_read_at_once() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        ejected: asyncio.Future[None] = loop.create_future()
        watch = StreamWatch(_stream([b"a", b"b"], 0.0), ejected, grace_s=0.05)
        assert await watch.next() == b"a"
        ejected.set_result(None)
        await asyncio.sleep(0.2)  # "sending to a slow client": not reading
        with pytest.raises(InstanceEjected):
            await watch.next()

    asyncio.run(main())


def test_a_cancel_from_elsewhere_still_cancels() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        ejected: asyncio.Future[None] = loop.create_future()
        watch = StreamWatch(_stream([b"a"], 0.0, stall_s=5.0), ejected, grace_s=10.0)
        reader = asyncio.ensure_future(watch.next())
        await asyncio.sleep(0.05)
        reader.cancel()  # the client went away
        with pytest.raises(asyncio.CancelledError):
            await reader

    asyncio.run(main())
