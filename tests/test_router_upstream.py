"""The router's client to its instances (`pdserve.router.upstream`): answers, streams, and
every failure on the wire as an `UpstreamError` of the right kind, against scripted raw
HTTP servers on loopback."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest

from pdserve.ports import free_port
from pdserve.router.upstream import (
    Upstream,
    UpstreamConnectError,
    UpstreamProtocolError,
    UpstreamTimeout,
)

pytestmark = pytest.mark.timeout(30)

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
STREAM_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"
    b"connection: close\r\n\r\n"
)


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def _read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        (
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length")
        ),
        0,
    )
    return await reader.readexactly(length)


@asynccontextmanager
async def _server(handler: Handler) -> AsyncIterator[str]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.close()


def _run(coro: Awaitable[None]) -> None:
    asyncio.run(coro)  # type: ignore[arg-type]


def test_answers_and_streams_come_back_whole() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        body = await _read_request(reader)
        if body == b"stream":
            writer.write(STREAM_HEAD + _chunk(b"data: 1\n\n") + _chunk(b"data: 2\n\n"))
            writer.write(b"0\r\n\r\n")
        else:
            writer.write(
                b"HTTP/1.1 201 Created\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s"
                % (len(body), body)
            )
        await writer.drain()
        writer.close()

    async def scenario() -> None:
        async with _server(handler) as url, Upstream(5, 5, 10) as up:
            answer = await up.post(f"{url}/x", b"echo", {"Content-Type": "application/json"})
            assert (answer.status, answer.content, answer.is_success) == (201, b"echo", True)
            stream = await up.open_stream(f"{url}/s", b"stream", {})
            assert stream.status == 200 and stream.content_type == "text/event-stream"
            got = b"".join([c async for c in stream.chunks()])
            stream.close()
            assert got == b"data: 1\n\ndata: 2\n\n"

    _run(scenario())


def test_nothing_listening_is_a_connect_error() -> None:
    async def scenario() -> None:
        async with Upstream(5, 5, 10) as up:
            with pytest.raises(UpstreamConnectError):
                await up.get(f"http://127.0.0.1:{free_port()}/health", timeout_s=2)

    _run(scenario())


def test_silent_instance_is_a_timeout_for_plain_and_stream_requests() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        await asyncio.sleep(10)  # never answers

    async def scenario() -> None:
        async with _server(handler) as url, Upstream(0.3, 5, 10) as up:
            with pytest.raises(UpstreamTimeout):
                await up.get(f"{url}/health", timeout_s=0.3)
            with pytest.raises(UpstreamTimeout):
                await up.post(f"{url}/v1/completions", b"{}", {})  # the leg limit, 0.3 s
            with pytest.raises(UpstreamTimeout):
                await up.open_stream(f"{url}/v1/completions", b"{}", {})

    _run(scenario())


def test_stream_gap_longer_than_the_limit_is_a_timeout() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(STREAM_HEAD + _chunk(b"data: 1\n\n"))
        await writer.drain()
        await asyncio.sleep(10)

    async def scenario() -> None:
        async with _server(handler) as url, Upstream(0.3, 5, 10) as up:
            stream = await up.open_stream(f"{url}/s", b"{}", {})
            chunks = stream.chunks()
            assert await anext(chunks) == b"data: 1\n\n"
            with pytest.raises(UpstreamTimeout):
                await anext(chunks)
            stream.close()

    _run(scenario())


def test_stream_cut_mid_body_is_a_protocol_error() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(STREAM_HEAD + _chunk(b"data: 1\n\n") + b"20\r\ndata: hal")
        await writer.drain()
        writer.close()  # no terminating chunk: the instance died mid-stream

    async def scenario() -> None:
        async with _server(handler) as url, Upstream(5, 5, 10) as up:
            stream = await up.open_stream(f"{url}/s", b"{}", {})
            got = []
            with pytest.raises(UpstreamProtocolError):
                async for chunk in stream.chunks():
                    got.append(chunk)
            stream.close()
            assert b"".join(got).startswith(b"data: 1\n\n")  # what came before the cut

    _run(scenario())


def test_closing_an_unfinished_stream_drops_the_connection() -> None:
    """That is how the router aborts a request on its instance."""
    gone = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await _read_request(reader)
        writer.write(STREAM_HEAD + _chunk(b"data: 1\n\n"))
        await writer.drain()
        if await reader.read(1) == b"":  # EOF: the client closed its end
            gone.set()

    async def scenario() -> None:
        async with _server(handler) as url, Upstream(5, 5, 10) as up:
            stream = await up.open_stream(f"{url}/s", b"{}", {})
            assert await anext(stream.chunks()) == b"data: 1\n\n"
            stream.close()
            await asyncio.wait_for(gone.wait(), 5)

    _run(scenario())
