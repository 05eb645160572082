"""HTTP requests for pdserve's synchronous callers, on aiohttp (the package's one HTTP client).

The callers are plain threads and processes with no running event loop: the launcher's and
the supervisor's health polls, the Ray actors' start-up waits, `RayCluster`'s waits and
`/load` reads, the planner's and `scrape_targets`' reads of a router's `/metrics`. Code that
runs in an event loop (the router, `bench`, `soak`) uses aiohttp directly.

A `Client` belongs to the one thread that uses it. It owns a private event loop and one
aiohttp session (pooled connections, dropped after `CLIENT_KEEPALIVE_S` idle), both made on
its first request and closed by `close` (or the end of its `with` block). `get` is one
request on a client of its own.

Every failure to get an answer (connection refused or reset, a timeout, a broken response)
raises `HttpError`, so callers never catch a library's exceptions; an answer with an error
status is a `Response` until the caller asks `raise_for_status`. As with the client these
callers had before: redirects are not followed, proxy settings in the environment are
ignored, and `timeout_s` bounds connecting and each wait for bytes, not the whole request.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from pdserve.keepalive import CLIENT_KEEPALIVE_S


class HttpError(Exception):
    """No usable answer: the request failed on the wire or timed out, or (from
    `Response.raise_for_status`) the answer's status is not 2xx (then `status` is set)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Response:
    """A whole answer: its status and body (read before the request returns)."""

    url: str
    status: int
    reason: str
    body: bytes

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", errors="replace")

    def json(self) -> Any:
        """The body as JSON (raises ValueError if it is not JSON)."""
        return json.loads(self.body)

    def raise_for_status(self) -> Response:
        """This response if its status is 2xx, else `HttpError` naming the status."""
        if not 200 <= self.status < 300:
            raise HttpError(f"GET {self.url}: HTTP {self.status} {self.reason}", self.status)
        return self


class Client:
    """Synchronous GETs over one pooled aiohttp session; see the module doc."""

    def __init__(self, timeout_s: float) -> None:
        self._timeout = aiohttp.ClientTimeout(sock_connect=timeout_s, sock_read=timeout_s)
        self._timeout_s = timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._session: aiohttp.ClientSession | None = None

    def get(self, url: str, headers: Mapping[str, str] | None = None) -> Response:
        """GET `url`; the answer whatever its status, `HttpError` if there is none."""
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        try:
            return self._loop.run_until_complete(self._get(url, headers))
        except asyncio.TimeoutError as exc:  # aiohttp's own timeouts are ClientErrors too
            raise HttpError(f"GET {url}: no answer within {self._timeout_s:g} s") from exc
        except (aiohttp.ClientError, OSError) as exc:
            raise HttpError(f"GET {url}: {type(exc).__name__}: {exc}") from exc

    async def _get(self, url: str, headers: Mapping[str, str] | None) -> Response:
        if self._session is None:  # made in the loop that will use it
            connector = aiohttp.TCPConnector(keepalive_timeout=CLIENT_KEEPALIVE_S)
            self._session = aiohttp.ClientSession(
                connector=connector, timeout=self._timeout, trust_env=False
            )
        async with self._session.get(url, headers=headers, allow_redirects=False) as resp:
            body = await resp.read()
            return Response(url, resp.status, resp.reason or "", body)

    def close(self) -> None:
        """Close the session's connections and the loop (a later request makes new ones)."""
        if self._loop is None:
            return
        if self._session is not None:
            self._loop.run_until_complete(self._session.close())
            self._session = None
        self._loop.close()
        self._loop = None

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def get(url: str, headers: Mapping[str, str] | None = None, *, timeout_s: float) -> Response:
    """One GET on a client of its own (see `Client.get`)."""
    with Client(timeout_s) as client:
        return client.get(url, headers)
