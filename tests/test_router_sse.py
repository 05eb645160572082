"""Where a decode stream starts: the first SSE event that carries output."""

from __future__ import annotations

import itertools

import msgspec
from hypothesis import given
from hypothesis import strategies as st

from pdserve.router.sse import (
    MAX_HELD_BYTES,
    EventAnnotator,
    StreamStartDetector,
    is_substantive,
)


def _event(payload: object) -> bytes:
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


HEAD = _event({"choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]})
TOKEN = _event({"choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": None}]})


def test_substantive_events() -> None:
    assert not is_substantive(HEAD[:-2])
    assert not is_substantive(b": keep-alive")
    assert is_substantive(TOKEN[:-2])
    assert is_substantive(_event({"choices": [{"index": 0, "text": "x"}]})[:-2])
    # A completion event for tokens that end mid-character has empty text but is output.
    assert is_substantive(_event({"choices": [{"index": 0, "text": ""}]})[:-2])
    assert is_substantive(
        _event({"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]})[:-2]
    )
    assert is_substantive(_event({"error": {"message": "boom"}})[:-2])
    assert is_substantive(b"data: [DONE]")
    assert is_substantive(b"data: not json")


@given(st.lists(st.integers(min_value=0, max_value=len(HEAD + HEAD + TOKEN)), max_size=8))
def test_start_does_not_depend_on_chunk_boundaries(cuts: list[int]) -> None:
    stream = HEAD + HEAD + TOKEN + TOKEN
    bounds = sorted({0, *cuts, len(stream)})
    detector = StreamStartDetector()
    fed = 0
    for a, b in itertools.pairwise(bounds):
        fed = b
        if detector.feed(stream[a:b]):
            break
    # Started exactly once the first token event's terminator has been seen.
    assert detector.started
    assert fed >= len(HEAD + HEAD + TOKEN)
    assert not StreamStartDetector().feed(stream[: len(HEAD + HEAD + TOKEN) - 1])


def test_a_long_stream_without_output_is_not_held_forever() -> None:
    detector = StreamStartDetector()
    assert not detector.feed(HEAD)
    assert detector.feed(b": pad\n\n" * (MAX_HELD_BYTES // 7 + 1))


@given(st.lists(st.integers(min_value=0, max_value=len(HEAD + TOKEN + TOKEN)), max_size=8))
def test_annotation_goes_into_the_first_json_event_whatever_the_chunking(cuts: list[int]) -> None:
    stream = b": comment\n\n" + HEAD + TOKEN + b"data: [DONE]\n\n"
    bounds = sorted({0, *cuts, len(stream)})
    annotator = EventAnnotator({"prefill_done": 1.5})
    out = b"".join(annotator.feed(stream[a:b]) for a, b in itertools.pairwise(bounds))
    out += annotator.flush()
    events = out.split(b"\n\n")
    assert events[0] == b": comment"
    head = msgspec.json.decode(events[1][len(b"data: ") :])
    assert head["pdserve"] == {"prefill_done": 1.5}
    assert head["choices"] == msgspec.json.decode(HEAD[6:])["choices"]
    assert out.endswith(TOKEN + b"data: [DONE]\n\n")


def test_annotation_keeps_line_separators_escaped_at_every_cut() -> None:
    # Re-encoding the first event must not write U+2028/2029/0085 raw: clients that split
    # lines like str.splitlines (httpx's aiter_lines) would cut that event in two.
    text = "a\u2028b\u2029c\x85d é"
    first = _event({"choices": [{"index": 0, "text": text}]})
    stream = first + TOKEN + b"data: [DONE]\n\n"
    for cut in range(len(stream) + 1):
        annotator = EventAnnotator({"prefill_done": 1.5})
        out = annotator.feed(stream[:cut]) + annotator.feed(stream[cut:]) + annotator.flush()
        annotated, rest = out.split(b"\n\n", 1)
        assert annotated.decode().splitlines() == [annotated.decode()], cut
        payload = msgspec.json.decode(annotated[len(b"data: ") :])
        assert payload["choices"][0]["text"] == text and payload["pdserve"]["prefill_done"] == 1.5
        assert rest == TOKEN + b"data: [DONE]\n\n"
