"""The router's HTTP client to its instances: legs, health checks, `/load`, `/tokenize`.

It is aiohttp, pdserve's one HTTP client library, chosen here first because the router
shares P's core and its CPU per request is taken from P's prefills. Measured on the 2-core
machine (client on one core, a uvicorn server on the other; docs/results.md, "the router's
client is aiohttp"): a 6 KB POST costs 0.4 ms of client CPU in aiohttp against 1.6-2.0 ms in
the library pdserve's tools used before; each chunk of a stream 0.19-0.20 ms against
0.41-0.47 ms, and 0.14 ms for a bare asyncio socket.

Errors: every failure on the wire comes out as an `UpstreamError` (timeout, connect, or
protocol), so the callers handle one family and never see aiohttp's.

Ownership: an `Upstream` is opened and closed by the router app's lifespan. A
`StreamAnswer` belongs to whoever holds it (the dispatcher, then its relay), who must
`close` it: closing an unfinished one drops its connection, which aborts the request on the
instance. Plain answers (`get`, `post`) are read whole and hold nothing.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import aiohttp

from pdserve.keepalive import CLIENT_KEEPALIVE_S


class UpstreamError(Exception):
    """A request to an instance failed on the wire (no HTTP status to relay)."""


class UpstreamTimeout(UpstreamError):
    """No connection, answer or next chunk within the request's limit."""


class UpstreamConnectError(UpstreamError):
    """The instance could not be reached (refused, unreachable)."""


class UpstreamProtocolError(UpstreamError):
    """The connection broke or the instance sent something that is not HTTP."""


@dataclass(frozen=True)
class Answer:
    """A whole answer: status and body."""

    status: int
    content: bytes

    @property
    def is_success(self) -> bool:
        return 200 <= self.status < 300


class StreamAnswer:
    """An answer whose body is read as it comes; see the module docstring for who closes it."""

    def __init__(self, response: aiohttp.ClientResponse) -> None:
        self._response = response
        self.status = response.status
        self.content_type: str | None = response.headers.get("Content-Type")

    @property
    def is_success(self) -> bool:
        return 200 <= self.status < 300

    async def read(self) -> bytes:
        """The rest of the body."""
        with translated():
            return await self._response.read()

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive (de-chunked, otherwise as sent)."""
        stream = self._response.content.iter_any()
        while True:
            with translated():
                chunk = await anext(stream, None)
            if chunk is None:
                return
            yield chunk

    def close(self) -> None:
        """Drop the connection unless the body was read to its end; idempotent."""
        self._response.close()


class Upstream:
    """One pooled client for all of a router's requests to its instances; used only on
    the router's event loop. `async with` opens and closes it."""

    def __init__(
        self, request_timeout_s: float, connect_timeout_s: float, max_connections: int
    ) -> None:
        self._leg_timeout = aiohttp.ClientTimeout(
            sock_connect=connect_timeout_s, sock_read=request_timeout_s
        )
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Upstream:
        # Idle connections go before the servers drop theirs (`pdserve.keepalive`).
        connector = aiohttp.TCPConnector(
            limit=self._max_connections, keepalive_timeout=CLIENT_KEEPALIVE_S
        )
        # trust_env=False: an HTTP(S)_PROXY in the environment must not capture loopback.
        self._session = aiohttp.ClientSession(connector=connector, trust_env=False)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._session is not None:
            await self._session.close()

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("Upstream used outside `async with`")
        return self._session

    async def get(
        self, url: str, *, timeout_s: float, headers: Mapping[str, str] | None = None
    ) -> Answer:
        """GET `url`, whole answer within `timeout_s`."""
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        with translated():
            async with self.session.get(url, headers=headers, timeout=timeout) as r:
                return Answer(r.status, await r.read())

    async def post(
        self,
        url: str,
        body: bytes,
        headers: Mapping[str, str],
        *,
        timeout_s: float | None = None,
    ) -> Answer:
        """POST `body`; the whole answer within `timeout_s`, or by default under the leg
        limits (connect: `connect_timeout_s`; then the answer: `request_timeout_s`)."""
        timeout = self._leg_timeout if timeout_s is None else aiohttp.ClientTimeout(total=timeout_s)
        with translated():
            async with self.session.post(url, data=body, headers=headers, timeout=timeout) as r:
                return Answer(r.status, await r.read())

    async def open_stream(self, url: str, body: bytes, headers: Mapping[str, str]) -> StreamAnswer:
        """POST `body` and return once the status line and headers are in; the leg limits
        bound the connect, the wait for the headers and every gap between chunks."""
        with translated():
            r = await self.session.post(url, data=body, headers=headers, timeout=self._leg_timeout)
        return StreamAnswer(r)


@contextmanager
def translated() -> Iterator[None]:
    """aiohttp's (and asyncio's timeout) errors as `UpstreamError`s; cancellation passes."""
    try:
        yield
    except TimeoutError as exc:  # aiohttp's timeout errors subclass it
        raise UpstreamTimeout(str(exc) or type(exc).__name__) from exc
    except aiohttp.ClientConnectorError as exc:
        raise UpstreamConnectError(str(exc)) from exc
    except (aiohttp.ClientError, OSError) as exc:
        raise UpstreamProtocolError(str(exc) or type(exc).__name__) from exc
