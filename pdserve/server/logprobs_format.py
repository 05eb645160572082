"""Logprobs in OpenAI's two shapes, from the engine's `TokenLogprob`s (vLLM's choices).

Completions: `{tokens, token_logprobs, top_logprobs, text_offset}`, parallel lists; each
`top_logprobs` entry maps token text to logprob for the token itself and the `k` most likely
(so it holds k or k + 1 entries); `text_offset` is where each token's text starts, counted
from the start of the choice's text (the prompt's, with echo). Chat: `{content: [{token,
logprob, bytes, top_logprobs: [k entries, most likely first]}]}`.

A token's text is its own decoding (`decode([id])`, special tokens kept), which may be
U+FFFD for a byte that only completes a character together with the next tokens.
`-inf` is reported as -9999.0 (JSON has no infinity), as OpenAI and vLLM do.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from pdserve.server.protocol import (
    ChatLogprobs,
    ChatTokenLogprob,
    ChatTopLogprob,
    CompletionLogprobs,
)
from pdserve.token_logprob import TokenLogprob

_FLOOR = -9999.0


class TokenDecoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


def _text(tok: TokenDecoder, token_id: int) -> str:
    return tok.decode([token_id], skip_special_tokens=False)


def _value(logprob: float) -> float:
    return max(logprob, _FLOOR)


class CompletionLogprobsBuilder:
    """Builds a choice's completion logprobs piece by piece (a stream's chunks continue the
    text offsets of the chunks before them)."""

    def __init__(self, tok: TokenDecoder, k: int) -> None:
        self._tok = tok
        self._k = k
        self._offset = 0

    def build(
        self, token_ids: Sequence[int], logprobs: Sequence[TokenLogprob | None]
    ) -> CompletionLogprobs:
        """Logprobs of `token_ids` (a None entry: a position without logprobs)."""
        out = CompletionLogprobs()
        for token_id, lp in zip(token_ids, logprobs, strict=True):
            text = _text(self._tok, token_id)
            out.tokens.append(text)
            out.text_offset.append(self._offset)
            self._offset += len(text)
            if lp is None:
                out.token_logprobs.append(None)
                out.top_logprobs.append(None)
                continue
            out.token_logprobs.append(_value(lp.logprob))
            top = {text: _value(lp.logprob)}
            for tid, value in zip(lp.top_ids[: self._k], lp.top_logprobs, strict=False):
                top.setdefault(_text(self._tok, tid), _value(value))
            out.top_logprobs.append(top)
        return out


def chat_logprobs(
    tok: TokenDecoder, token_ids: Sequence[int], logprobs: Sequence[TokenLogprob | None], k: int
) -> ChatLogprobs:
    """The chat `logprobs` of `token_ids`; a position without logprobs gets -9999.0."""
    content = []
    for token_id, lp in zip(token_ids, logprobs, strict=True):
        text = _text(tok, token_id)
        value = _FLOOR if lp is None else _value(lp.logprob)
        top = [] if lp is None else _chat_top(tok, lp, k)
        content.append(
            ChatTokenLogprob(token=text, logprob=value, bytes=_bytes(text), top_logprobs=top)
        )
    return ChatLogprobs(content=content)


def _chat_top(tok: TokenDecoder, lp: TokenLogprob, k: int) -> list[ChatTopLogprob]:
    pairs = zip(lp.top_ids[:k], lp.top_logprobs, strict=False)
    return [
        ChatTopLogprob(token=(t := _text(tok, tid)), logprob=_value(v), bytes=_bytes(t))
        for tid, v in pairs
    ]


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))
