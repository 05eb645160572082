"""Server-sent events, both ways: the one place pdserve writes and reads the SSE format.

Writing (`data_event`): JSON encoders (pydantic, msgspec) write U+2028, U+2029 and U+0085
raw inside strings, and model output contains them. The SSE spec does not end a line
there, but clients that split lines like `str.splitlines` do (the line iterator of a
common Python HTTP client, and its SSE add-on before 0.4.2), and they then fail on half an
event. JSON allows these characters
only inside strings, where the `\\uXXXX` escape means the same text, so escaping them
everywhere is lossless.

Reading (`SseDecoder`): the part of the format a client of an OpenAI-style stream needs,
each event's `data` (`event`, `id` and `retry` fields and comments are read and dropped).
As the SSE format says: lines end at CRLF, LF or CR and nowhere else (JSON may carry
U+2028, U+2029 and U+0085 raw, and `str.splitlines` would cut there); a blank line ends an
event; an event's `data` lines are joined with LF; one space after `data:` is dropped; an
event whose blank line never came (a stream cut mid-event) is dropped. The bench client,
the soak's traffic, the router's stream-start detection and the tests all read with it.

Framing (`first_event_end`, `last_event_end`): where whole events end in a byte buffer, for
the router, which relays D's bytes as they are and must cut them only between events.
"""

from __future__ import annotations

_ESCAPES = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"})
_BOM = b"\xef\xbb\xbf"  # UTF-8's byte-order mark, dropped once at the start of a stream
_EVENT_ENDS = (b"\n\n", b"\r\n\r\n")  # the blank line after an event, as servers write it


def data_event(json_text: str) -> str:
    """`data: {json_text}` and the blank line that ends the event. `json_text` is one
    compact JSON document (no raw CR or LF, as every JSON encoder writes it)."""
    return f"data: {json_text.translate(_ESCAPES)}\n\n"


def data_event_bytes(json_bytes: bytes) -> bytes:
    """`data_event` of UTF-8 JSON, as UTF-8."""
    return data_event(json_bytes.decode()).encode()


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


def events_data(body: bytes | str) -> list[str]:
    """The data of every whole event of a complete SSE body, in order."""
    decoder = SseDecoder()
    raw = body.encode() if isinstance(body, str) else body
    return decoder.feed(raw) + decoder.end()


def first_event_end(buffer: bytes) -> int:
    """Index just past the first complete event in `buffer`, or 0."""
    ends = [i + len(sep) for sep in _EVENT_ENDS if (i := buffer.find(sep)) >= 0]
    return min(ends, default=0)


def last_event_end(buffer: bytes) -> int:
    """Index just past the last complete event in `buffer`, or 0."""
    ends = [i + len(sep) for sep in _EVENT_ENDS if (i := buffer.rfind(sep)) >= 0]
    return max(ends, default=0)
