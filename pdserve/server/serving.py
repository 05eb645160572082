"""Between a parsed OpenAI request and the engine: validation against the model, submission,
and the stream of engine outputs (response bodies are built in responses.py).

The engine checks nothing about HTTP, so everything a client can get wrong is checked here,
before submission: model name, unsupported options, prompt tokens inside the vocabulary,
prompt and `max_tokens` inside the per-request capacity. What reaches the engine can run.

Defaults (documented in `--help` of `pdserve serve` too):
- `max_tokens` of /v1/completions: 16 (OpenAI's default), clamped to the room left.
- `max_tokens` of /v1/chat/completions: the room left (`capacity - prompt tokens`).
- capacity of one request: min(max model length, KV-cache blocks x block size), since a
  request longer than the whole KV cache could never be scheduled.
- `temperature` below 1e-5: greedy (as in vLLM; dividing by 1e-300 overflows the logits).

Hostile input is refused before it costs much: a text prompt far beyond the capacity is
refused after tokenizing a prefix (`encode_bounded`), token-id prompts are measured before
their ids are checked, and text that is not valid Unicode (lone surrogates) is a 400.

Errors of a finished generation (`finish_error`): an engine that stopped is a 503, an
abort a 503, a P/D request whose KV transfer failed a 502 `kv_transfer_error` naming the
cause (`kv_transfer_error`), anything else a 500 `engine_error`.

Ownership: a request's KV blocks belong to the engine thread. This module only holds the
async generator returned by `AsyncEngine.generate`; closing it (done by `aclosing` on every
path: normal end, error, client disconnect, cancellation) aborts the request, which is how
the engine gets its blocks back when a client goes away.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

from pdserve.engine.handle import EngineDeadError, EngineHandle
from pdserve.engine.types import EngineRequest, FinishReason, RequestOutput, SamplingParams
from pdserve.server.errors import APIError, bad_request
from pdserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    PromptInput,
    SamplingFields,
)
from pdserve.token_logprob import TokenLogprob
from pdserve.transfer.errors import TransferCause, parse_transfer_error
from pdserve.transfer.params import KVTransferParams

if TYPE_CHECKING:
    from pdserve.server.metrics import RequestTimer, ServerMetrics

COMPLETION_DEFAULT_MAX_TOKENS = 16
KV_TRANSFER_ERROR_TYPE = "kv_transfer_error"
# Temperatures below this sample greedily (vLLM's _SAMPLING_EPS).
_GREEDY_BELOW = 1e-5
# First prefix measured by `encode_bounded`, in characters per allowed token.
_CHARS_PER_TOKEN_PROBE = 8


class Tokenizer(Protocol):
    """What the server needs from `pdserve.model.tokenizer.Tokenizer`."""

    vocab_size: int

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(self, messages: list[dict[str, str]]) -> str: ...


@dataclass(frozen=True)
class Limits:
    """Per-request token limits of this instance."""

    max_model_len: int
    capacity: int  # tokens one request may hold: prompt + output
    vocab_size: int


@dataclass
class Generation:
    """The whole result of one non-streamed request."""

    text: str
    finish_reason: FinishReason
    num_output_tokens: int
    error: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    token_ids: list[int] | None = None
    logprobs: list[TokenLogprob | None] | None = None  # one per token, when asked
    prompt_logprobs: list[TokenLogprob | None] | None = None  # with echo + logprobs


class OpenAIServing:
    """Validates requests against the model and drives them through the `AsyncEngine`."""

    def __init__(self, engine: EngineHandle, served_model_name: str, metrics: ServerMetrics):
        self.engine = engine
        self.model_name = served_model_name
        self.metrics = metrics
        self.tokenizer: Tokenizer = engine.tokenizer
        stats = engine.stats()
        info = engine.info
        self.limits = Limits(
            max_model_len=info.max_model_len,
            capacity=min(info.max_model_len, stats.kv_blocks_total * info.block_size),
            vocab_size=self.tokenizer.vocab_size,
        )

    def models(self) -> ModelList:
        return ModelList(data=[self.model_card(self.model_name)])

    def model_card(self, model_id: str) -> ModelCard:
        """`GET /v1/models/{id}`: this server's model, or a 404 naming it."""
        self.check_model(model_id)
        return ModelCard(id=self.model_name, max_model_len=self.limits.max_model_len)

    def prompt_text(self, prompt: PromptInput, ids: list[int]) -> str:
        """A completion's prompt as text (echo): the client's string, or its ids decoded."""
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            return prompt[0]
        if isinstance(prompt, str):
            return prompt
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    # -- validation ------------------------------------------------------------------------
    def check_model(self, requested: str | None) -> None:
        if requested is not None and requested != self.model_name:
            raise APIError(
                HTTPStatus.NOT_FOUND,
                f"The model {requested!r} does not exist; this server serves {self.model_name!r}.",
                param="model",
                code="model_not_found",
            )

    def check_alive(self) -> None:
        if not self.engine.is_alive:
            why = f"it failed: {self.engine.error!r}" if self.engine.error else "shut down"
            raise APIError(
                HTTPStatus.SERVICE_UNAVAILABLE,
                f"The engine is not running ({why}).",
                code="engine_dead",
            )

    def check_parts(self) -> None:
        """A 503 naming what stopped when a thread or listener the KV connector needs is gone
        (an instance that cannot take part in P/D must not pass its health checks)."""
        metrics = self.engine.connector_metrics()
        if metrics is not None and metrics.stopped:
            raise APIError(
                HTTPStatus.SERVICE_UNAVAILABLE,
                f"The instance cannot serve P/D: stopped: {', '.join(metrics.stopped)}.",
                code="connector_stopped",
            )

    def completion_prompt(self, req: CompletionRequest) -> list[int]:
        _check_completion_options(req)
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise bad_request(
                    f"Batched prompts are not supported ({len(prompt)} given); send one "
                    "prompt per request.",
                    param="prompt",
                )
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = self._encode(prompt, "prompt", add_special_tokens=True) if prompt else []
        else:
            ids = list(prompt)
            self.check_prompt_length(len(ids))
            self.check_vocab(ids, "prompt")
        if not ids:
            raise bad_request("The prompt is empty.", param="prompt")
        return ids

    def chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        _check_chat_options(req)
        messages = [{"role": _template_role(m.role), "content": m.text()} for m in req.messages]
        try:
            rendered = self.tokenizer.apply_chat_template(messages)
        except ValueError as exc:  # no template, or raise_exception() for a bad role order
            msg = f"The chat template rejected the messages: {exc}"
            raise bad_request(msg, param="messages") from exc
        # The rendered prompt already holds its special tokens (BOS included).
        ids = self._encode(rendered, "messages", add_special_tokens=False)
        if not ids:
            raise bad_request("The messages render to an empty prompt.", param="messages")
        return ids

    def _encode(self, text: str, param: str, add_special_tokens: bool) -> list[int]:
        """Token ids of `text`; a 400 for text that is not Unicode or far too long."""
        if not _is_unicode(text):
            raise bad_request(
                "The text is not valid Unicode (it holds a lone surrogate).", param=param
            )
        ids = encode_bounded(self.tokenizer, text, self.limits.capacity, add_special_tokens)
        if ids is None:
            raise bad_request(
                f"The prompt has far more tokens than {self._capacity_text()} allows.",
                param=param,
                code="context_length_exceeded",
            )
        self.check_prompt_length(len(ids))
        return ids

    def check_prompt_length(self, num_prompt: int) -> None:
        """A 400 when a prompt of `num_prompt` tokens leaves no room for one output token."""
        if self.limits.capacity - num_prompt < 1:
            raise bad_request(
                f"The prompt has {num_prompt} tokens; {self._capacity_text()} leaves no room "
                "for output.",
                param="prompt",
                code="context_length_exceeded",
            )

    def check_vocab(self, ids: Sequence[int], param: str) -> None:
        bad = [t for t in ids if not 0 <= t < self.limits.vocab_size]
        if bad:
            raise bad_request(
                f"Token id {bad[0]} is outside the vocabulary [0, {self.limits.vocab_size}).",
                param=param,
            )

    def max_tokens(self, requested: int | None, default: int | None, num_prompt: int) -> int:
        """`requested` if it fits; else the default clamped to the room left."""
        self.check_prompt_length(num_prompt)
        room = self.limits.capacity - num_prompt
        if requested is None:
            return room if default is None else min(default, room)
        if requested > room:
            raise bad_request(
                f"prompt ({num_prompt} tokens) + max_tokens ({requested}) exceeds "
                f"{self._capacity_text()}; max_tokens can be at most {room}.",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return requested

    def _capacity_text(self) -> str:
        lim = self.limits
        if lim.capacity < lim.max_model_len:
            return f"the KV cache's capacity of {lim.capacity} tokens per request"
        return f"the maximum model length of {lim.max_model_len} tokens"

    def sampling_params(self, req: SamplingFields, max_tokens: int) -> SamplingParams:
        """The engine's params; `max_tokens` 0 (echo only) runs as 1, and the front end
        drops that token (`keep_output`)."""
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        stop_ids = list(req.stop_token_ids or [])
        self.check_vocab(stop_ids, "stop_token_ids")
        if req.min_tokens > max_tokens:
            raise bad_request(
                f"min_tokens ({req.min_tokens}) must be at most max_tokens ({max_tokens}).",
                param="min_tokens",
            )
        logprobs, prompt_logprobs = _logprobs_asked(req)
        return SamplingParams(
            max_tokens=max(max_tokens, 1),
            temperature=_temperature(req.temperature),
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=max(req.top_k or 0, 0),  # -1 (vLLM's "disabled") and 0 both disable it
            seed=req.seed,
            stop=tuple(stop),
            stop_token_ids=tuple(stop_ids),
            ignore_eos=req.ignore_eos,
            min_tokens=req.min_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=req.repetition_penalty or 1.0,
            logit_bias=self._logit_bias(req.logit_bias),
        )

    def _logit_bias(self, bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
        """OpenAI's `{"token id": bias}` as (id, bias) pairs; a 400 for a key that is not a
        token id of this model."""
        pairs = []
        for key, value in (bias or {}).items():
            if not key.isascii() or not key.isdigit() or not int(key) < self.limits.vocab_size:
                raise bad_request(
                    f"logit_bias key {key[:32]!r} is not a token id in [0, "
                    f"{self.limits.vocab_size}).",
                    param="logit_bias",
                )
            pairs.append((int(key), value))
        return tuple(pairs)

    def check_leg(self, params: SamplingParams, n: int, kv: KVTransferParams | None) -> None:
        """What a P/D leg cannot do: a decode leg never computes the prompt (no prompt
        logprobs), and one leg is one transfer (n = 1). The router sends such requests
        elsewhere (docs/api.md)."""
        if kv is None or not (kv.do_remote_prefill or kv.do_remote_decode):
            return
        if n != 1:
            raise bad_request("n > 1 cannot be combined with kv_transfer_params.", param="n")
        if kv.do_remote_prefill and params.prompt_logprobs is not None:
            raise bad_request(
                "Prompt logprobs (echo with logprobs) need the prompt computed here; a "
                "decode leg (do_remote_prefill) receives its KV instead.",
                param="echo",
            )

    # -- running ---------------------------------------------------------------------------
    async def stream(
        self, request: EngineRequest, timer: RequestTimer, keep_output: bool = True
    ) -> AsyncIterator[RequestOutput]:
        """The engine's outputs for `request`, up to the finished one; without
        `keep_output` (max_tokens 0) the generated token is dropped and it ends at once.

        Raises APIError before the first output if the request cannot be submitted (engine
        dead, request id in use). Closing this iterator early aborts the request.
        """
        self.check_alive()
        reason = "abort"
        try:
            async with aclosing(self.engine.generate(request)) as outputs:
                out: RequestOutput | None = await _first(outputs)
                while out is not None:
                    if not keep_output and out.finish_reason is not FinishReason.ERROR:
                        out = prompt_only(out)
                    timer.tokens(len(out.new_token_ids))
                    if out.finished:
                        reason = (out.finish_reason or FinishReason.ERROR).value
                    yield out
                    out = None if out.finished else await anext(outputs, None)
        finally:
            timer.finish(reason)

    async def generate(
        self, request: EngineRequest, timer: RequestTimer, keep_output: bool = True
    ) -> Generation:
        """Run `request` to the end and return its whole output."""
        parts: list[str] = []
        ids: list[int] = []
        logprobs: list[TokenLogprob | None] = []
        prompt_logprobs = None
        async with aclosing(self.stream(request, timer, keep_output)) as outputs:
            async for out in outputs:
                parts.append(out.new_text)
                ids += out.new_token_ids
                logprobs += out.new_logprobs or [None] * len(out.new_token_ids)
                prompt_logprobs = prompt_logprobs or out.prompt_logprobs
                if out.finished:
                    return Generation(
                        text="".join(parts),
                        finish_reason=out.finish_reason or FinishReason.ERROR,
                        num_output_tokens=len(ids),
                        error=out.error,
                        kv_transfer_params=kv_transfer_params_of(out),
                        token_ids=ids,
                        logprobs=logprobs,
                        prompt_logprobs=prompt_logprobs,
                    )
        return Generation(
            "".join(parts), FinishReason.ABORT, len(ids), error="the stream ended early"
        )


def encode_bounded(
    tokenizer: Tokenizer, text: str, max_tokens: int, add_special_tokens: bool = True
) -> list[int] | None:
    """The ids of `text`, or None when it certainly has far more than `max_tokens` tokens.

    Tokenizing megabytes takes seconds on the event loop, so a text longer than a few
    characters per allowed token is measured by growing prefixes first: a prefix with more
    than twice the allowed tokens proves the whole text too long (only the last word of a
    prefix can tokenize differently in the whole text). Ordinary text that is far too long is
    refused after tokenizing a few tens of characters per allowed token; the whole text is
    tokenized only when it fits or its tokens are unusually long.
    """
    size = _CHARS_PER_TOKEN_PROBE * (max_tokens + 1)
    while size < len(text):
        if len(tokenizer.encode(text[:size], add_special_tokens=False)) > 2 * max_tokens + 16:
            return None
        size *= 4
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)


def _is_unicode(text: str) -> bool:
    """False for a str holding lone surrogates (JSON allows "\\ud800"; tokenizers do not)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


async def _first(outputs: AsyncIterator[RequestOutput]) -> RequestOutput | None:
    """The first output; submission errors become API errors."""
    try:
        return await anext(outputs, None)
    except EngineDeadError as exc:
        raise APIError(HTTPStatus.SERVICE_UNAVAILABLE, str(exc), code="engine_dead") from exc
    except ValueError as exc:  # AsyncEngine: the request id is in use (X-Request-Id reused)
        raise APIError(HTTPStatus.CONFLICT, str(exc), param="X-Request-Id") from exc


def build_engine_request(
    request_id: str,
    prompt_ids: list[int],
    params: SamplingParams,
    kv_transfer: KVTransferParams | None,
) -> EngineRequest:
    """The request the engine runs.

    P/D HOOK (kv_transfer_params): `kv_transfer` comes parsed, checked and (with a cluster
    token) authenticated from the admission gate (`TransferGate.leg_params`); what the
    engine does with them is the connector's business.
    """
    return EngineRequest(
        request_id=request_id,
        prompt_token_ids=prompt_ids,
        params=params,
        arrival_time=time.time(),
        kv_transfer=kv_transfer,
    )


def kv_transfer_params_of(out: RequestOutput) -> dict[str, Any] | None:
    """P/D HOOK: the engine's `kv_transfer_params` of a final output, as JSON-ready data."""
    if out.kv_transfer_params is None:
        return None
    return msgspec.to_builtins(out.kv_transfer_params)


def finish_error(gen_error: str | None, reason: FinishReason, engine_alive: bool) -> APIError:
    """The server-side error for a generation that ended in ERROR or ABORT."""
    if not engine_alive:
        return APIError(
            HTTPStatus.SERVICE_UNAVAILABLE,
            f"The engine stopped: {gen_error or 'unknown error'}",
            code="engine_dead",
        )
    if reason is FinishReason.ABORT:
        return APIError(
            HTTPStatus.SERVICE_UNAVAILABLE,
            f"The request was aborted: {gen_error or 'aborted'}",
            code="request_aborted",
        )
    transfer = parse_transfer_error(gen_error)
    if transfer is not None:
        return kv_transfer_error(*transfer)
    return APIError(
        HTTPStatus.INTERNAL_SERVER_ERROR,
        f"The engine failed the request: {gen_error or 'unknown error'}",
        code="engine_error",
    )


def kv_transfer_error(cause: str, detail: str) -> APIError:
    """The client's error for a P/D request whose KV never arrived (see
    pdserve.transfer.errors.TRANSFER_ERROR_CAUSES): a 502 of type `kv_transfer_error`
    (an upstream, the prefill instance or the link to it, failed; retrying may work), or a
    400 when the params were not signed by a prefill instance of this cluster, or a 503 when
    the instance refused the leg for its load (`overloaded`: retrying later may work)."""
    message = f"KV transfer failed ({cause.replace('_', ' ')}): {detail}"
    if cause == TransferCause.PARAMS_REJECTED:
        return bad_request(message, param="kv_transfer_params", code="kv_params_rejected")
    status = (
        HTTPStatus.SERVICE_UNAVAILABLE
        if cause == TransferCause.OVERLOADED
        else HTTPStatus.BAD_GATEWAY
    )
    return APIError(status, message, type=KV_TRANSFER_ERROR_TYPE, code=f"kv_{cause}")


def prompt_only(out: RequestOutput) -> RequestOutput:
    """`out` without generated tokens, finished for length (max_tokens 0 with echo)."""
    return msgspec.structs.replace(
        out,
        new_token_ids=[],
        new_text="",
        new_logprobs=None,
        num_output_tokens=0,
        finished=True,
        finish_reason=FinishReason.LENGTH,
    )


def _logprobs_asked(req: SamplingFields) -> tuple[int | None, int | None]:
    """(top logprobs per generated token, per prompt token); None: not asked."""
    if isinstance(req, CompletionRequest):
        return req.logprobs, req.logprobs if req.echo else None
    assert isinstance(req, ChatCompletionRequest)
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs=true.", param="top_logprobs")
    return (req.top_logprobs or 0) if req.logprobs else None, None


def _temperature(requested: float | None) -> float:
    """OpenAI's default is 1. A temperature too small to divide by (1e-300 overflows the
    logits to inf and the sampler fails the whole batch) means greedy, as in vLLM."""
    if requested is None:
        return 1.0
    return 0.0 if requested < _GREEDY_BELOW else requested


def _template_role(role: str) -> str:
    # Chat templates of open models know system/user/assistant/tool; OpenAI's newer
    # "developer" role means what "system" means to them.
    return "system" if role == "developer" else role


def _unsupported(param: str, what: str) -> APIError:
    return bad_request(f"{what} is not supported by this server.", param=param)


def _check_common_options(req: SamplingFields) -> None:
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed with stream=true.", "stream_options")


def _check_completion_options(req: CompletionRequest) -> None:
    _check_common_options(req)
    if req.max_tokens == 0 and not req.echo:
        raise bad_request("max_tokens=0 is only allowed with echo=true.", param="max_tokens")
    if req.suffix:
        raise _unsupported("suffix", "suffix")
    if req.best_of not in (None, 1):
        raise _unsupported("best_of", f"best_of={req.best_of}")


def _check_chat_options(req: ChatCompletionRequest) -> None:
    _check_common_options(req)
    if req.tools or req.tool_choice not in (None, "none"):
        raise _unsupported("tools", "Tool calling")
    if req.response_format and req.response_format.get("type") != "text":
        raise _unsupported("response_format", "response_format other than text")
