"""Splitting a server-sent event stream into lines where the SSE spec says lines end.

The spec ends a line at CRLF, LF or CR and nowhere else. httpx's `aiter_lines` splits like
`str.splitlines`, which also breaks at U+2028, U+2029, U+0085, VT, FF and 0x1C-0x1E. A JSON
encoder writes the first three raw inside strings (pydantic and msgspec both do), and model
output contains them, so `aiter_lines` cut such a `data:` line in two and the client failed
on half an event. `bytes.splitlines` breaks at exactly CRLF, LF and CR, so lines are split
on the raw bytes and only then decoded.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator


class SSELineSplitter:
    """Fed the body's bytes in order; hands back complete lines, without their terminator.

    Owns only the unterminated tail of what it was fed (at most one partial line, or a line
    ending in CR whose LF may still come in the next chunk).
    """

    def __init__(self) -> None:
        self._tail = b""

    def feed(self, chunk: bytes) -> list[str]:
        """The lines that `chunk` completes."""
        pieces = (self._tail + chunk).splitlines(keepends=True)
        # A piece not ending in LF is either unterminated or ends in a CR that may be the
        # first half of a CRLF split across chunks: keep it until more bytes say which.
        self._tail = pieces.pop() if pieces and not pieces[-1].endswith(b"\n") else b""
        return [_decode(p) for p in pieces]

    def flush(self) -> list[str]:
        """At the end of the body: the last line if it had no terminator (a cut stream's
        partial line, or a final line after a bare CR)."""
        tail, self._tail = self._tail, b""
        return [_decode(tail)] if tail else []


def _decode(piece: bytes) -> str:
    # Each piece from splitlines(keepends=True) ends in at most one terminator.
    return piece.rstrip(b"\r\n").decode("utf-8", errors="replace")


async def aiter_sse_lines(chunks: AsyncIterable[bytes]) -> AsyncIterator[str]:
    """The lines of an event stream given as byte chunks (e.g. `Response.aiter_bytes()`)."""
    splitter = SSELineSplitter()
    async for chunk in chunks:
        for line in splitter.feed(chunk):
            yield line
    for line in splitter.flush():
        yield line
