"""SSE data events keep each JSON document on one line for every line-splitting client."""

from __future__ import annotations

import json

import msgspec

from pdserve.sse import data_event, data_event_bytes

TEXT = "a\u2028b\u2029c\x85d é 中 \\u2028"  # the last is an escape already: stays as it is


def test_separators_are_escaped_losslessly() -> None:
    for event in (
        data_event(json.dumps({"text": TEXT}, ensure_ascii=False)),
        data_event_bytes(msgspec.json.encode({"text": TEXT})).decode(),
    ):
        assert event.startswith("data: ") and event.endswith("\n\n")
        assert event.splitlines() == [event[:-2], ""]  # str.splitlines breaks at U+2028 too
        assert json.loads(event.removeprefix("data: "))["text"] == TEXT
        assert "é 中" in event  # other non-ASCII is left raw
