"""One bootstrap for every pdserve HTTP server: an instance (pdserve.server.serve) and the
router (pdserve.router.serve) serve their app with `serve_app` on a socket they bound.

Shutdown, on SIGTERM or SIGINT (handled only when called from the main thread; elsewhere,
e.g. in a Ray actor's thread, the process's owner stops it): stop accepting, let running
requests finish for `grace_s`, then call `on_grace_over` (an instance stops its engine there,
so the requests still running end with an explicit error, a 503 or an SSE error event,
instead of a cut connection) and give them `BACKSTOP_S` more before uvicorn cancels them;
without `on_grace_over`, uvicorn cancels them at `grace_s`. Then `serve_app` returns, so the
caller can clean up and exit 0: stock uvicorn re-raises the signal at the end instead, which
kills the process before its owner's cleanup runs.

uvicorn is imported when a server starts: `pdserve --help` imports the modules that call this.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

from pdserve.keepalive import SERVER_KEEPALIVE_S

log = logging.getLogger("pdserve.httpd")

# asyncio's own loop, also where uvloop is installed: measured with push (docs/results.md,
# "httptools, and asyncio's loop rather than uvloop"), uvloop under the instances and the
# router made the handoff 1-2 ms longer for no gain in CPU per token that httptools alone
# does not give.
UVICORN_LOOP = "asyncio"
LISTEN_BACKLOG = 2048  # uvicorn's default; it keeps the backlog given here
BACKSTOP_S = 5.0  # after `on_grace_over`, uvicorn's own deadline (it cancels handlers)


def serve_app(
    app: Any,
    sock: socket.socket,
    log_level: str,
    *,
    grace_s: float,
    on_grace_over: Callable[[], None] | None = None,
    access_log: bool = True,
) -> None:
    """Serve `app` on the listening `sock` until SIGTERM/SIGINT, then shut down (module doc)
    and return normally."""
    import uvicorn

    from pdserve.httpd.protocol import HeaderDeadlineProtocol, quiet_polls

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            with _handled_signals(self.handle_exit):
                yield

        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            drain = asyncio.ensure_future(super().shutdown(sockets))
            await asyncio.wait({drain}, timeout=grace_s)
            if not drain.done() and on_grace_over is not None:
                log.warning("aborting the requests still running after %.0f s", grace_s)
                await asyncio.to_thread(on_grace_over)
            await drain

    config = uvicorn.Config(
        app,
        log_level=log_level,
        access_log=access_log,
        timeout_graceful_shutdown=grace_s + (BACKSTOP_S if on_grace_over else 0.0),
        timeout_keep_alive=SERVER_KEEPALIVE_S,  # longer than clients keep theirs (see there)
        loop=UVICORN_LOOP,
        http=HeaderDeadlineProtocol,  # slow or silent headers are cut off
    )
    quiet_polls()  # after uvicorn.Config, which configures its loggers
    Server(config).run(sockets=[sock])


@contextlib.contextmanager
def _handled_signals(handler: Callable[[int, FrameType | None], None]) -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be set from the main thread
        return
    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
