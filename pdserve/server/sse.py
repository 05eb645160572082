"""Writing one server-sent event so that every client reads its line back whole.

JSON encoders (pydantic, msgspec) write U+2028, U+2029 and U+0085 raw inside strings, and
model output contains them. The SSE spec does not end a line there, but clients that split
lines like `str.splitlines` do (httpx's `aiter_lines`, httpx-sse before 0.4.2), and they
then fail on half an event. JSON allows these characters only inside strings, where the
`\\uXXXX` escape means the same text, so escaping them everywhere is lossless.
"""

from __future__ import annotations

_ESCAPES = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"})


def data_event(json_text: str) -> str:
    """`data: {json_text}` and the blank line that ends the event. `json_text` is one
    compact JSON document (no raw CR or LF, as every JSON encoder writes it)."""
    return f"data: {json_text.translate(_ESCAPES)}\n\n"


def data_event_bytes(json_bytes: bytes) -> bytes:
    """`data_event` of UTF-8 JSON, as UTF-8."""
    return data_event(json_bytes.decode()).encode()
