"""The benchmark client's SSE line splitter: lines end at CRLF, LF and CR only, wherever the
body's chunk boundaries fall."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import AsyncIterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdserve.bench.sse_lines import SSELineSplitter, aiter_sse_lines

# Every character str.splitlines breaks at besides CR and LF; JSON writes the last three raw.
NOT_SSE_BREAKS = "\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"
TEXT = "a\u2028b\u2029c\x85d é 中"


def _event(text: str) -> bytes:
    body = {"choices": [{"index": 0, "text": text}]}
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n".encode()


BODY = _event(TEXT) + b": ping\r\n\r\n" + _event("x") + b"data: [DONE]\r\r"
LINES = [f"data: {json.dumps({'choices': [{'index': 0, 'text': TEXT}]}, ensure_ascii=False)}"]
LINES += ["", ": ping", "", LINES[0].replace(TEXT, "x"), "", "data: [DONE]", ""]


def _split(body: bytes, cuts: list[int]) -> list[str]:
    splitter = SSELineSplitter()
    bounds = [0, *sorted(cuts), len(body)]
    lines = [line for a, b in itertools.pairwise(bounds) for line in splitter.feed(body[a:b])]
    return lines + splitter.flush()


def test_unicode_separators_stay_inside_a_line() -> None:
    assert len(BODY.decode().splitlines()) > len(LINES)  # what httpx's aiter_lines would do
    assert _split(BODY, []) == LINES
    assert json.loads(LINES[0].removeprefix("data: "))["choices"][0]["text"] == TEXT


def test_every_single_cut() -> None:
    # Cuts inside CRLF, inside a multi-byte character and inside a "data:" prefix included.
    for cut in range(len(BODY) + 1):
        assert _split(BODY, [cut]) == LINES, cut


def test_one_byte_chunks() -> None:
    assert _split(BODY, list(range(len(BODY)))) == LINES


@given(st.lists(st.integers(0, len(BODY)), max_size=8))
def test_any_chunking(cuts: list[int]) -> None:
    assert _split(BODY, cuts) == LINES


@pytest.mark.parametrize("ch", list(NOT_SSE_BREAKS))
def test_no_other_character_ends_a_line(ch: str) -> None:
    assert _split(f"data: {ch}x\n".encode(), []) == [f"data: {ch}x"]


def test_a_cut_stream_ends_with_its_partial_line() -> None:
    body = _event("x") + b'data: {"choices": [{"te'
    assert _split(body, [len(body) - 3]) == [*LINES[4:6], 'data: {"choices": [{"te']
    assert _split(b"a\r", []) == ["a"]  # a bare CR at the very end still ends its line


def test_async_iteration() -> None:
    async def chunks() -> AsyncIterator[bytes]:
        for i in range(0, len(BODY), 7):
            yield BODY[i : i + 7]

    async def collect() -> list[str]:
        return [line async for line in aiter_sse_lines(chunks())]

    assert asyncio.run(collect()) == LINES
