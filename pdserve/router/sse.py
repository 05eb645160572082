"""Finding where a decode stream really starts.

An OpenAI-style stream may open with events that carry no token (a chat stream's
`{"delta": {"role": "assistant"}}` head), sent before the decode instance has the KV. The
router holds such events back and treats D as started at its first *substantive* event:
one with text, a finish reason, an error, usage, or `[DONE]`. Until then a failing P leg
can still cancel D and give the client a clean JSON error, and the handoff metric measures
the real handoff.

The SSE format itself (reading events' data, finding where events end, writing one) is
`pdserve.sse`'s; this module only decides what the router does with D's events.
"""

from __future__ import annotations

from typing import Any

import msgspec

from pdserve.sse import (
    SseDecoder,
    data_event_bytes,
    events_data,
    first_event_end,
    last_event_end,
)

# A stream that sends this much without a substantive event is taken as started anyway.
MAX_HELD_BYTES = 64 * 1024


class StreamStartDetector:
    """Fed D's raw bytes in order; `started` turns True at the first substantive event.
    Owns only its decoder; the bytes themselves are kept by the caller."""

    def __init__(self) -> None:
        self._decoder = SseDecoder()
        self._held = 0
        self.started = False

    def feed(self, chunk: bytes) -> bool:
        """Scan `chunk`; returns `started`."""
        if self.started:
            return True
        self._held += len(chunk)
        events = self._decoder.feed(chunk)
        self.started = self._held > MAX_HELD_BYTES or any(map(starts_answer, events))
        return self.started


def is_substantive(event: bytes) -> bool:
    """Whether one SSE event (without its blank-line terminator) starts the answer; an
    event without data (a comment or keep-alive) does not."""
    return any(map(starts_answer, events_data(event + b"\n\n")))


def starts_answer(data: str) -> bool:
    """Whether an event with this data starts the answer."""
    if data == "[DONE]":
        return True
    try:
        payload = msgspec.json.decode(data)
    except msgspec.DecodeError:
        return True  # not JSON we understand: do not hold it back
    if not isinstance(payload, dict):
        return True
    if payload.get("error") is not None or payload.get("usage") is not None:
        return True
    choices = payload.get("choices")
    return not isinstance(choices, list) or any(_choice_has_output(c) for c in choices)


def _choice_has_output(choice: Any) -> bool:
    if not isinstance(choice, dict):
        return True
    # Completions: instances send one event per step with tokens, even when the tokens end
    # mid-character and the text is still empty: each is output (TTFT counts from it).
    if "text" in choice or choice.get("finish_reason"):
        return True
    delta = choice.get("delta")
    if not isinstance(delta, dict):
        return False
    # Chat: only the opening role-only delta is not output; token events carry no role.
    return not delta.get("role") or any(v for k, v in delta.items() if k != "role")


class EventAnnotator:
    """Adds `{"pdserve": note}` to the first JSON-object data event of a byte stream, then
    passes bytes through untouched. Holds at most one incomplete event at a time."""

    def __init__(self, note: dict[str, Any]) -> None:
        self._note = note
        self._held = b""
        self.done = False

    def feed(self, chunk: bytes) -> bytes:
        """The bytes to send now (possibly none while an event is incomplete)."""
        if self.done:
            return chunk
        self._held += chunk
        out = []
        while not self.done and (end := first_event_end(self._held)) > 0:
            event, self._held = self._held[:end], self._held[end:]
            annotated = _annotate(event, self._note)
            self.done = annotated is not None
            out.append(annotated or event)
        if self.done or len(self._held) > MAX_HELD_BYTES:
            self.done = True  # give up rather than hold a stream we cannot parse
            out.append(self._held)
            self._held = b""
        return b"".join(out)

    def flush(self) -> bytes:
        """What is still held at the end of the stream."""
        held, self._held = self._held, b""
        return held


class CompleteEvents:
    """Passes on only whole events, holding back the bytes after the last event's end, so
    that a stream cut inside an event never forwards half of it: the router's own error
    event then follows a clean boundary instead of completing a truncated line. Owned by
    one relay; no cost to a stream whose chunks end at event boundaries (D's do)."""

    def __init__(self) -> None:
        self._held = b""

    def feed(self, data: bytes) -> bytes:
        data = self._held + data
        end = last_event_end(data)
        self._held = data[end:]
        return data[:end]

    def flush(self) -> bytes:
        """The held tail, at a clean end of the stream (D closed it itself)."""
        held, self._held = self._held, b""
        return held


def _annotate(event: bytes, note: dict[str, Any]) -> bytes | None:
    data = events_data(event)
    if len(data) != 1:
        return None
    try:
        payload = msgspec.json.decode(data[0])
    except msgspec.DecodeError:
        return None
    if not isinstance(payload, dict):
        return None
    payload["pdserve"] = note
    return data_event_bytes(msgspec.json.encode(payload))
