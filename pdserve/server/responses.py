"""OpenAI response bodies of the two generation endpoints, whole and streamed.

One `ResponseFormat` per request knows its id, model, prompt and what logprobs were asked
for, and builds every body the request returns (for each of its `n` choices), so the
streaming loop in app.py is the same for both endpoints.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from pydantic import BaseModel

from pdserve.engine.types import FinishReason, RequestOutput
from pdserve.server.logprobs_format import (
    CompletionLogprobsBuilder,
    TokenDecoder,
    chat_logprobs,
)
from pdserve.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    DeltaMessage,
    FinishReasonStr,
    UsageInfo,
    now,
)
from pdserve.server.serving import Generation


def openai_finish_reason(reason: FinishReason | None) -> FinishReasonStr | None:
    """OpenAI knows "stop" and "length"; errors and aborts never reach a response body."""
    if reason is None:
        return None
    return "length" if reason is FinishReason.LENGTH else "stop"


class ResponseFormat(Protocol):
    """Builds the bodies of one request's response."""

    def head(self, n: int) -> list[BaseModel]:
        """Chunks to stream before the first output of `n` choices."""
        ...

    def chunk(
        self,
        index: int,
        out: RequestOutput,
        reason: FinishReason | None,
        kv_transfer_params: dict[str, Any] | None,
    ) -> BaseModel:
        """One streamed increment of choice `index`; `reason` is set on its last one."""
        ...

    def usage_chunk(self, num_output_tokens: int) -> BaseModel:
        """The extra last chunk of `stream_options.include_usage`."""
        ...

    def full(self, gens: list[Generation]) -> BaseModel:
        """The non-streamed response (one generation per choice)."""
        ...


class _Base:
    def __init__(self, response_id: str, model: str, num_prompt_tokens: int) -> None:
        self.id = response_id
        self.model = model
        self.num_prompt_tokens = num_prompt_tokens
        self.created = now()

    def usage(self, num_output_tokens: int) -> UsageInfo:
        return UsageInfo.of(self.num_prompt_tokens, num_output_tokens)


@dataclass(frozen=True)
class Echo:
    """The prompt of a completion with `echo`: its text and ids (for logprobs)."""

    text: str
    token_ids: list[int]


class CompletionFormat(_Base):
    """Bodies of /v1/completions (`text_completion` objects). With `echo` the prompt opens
    each choice's text (and its logprobs, the first one None); `logprobs` is the number of
    top logprobs asked for, None for no logprobs."""

    def __init__(
        self,
        response_id: str,
        model: str,
        num_prompt_tokens: int,
        token_ids: bool = False,
        tokenizer: TokenDecoder | None = None,
        logprobs: int | None = None,
        echo: Echo | None = None,
    ) -> None:
        super().__init__(response_id, model, num_prompt_tokens)
        self.token_ids = token_ids
        self.tok = tokenizer
        self.k = logprobs
        self.echo = echo
        self._builders: dict[int, CompletionLogprobsBuilder] = {}
        self._started: set[int] = set()

    def _body(self, choices: list[CompletionChoice], **extra: Any) -> CompletionResponse:
        return CompletionResponse(
            id=self.id, created=self.created, model=self.model, choices=choices, **extra
        )

    def head(self, n: int) -> list[BaseModel]:
        return []

    def _logprobs(
        self,
        index: int,
        ids: list[int],
        lps: list[Any] | None,
        prompt_lps: list[Any] | None,
    ) -> CompletionLogprobs | None:
        if self.k is None or self.tok is None:
            return None
        builder = self._builders.setdefault(index, CompletionLogprobsBuilder(self.tok, self.k))
        lps = lps if lps is not None else [None] * len(ids)
        if self.echo is not None and prompt_lps is not None:
            ids = self.echo.token_ids + ids
            lps = _padded(prompt_lps, len(self.echo.token_ids)) + lps
        return builder.build(ids, lps)

    def chunk(
        self,
        index: int,
        out: RequestOutput,
        reason: FinishReason | None,
        kv_transfer_params: dict[str, Any] | None,
    ) -> CompletionResponse:
        first = index not in self._started
        self._started.add(index)
        text = out.new_text
        prompt_lps = out.prompt_logprobs
        if first and self.echo is not None:
            text = self.echo.text + text
            prompt_lps = prompt_lps or []
        elif not first:
            prompt_lps = None
        choice = CompletionChoice(
            index=index,
            text=text,
            logprobs=self._logprobs(index, out.new_token_ids, out.new_logprobs, prompt_lps),
            finish_reason=openai_finish_reason(reason),
        )
        return self._body([choice], kv_transfer_params=kv_transfer_params)

    def usage_chunk(self, num_output_tokens: int) -> CompletionResponse:
        return self._body([], usage=self.usage(num_output_tokens))

    def full(self, gens: list[Generation]) -> CompletionResponse:
        choices = []
        for i, gen in enumerate(gens):
            ids = gen.token_ids or []
            prompt_lps = (gen.prompt_logprobs or []) if self.echo is not None else None
            choices.append(
                CompletionChoice(
                    index=i,
                    text=(self.echo.text if self.echo else "") + gen.text,
                    logprobs=self._logprobs(i, ids, gen.logprobs, prompt_lps),
                    finish_reason=openai_finish_reason(gen.finish_reason),
                    token_ids=ids if self.token_ids else None,
                )
            )
        return self._body(
            choices,
            usage=self.usage(sum(g.num_output_tokens for g in gens)),
            kv_transfer_params=gens[0].kv_transfer_params,
        )


class ChatFormat(_Base):
    """Bodies of /v1/chat/completions (`chat.completion` and `chat.completion.chunk`);
    `top_logprobs` None: no logprobs."""

    def __init__(
        self,
        response_id: str,
        model: str,
        num_prompt_tokens: int,
        tokenizer: TokenDecoder | None = None,
        top_logprobs: int | None = None,
    ) -> None:
        super().__init__(response_id, model, num_prompt_tokens)
        self.tok = tokenizer
        self.k = top_logprobs

    def _chunk(self, choices: list[ChatChunkChoice], **extra: Any) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.id, created=self.created, model=self.model, choices=choices, **extra
        )

    def _logprobs(self, ids: list[int], lps: list[Any] | None) -> ChatLogprobs | None:
        if self.k is None or self.tok is None:
            return None
        return chat_logprobs(self.tok, ids, lps or [None] * len(ids), self.k)

    def head(self, n: int) -> list[BaseModel]:
        # OpenAI opens every chat stream with the role (one chunk per choice).
        role = DeltaMessage(role="assistant", content="")
        return [self._chunk([ChatChunkChoice(index=i, delta=role)]) for i in range(n)]

    def chunk(
        self,
        index: int,
        out: RequestOutput,
        reason: FinishReason | None,
        kv_transfer_params: dict[str, Any] | None,
    ) -> ChatCompletionChunk:
        delta = DeltaMessage(content=out.new_text or None)
        choice = ChatChunkChoice(
            index=index,
            delta=delta,
            logprobs=self._logprobs(out.new_token_ids, out.new_logprobs),
            finish_reason=openai_finish_reason(reason),
        )
        return self._chunk([choice], kv_transfer_params=kv_transfer_params)

    def usage_chunk(self, num_output_tokens: int) -> ChatCompletionChunk:
        return self._chunk([], usage=self.usage(num_output_tokens))

    def full(self, gens: list[Generation]) -> ChatCompletionResponse:
        choices = [
            ChatChoice(
                index=i,
                message=AssistantMessage(content=gen.text),
                logprobs=self._logprobs(gen.token_ids or [], gen.logprobs),
                finish_reason=openai_finish_reason(gen.finish_reason),
            )
            for i, gen in enumerate(gens)
        ]
        return ChatCompletionResponse(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=self.usage(sum(g.num_output_tokens for g in gens)),
            kv_transfer_params=gens[0].kv_transfer_params,
        )


def _padded(prompt_lps: list[Any], n: int) -> list[Any]:
    """The prompt's logprobs, one per prompt token (None where the engine sent none)."""
    return (list(prompt_lps) + [None] * n)[:n]
