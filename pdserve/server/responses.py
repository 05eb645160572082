"""OpenAI response bodies of the two generation endpoints, whole and streamed.

One `ResponseFormat` per request knows its id, model and prompt size and builds every body
the request returns, so the streaming loop in app.py is the same for both endpoints.
"""

from __future__ import annotations

from typing import Any, Protocol

from pydantic import BaseModel

from pdserve.engine.types import FinishReason
from pdserve.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionChoice,
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

    def head(self) -> list[BaseModel]:
        """Chunks to stream before the first output."""
        ...

    def chunk(
        self, text: str, reason: FinishReason | None, kv_transfer_params: dict[str, Any] | None
    ) -> BaseModel:
        """One streamed increment; `reason` is set on the last one."""
        ...

    def usage_chunk(self, num_output_tokens: int) -> BaseModel:
        """The extra last chunk of `stream_options.include_usage`."""
        ...

    def full(self, gen: Generation) -> BaseModel:
        """The non-streamed response."""
        ...


class _Base:
    def __init__(self, response_id: str, model: str, num_prompt_tokens: int) -> None:
        self.id = response_id
        self.model = model
        self.num_prompt_tokens = num_prompt_tokens
        self.created = now()

    def usage(self, num_output_tokens: int) -> UsageInfo:
        return UsageInfo.of(self.num_prompt_tokens, num_output_tokens)


class CompletionFormat(_Base):
    """Bodies of /v1/completions (`text_completion` objects)."""

    def __init__(
        self, response_id: str, model: str, num_prompt_tokens: int, token_ids: bool = False
    ) -> None:
        super().__init__(response_id, model, num_prompt_tokens)
        self.token_ids = token_ids

    def _body(self, choices: list[CompletionChoice], **extra: Any) -> CompletionResponse:
        return CompletionResponse(
            id=self.id, created=self.created, model=self.model, choices=choices, **extra
        )

    def head(self) -> list[BaseModel]:
        return []

    def chunk(
        self, text: str, reason: FinishReason | None, kv_transfer_params: dict[str, Any] | None
    ) -> CompletionResponse:
        choice = CompletionChoice(text=text, finish_reason=openai_finish_reason(reason))
        return self._body([choice], kv_transfer_params=kv_transfer_params)

    def usage_chunk(self, num_output_tokens: int) -> CompletionResponse:
        return self._body([], usage=self.usage(num_output_tokens))

    def full(self, gen: Generation) -> CompletionResponse:
        choice = CompletionChoice(
            text=gen.text,
            finish_reason=openai_finish_reason(gen.finish_reason),
            token_ids=gen.token_ids if self.token_ids else None,
        )
        return self._body(
            [choice],
            usage=self.usage(gen.num_output_tokens),
            kv_transfer_params=gen.kv_transfer_params,
        )


class ChatFormat(_Base):
    """Bodies of /v1/chat/completions (`chat.completion` and `chat.completion.chunk`)."""

    def _chunk(self, choices: list[ChatChunkChoice], **extra: Any) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.id, created=self.created, model=self.model, choices=choices, **extra
        )

    def head(self) -> list[BaseModel]:
        # OpenAI opens every chat stream with the role.
        return [self._chunk([ChatChunkChoice(delta=DeltaMessage(role="assistant", content=""))])]

    def chunk(
        self, text: str, reason: FinishReason | None, kv_transfer_params: dict[str, Any] | None
    ) -> ChatCompletionChunk:
        delta = DeltaMessage(content=text or None)
        choice = ChatChunkChoice(delta=delta, finish_reason=openai_finish_reason(reason))
        return self._chunk([choice], kv_transfer_params=kv_transfer_params)

    def usage_chunk(self, num_output_tokens: int) -> ChatCompletionChunk:
        return self._chunk([], usage=self.usage(num_output_tokens))

    def full(self, gen: Generation) -> ChatCompletionResponse:
        choice = ChatChoice(
            message=AssistantMessage(content=gen.text),
            finish_reason=openai_finish_reason(gen.finish_reason),
        )
        return ChatCompletionResponse(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=[choice],
            usage=self.usage(gen.num_output_tokens),
            kv_transfer_params=gen.kv_transfer_params,
        )
