"""Pydantic models of the OpenAI-compatible HTTP API (requests and responses).

Requests are validated strictly (`"max_tokens": "5"` or `1.5` is an error, not a coercion) so
a client's type mistake is reported instead of guessed at. Checks that need the model
(lengths, vocabulary, model name) live in `pdserve.server.serving`, not here. Unknown fields
are ignored, as OpenAI-compatible servers do, but the OpenAI options this server cannot honour
are declared so that setting them gets a clear 400 instead of being silently dropped.

Extensions beyond OpenAI's API (vLLM spells them the same): `top_k`, `ignore_eos`,
`stop_token_ids`, `min_tokens`, `repetition_penalty`, and
`kv_transfer_params` (P/D disaggregation, echoed back in responses). docs/api.md lists every
parameter and its range.

Limits: at most 64 stop strings of at most 1,000 characters each, at most 1,024
`stop_token_ids`, at most 1,024 `logit_bias` entries, `n` at most 16, at most 20 top
logprobs; the whole body at most 32 MiB (`pdserve.server.body_limit`, a 413).
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
)

from pdserve.token_logprob import MAX_LOGPROBS

# The range torch.Generator.manual_seed accepts without wrapping.
_SEED_MAX = 2**63 - 1
SEED_MAX = _SEED_MAX  # public: the router checks the seeds of choices it fans out

# Bounds on per-token work a client can ask for (OpenAI allows 4 stop sequences, vLLM has no
# limit): every stop string is looked for in the new text after each token, and
# `stop_token_ids` is searched for each sampled token.
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1000
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024
# Each of the n choices is its own engine request (pdserve.server.fanout).
MAX_N = 16

_Penalty = Annotated[float, Field(ge=-2.0, le=2.0, allow_inf_nan=False)]
_TopLogprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False


class SamplingFields(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None  # None: the served model (convenient with curl)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)  # extension; 0 or -1: disabled
    seed: int | None = Field(default=None, ge=0, le=_SEED_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: Annotated[list[int], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    ignore_eos: bool = False  # extension
    min_tokens: int = Field(default=0, ge=0)  # extension
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: _Penalty | None = None
    frequency_penalty: _Penalty | None = None
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=100.0)  # extension
    logit_bias: (
        Annotated[
            dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]],
            Field(max_length=MAX_LOGIT_BIAS),
        ]
        | None
    ) = None
    user: str | None = None
    # P/D disaggregation (vLLM's wire name); echoed back when the engine output carries it.
    kv_transfer_params: dict[str, Any] | None = None

    @field_validator("stop")
    @classmethod
    def _bounded_stop(cls, stop: str | list[str] | None) -> str | list[str] | None:
        strings = [stop] if isinstance(stop, str) else stop or []
        if len(strings) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings ({len(strings)} given)")
        if any(len(x) > MAX_STOP_CHARS for x in strings):
            raise ValueError(f"a stop string may have at most {MAX_STOP_CHARS} characters")
        return stop


PromptInput = str | list[int] | list[str] | list[list[int]]


class CompletionRequest(SamplingFields):
    """POST /v1/completions. `max_tokens` defaults to 16 (OpenAI's default)."""

    prompt: PromptInput
    max_tokens: int | None = Field(default=None, ge=0)  # 0: only with echo (the prompt only)
    logprobs: _TopLogprobs | None = None  # with echo, the prompt's tokens get them too
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None
    return_token_ids: bool = False  # extension (vLLM's name): generated ids in the choice


class TextContentPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        """The message content as one string (text parts joined)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions. Without `max_tokens` / `max_completion_tokens` the reply may
    use the whole remaining context."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: _TopLogprobs | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None


# -- responses ------------------------------------------------------------------------------


def now() -> int:
    """`created` timestamps: Unix seconds."""
    return int(time.time())


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> UsageInfo:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )


FinishReasonStr = Literal["stop", "length"]


class CompletionLogprobs(BaseModel):
    """The `logprobs` of a completion choice: parallel lists, one entry per token (the
    prompt's first, with echo, has None: nothing predicts it)."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReasonStr | None
    token_ids: list[int] | None = None  # with return_token_ids (non-streamed)


class CompletionResponse(BaseModel):
    """Both the whole non-streaming response and each streamed chunk (same shape in OpenAI's
    API: chunks carry partial `text`, `usage` only in the optional last chunk)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    kv_transfer_params: dict[str, Any] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReasonStr | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    kv_transfer_params: dict[str, Any] | None = None


class DeltaMessage(BaseModel):
    """A chat stream increment; unset fields are left out (`{}` in the last chunk)."""

    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReasonStr | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None
    kv_transfer_params: dict[str, Any] | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "pdserve"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
