"""Incremental detokenization with stop strings.

Decoding a growing token list one token at a time is wrong for byte-level tokenizers
(a character can span tokens) and slow if the whole list is decoded each step. We
keep two offsets into the output ids, as vLLM does: text is only emitted once the
decoded window no longer ends in an incomplete character (U+FFFD).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class _Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns appended token ids into new text; finds stop strings.

    `text` is all text produced so far (stop string excluded once matched); `emitted`
    is how much of it has been handed out. With stop strings, the last
    `max(len(stop)) - 1` characters are held back until they cannot start a match.
    """

    def __init__(self, tokenizer: _Decoder, stop: Sequence[str] = ()) -> None:
        self._tok = tokenizer
        self._ids: list[int] = []
        self._prefix = 0  # start of the decode window
        self._read = 0  # ids before this are already reflected in `text`
        self.text = ""
        self.emitted = 0
        self._stop = tuple(s for s in stop if s)
        self._hold = max((len(s) for s in self._stop), default=1) - 1

    def append(self, token_id: int, check_stop: bool = True) -> bool:
        """Add one token; returns True if a stop string now ends the text (never without
        `check_stop`: before a request's `min_tokens`, stop strings do not count)."""
        self._ids.append(token_id)
        prefix_text = self._tok.decode(self._ids[self._prefix : self._read])
        full = self._tok.decode(self._ids[self._prefix :])
        if len(full) <= len(prefix_text) or full.endswith("\ufffd"):
            return False
        old_len = len(self.text)
        self.text += full[len(prefix_text) :]
        self._prefix, self._read = self._read, len(self._ids)
        return check_stop and self._find_stop(old_len)

    def _find_stop(self, old_len: int) -> bool:
        if not self._stop:
            return False
        start = max(0, old_len - self._hold)
        hits = [i for s in self._stop if (i := self.text.find(s, start)) >= 0]
        if not hits:
            return False
        self.text = self.text[: min(hits)]
        return True

    def take(self, final: bool) -> str:
        """The text not yet handed out; keeps a possible stop-string prefix unless final."""
        end = len(self.text) if final else max(self.emitted, len(self.text) - self._hold)
        new = self.text[self.emitted : end]
        self.emitted = end
        return new
