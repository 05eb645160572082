"""uvicorn's httptools protocol with a deadline on request headers.

uvicorn closes a connection that stays idle between two requests (`timeout_keep_alive`),
but not one that never completes its headers: a client that connects and says nothing, or
sends a header byte now and then, holds a connection (and its file descriptor) for as long
as it likes. Here each request's headers must be complete within `HEADER_TIMEOUT_S` of the
connection opening or of the request's first byte; otherwise the connection is closed. A
request body and a response stream are not bounded here (the router's and the engine's own
deadlines cover those).

Every pdserve server (instances and the router) passes this class as uvicorn's `http`.
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

HEADER_TIMEOUT_S = 10.0


class HeaderDeadlineProtocol(HttpToolsProtocol):
    """HttpToolsProtocol that closes connections whose headers do not arrive in time."""

    header_timeout_s = HEADER_TIMEOUT_S
    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm_header_timer()

    def on_headers_complete(self) -> None:
        self._cancel_header_timer()
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.transport.close()
