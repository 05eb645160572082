"""Server-sent events' data from a byte stream, for `bench`'s aiohttp client.

`bench` reads its streams with aiohttp because its CPU per streamed chunk is about half httpx's
(docs/results.md, "the bench client is aiohttp"), and on 2 cores the load generator shares a
core with the system it measures. aiohttp has no SSE parser, and httpx-sse's works only on httpx
responses, so this is the part of the SSE format a client of an OpenAI-style stream needs: each
event's `data`, nothing else (`event`, `id` and `retry` fields and comments are read and
dropped).

As the SSE format says: lines end at CRLF, LF or CR and nowhere else (JSON may carry U+2028,
U+2029 and U+0085 raw, and `str.splitlines` would cut there); a blank line ends an event;
an event's `data` lines are joined with LF; one space after `data:` is dropped; an event
whose blank line never came (a stream cut mid-event) is dropped.
"""

from __future__ import annotations

_BOM = b"\xef\xbb\xbf"  # UTF-8's byte-order mark, dropped once at the start of a stream


class SseDecoder:
    """Fed a stream's bytes in order, chunked anyhow; returns each whole event's data.
    Owned by one stream; holds at most one incomplete line and one incomplete event."""

    def __init__(self) -> None:
        self._tail = b""  # an incomplete line
        self._data: list[str] = []  # the data lines of the incomplete event
        self._started = False

    def feed(self, chunk: bytes) -> list[str]:
        """The data of every event that `chunk` completes, in order."""
        buf = self._tail + chunk
        if not self._started:
            if _BOM.startswith(buf):  # too short to tell yet
                self._tail = buf
                return []
            self._started = True
            buf = buf.removeprefix(_BOM)
        # A CR at the end may be the first half of a CRLF: keep it until the next byte.
        cut = len(buf) - 1 if buf.endswith(b"\r") else len(buf)
        *lines, rest = buf[:cut].replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n")
        self._tail = rest + buf[cut:]
        return [data for line in lines if (data := self._line(line)) is not None]

    def end(self) -> list[str]:
        """At the end of the stream: an event that a final bare CR completes, if any."""
        return self.feed(b"\n") if self._tail.endswith(b"\r") else []

    def _line(self, line: bytes) -> str | None:
        if not line:
            if not self._data:
                return None
            data, self._data = "\n".join(self._data), []
            return data
        name, _, value = line.partition(b":")
        if name == b"data":
            self._data.append(value.removeprefix(b" ").decode("utf-8", "replace"))
        return None
