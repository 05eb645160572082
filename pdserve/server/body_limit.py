"""A request body size limit for the instance and router apps: 413 before the body is read.

A completion request is small: a prompt at the longest context of a real model, as token
ids in JSON, is about 1 MiB. `MAX_BODY_BYTES` (32 MiB) leaves a wide margin and keeps a
client from making the server parse (and hold) an arbitrarily large body. A body announced
as larger (Content-Length) is refused at once; a chunked body is counted as it arrives and
refused as soon as it passes the limit.
"""

from __future__ import annotations

from http import HTTPStatus

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdserve.server.errors import APIError

MAX_BODY_BYTES = 32 * 2**20


class BodySizeLimit:
    """ASGI middleware: HTTP requests with a body over `max_bytes` get a 413 JSON error."""

    def __init__(self, app: ASGIApp, max_bytes: int = MAX_BODY_BYTES) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._too_large().response()(scope, receive, send)
            return
        await self.app(scope, self._counting(receive), send)

    def _counting(self, receive: Receive) -> Receive:
        """`receive`, raising a 413 once more than `max_bytes` of body arrived. Raised inside
        the app (which is reading the body), the app's error handlers turn it into JSON."""
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise HTTPException(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, self._message())
            return message

        return counted

    def _too_large(self) -> APIError:
        return APIError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, self._message())

    def _message(self) -> str:
        return f"The request body is larger than the limit of {self.max_bytes} bytes."


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the server (h11/httptools) refuses a malformed one itself
    return None
