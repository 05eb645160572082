"""`SseDecoder`: the events' data of an SSE byte stream, however it is chunked."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from pdserve.sse import SseDecoder

# Any text but the three line ends; U+2028, U+2029 and U+0085 included (not line ends in SSE).
LINE_TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\r\n"))
LINE_END = st.sampled_from(["\n", "\r\n", "\r"])
OTHER_LINE = st.sampled_from([": keep-alive", ":", "event: message", "id: 7", "retry: 10"])


def _decode_all(stream: bytes, cuts: list[int]) -> list[str]:
    decoder = SseDecoder()
    bounds = [0, *sorted(cuts), len(stream)]
    pieces = [stream[a:b] for a, b in itertools.pairwise(bounds)]
    events = [data for piece in pieces for data in decoder.feed(piece)]
    return events + decoder.end()


@st.composite
def streams(draw: st.DrawFn) -> tuple[bytes, list[str], list[int]]:
    """An SSE stream of whole events, the data each carries, and where to cut it."""
    # One line end per stream: a CR line end followed by an LF one would read as one CRLF.
    text, expected, end = "", [], draw(LINE_END)
    for _ in range(draw(st.integers(0, 6))):
        data = draw(st.lists(LINE_TEXT, max_size=3))
        lines = [f"data: {d}" for d in data] + draw(st.lists(OTHER_LINE, max_size=2))
        lines = draw(st.permutations(lines))  # the data: its lines in the order sent
        data = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
        text += "".join(line + end for line in lines) + end
        if data:
            expected.append("\n".join(data))
    stream = text.encode()
    cuts = draw(st.lists(st.integers(0, len(stream)), max_size=8))
    return stream, expected, cuts


@given(streams())
def test_events_survive_any_chunking(case: tuple[bytes, list[str], list[int]]) -> None:
    stream, expected, cuts = case
    assert _decode_all(stream, cuts) == expected


def test_field_parsing() -> None:
    stream = b"data:no-space\n\ndata:  two spaces\n\ndata\n\ndatum: not data\n\n:data: x\n\n"
    assert _decode_all(stream, []) == ["no-space", " two spaces", ""]


def test_byte_order_mark_once_and_final_bare_cr() -> None:
    bom = b"\xef\xbb\xbf"
    stream = bom + b"data: a\r\rdata: b\r\r"
    assert _decode_all(stream, [1, 2, 9]) == ["a", "b"]
    assert _decode_all(stream + bom + b"data: c\n\n", []) == ["a", "b"]  # not a field name


def test_an_event_without_its_blank_line_is_dropped() -> None:
    assert _decode_all(b"data: whole\n\ndata: cut\n", []) == ["whole"]
    assert _decode_all(b"data: whole\n\ndata: cut", []) == ["whole"]


def test_invalid_utf8_is_replaced_not_raised() -> None:
    assert _decode_all(b"data: \xff\xfe ok\n\n", []) == ["\ufffd\ufffd ok"]
