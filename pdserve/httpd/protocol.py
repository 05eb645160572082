"""uvicorn's httptools protocol with a deadline on request headers.

uvicorn closes a connection that stays idle between two requests (`timeout_keep_alive`),
but not one that never completes its headers: a client that connects and says nothing, or
sends a header byte now and then, holds a connection (and its file descriptor) for as long
as it likes. Here each request's headers must be complete within `HEADER_TIMEOUT_S` of the
connection opening or of the request's first byte; otherwise the connection is closed. A
request body and a response stream are not bounded here (the router's and the engine's own
deadlines cover those).

Every pdserve server (instances and the router) passes this class as uvicorn's `http`, and
calls `quiet_polls` so that the routers' health and load polls stay out of the access log.
"""

from __future__ import annotations

import asyncio
import logging

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


# Paths routers poll (every second or more often): their access lines were ~90% of an
# instance's log. They are logged again with `--log-level debug`.
POLLED_PATHS = ("/health", "/load")


class PollFilter(logging.Filter):
    """Drops uvicorn's access-log lines of `POLLED_PATHS` unless the log level is DEBUG."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if not isinstance(args, tuple) or len(args) < 3 or not isinstance(args[2], str):
            return True
        path = args[2].split("?", 1)[0]
        return path not in POLLED_PATHS or logging.getLogger().isEnabledFor(logging.DEBUG)


def quiet_polls() -> None:
    """Install `PollFilter` on uvicorn's access logger (once per process)."""
    access = logging.getLogger("uvicorn.access")
    if not any(isinstance(f, PollFilter) for f in access.filters):
        access.addFilter(PollFilter())
