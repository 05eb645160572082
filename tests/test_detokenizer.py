"""Incremental detokenization and stop strings, on a byte-level toy decoder."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import given
from hypothesis import strategies as st

from pdserve.engine.detokenizer import IncrementalDetokenizer


class ByteDecoder:
    """Token id = one byte, like a byte-level BPE with no merges."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def stream(text: str, stop: Sequence[str] = ()) -> tuple[str, bool]:
    d = IncrementalDetokenizer(ByteDecoder(), stop)
    pieces, stopped = [], False
    for b in text.encode():
        stopped = d.append(b)
        pieces.append(d.take(final=stopped))
        if stopped:
            break
    if not stopped:
        pieces.append(d.take(final=True))
    return "".join(pieces), stopped


@given(st.text(max_size=60))
def test_streamed_pieces_concatenate_to_the_full_text(text: str) -> None:
    assert stream(text) == (text, False)


def test_multibyte_characters_are_never_split() -> None:
    d = IncrementalDetokenizer(ByteDecoder())
    pieces = []
    for b in "héllo €".encode():
        d.append(b)
        pieces.append(d.take(final=False))
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == "héllo €"


def test_stop_string_truncates_and_is_not_emitted() -> None:
    assert stream("hello world. more", stop=["world"]) == ("hello ", True)


def test_stop_string_across_tokens_is_held_back() -> None:
    d = IncrementalDetokenizer(ByteDecoder(), ["END"])
    emitted = ""
    for b in b"abcEN":
        d.append(b)
        emitted += d.take(final=False)
    assert emitted == "abc"  # "EN" might start "END": held back
    assert d.append(ord("D"))
    assert emitted + d.take(final=True) == "abc"


@given(st.text(alphabet="ab", max_size=30), st.text(alphabet="ab", min_size=1, max_size=3))
def test_stop_matches_first_occurrence(text: str, stop: str) -> None:
    out, stopped = stream(text, [stop])
    if stop in text:
        assert stopped and out == text[: text.index(stop)]
    else:
        assert not stopped and out == text


def test_stop_strings_wait_for_check_stop() -> None:
    """Before a request's `min_tokens` a stop string neither stops nor cuts the text."""
    d = IncrementalDetokenizer(ByteDecoder(), ["b"])
    assert [d.append(x, check_stop=False) for x in b"abab"] == [False] * 4
    assert d.append(ord("c"), check_stop=True) is False  # the old "b"s are not looked for
    assert d.append(ord("b"), check_stop=True) is True
    assert d.take(final=True) == "ababc"
