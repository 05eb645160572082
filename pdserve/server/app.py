"""The FastAPI app of one instance: OpenAI-compatible routes, /health and /metrics.

`create_app` wires an already started `AsyncEngine` into a new app; the caller (serve.py,
or a test) owns the engine's lifecycle. Every piece of state lives on the app or in the
closures of its routes, so several apps can live in one process (tests do that).

Client disconnects: a streamed response closes its output iterator when the client goes
away (Starlette cancels the stream; `_SSEResponse` closes the iterator on every path), and a
non-streamed request runs in a task that is cancelled when the client disconnects. Either
way the engine's generator is closed, which aborts the request and frees its KV blocks.
"""

from __future__ import annotations

import asyncio
import logging
import re
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from http import HTTPStatus
from typing import TypeVar

from fastapi import APIRouter, Depends, FastAPI, Header, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from pdserve import __version__
from pdserve.config import ServerConfig
from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.types import EngineRequest, FinishReason, RequestOutput
from pdserve.server.errors import APIError, bad_request, install_error_handlers
from pdserve.server.kv_routes import kv_routes
from pdserve.server.metrics import RequestCountMiddleware, ServerMetrics
from pdserve.server.protocol import ChatCompletionRequest, CompletionRequest, ModelList
from pdserve.server.responses import ChatFormat, CompletionFormat, ResponseFormat
from pdserve.server.serving import (
    COMPLETION_DEFAULT_MAX_TOKENS,
    OpenAIServing,
    build_engine_request,
    finish_error,
    kv_transfer_params_of,
)
from pdserve.transfer.metrics import ConnectorCollector

log = logging.getLogger(__name__)

T = TypeVar("T")

COMPLETIONS_PATH = "/v1/completions"
CHAT_PATH = "/v1/chat/completions"
REQUEST_ID_HEADER = "X-Request-Id"
_REQUEST_ID_RE = re.compile(r"[\x21-\x7e]{1,128}")  # printable ASCII, no spaces
# nginx's code for "client closed request": only ever seen in logs and metrics.
_CLIENT_CLOSED = 499


def create_app(async_engine: AsyncEngine, cfg: ServerConfig) -> FastAPI:
    """An app serving `async_engine` (already started) under `cfg`'s model name and key."""
    served_name = cfg.served_model_name or async_engine.engine.model_name
    metrics = ServerMetrics(async_engine.stats)
    serving = OpenAIServing(async_engine, served_name, metrics)
    app = FastAPI(title="pdserve", version=__version__)
    app.state.serving = serving
    app.state.metrics = metrics
    install_error_handlers(app)
    app.add_middleware(
        RequestCountMiddleware, metrics=metrics, endpoints=frozenset({COMPLETIONS_PATH, CHAT_PATH})
    )
    app.include_router(_api_routes(serving, cfg.api_key))
    app.include_router(_ops_routes(serving, metrics))
    app.include_router(kv_routes(async_engine))
    if async_engine.engine.connector is not None:
        metrics.registry.register(ConnectorCollector(async_engine.engine.connector))
    return app


def _api_routes(serving: OpenAIServing, api_key: str | None) -> APIRouter:
    deps = [Depends(_bearer_auth(api_key))] if api_key else []
    api = APIRouter(prefix="/v1", dependencies=deps)

    @api.get("/models")
    async def models() -> ModelList:
        return serving.models()

    @api.post("/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        serving.check_model(body.model)
        prompt = serving.completion_prompt(body)
        max_tokens = serving.max_tokens(body.max_tokens, COMPLETION_DEFAULT_MAX_TOKENS, len(prompt))
        params = serving.sampling_params(body, max_tokens)
        rid = _request_id(request)
        er = build_engine_request(f"cmpl-{rid}", prompt, params, body.kv_transfer_params)
        fmt = CompletionFormat(
            er.request_id, serving.model_name, len(prompt), body.return_token_ids
        )
        return await _respond(request, serving, er, fmt, body.stream, _usage_wanted(body), rid)

    @api.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        serving.check_model(body.model)
        prompt = serving.chat_prompt(body)
        requested = body.max_completion_tokens or body.max_tokens
        max_tokens = serving.max_tokens(requested, None, len(prompt))
        params = serving.sampling_params(body, max_tokens)
        rid = _request_id(request)
        er = build_engine_request(f"chatcmpl-{rid}", prompt, params, body.kv_transfer_params)
        fmt = ChatFormat(er.request_id, serving.model_name, len(prompt))
        return await _respond(request, serving, er, fmt, body.stream, _usage_wanted(body), rid)

    return api


def _ops_routes(serving: OpenAIServing, metrics: ServerMetrics) -> APIRouter:
    ops = APIRouter()

    @ops.get("/health")
    async def health() -> Response:
        serving.check_alive()  # 503 with the engine's error when its thread is dead
        return JSONResponse({"status": "ok"})

    @ops.get("/metrics")
    async def prometheus() -> Response:
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    return ops


def _bearer_auth(api_key: str) -> Callable[..., Awaitable[None]]:
    expected = f"Bearer {api_key}".encode()

    async def check(authorization: str | None = Header(default=None)) -> None:
        given = (authorization or "").encode()
        if not secrets.compare_digest(given, expected):
            raise APIError(
                HTTPStatus.UNAUTHORIZED,
                "Missing or invalid API key: send 'Authorization: Bearer <key>'.",
                code="invalid_api_key",
            )

    return check


def _request_id(request: Request) -> str:
    """The client's X-Request-Id if it sent a usable one, else a fresh random id."""
    given = request.headers.get(REQUEST_ID_HEADER)
    if given is None:
        return secrets.token_hex(16)
    if not _REQUEST_ID_RE.fullmatch(given):
        raise bad_request(
            f"{REQUEST_ID_HEADER} must be 1-128 printable ASCII characters without spaces.",
            param=REQUEST_ID_HEADER,
        )
    return given


def _usage_wanted(body: CompletionRequest | ChatCompletionRequest) -> bool:
    return body.stream_options is not None and body.stream_options.include_usage


async def _respond(
    request: Request,
    serving: OpenAIServing,
    er: EngineRequest,
    fmt: ResponseFormat,
    stream: bool,
    include_usage: bool,
    rid: str,
) -> Response:
    headers = {REQUEST_ID_HEADER: rid}
    timer = serving.metrics.timer(len(er.prompt_token_ids))
    if stream:
        serving.check_alive()
        events = _sse_events(serving, serving.stream(er, timer), fmt, include_usage)
        return _SSEResponse(events, media_type="text/event-stream", headers=headers)
    gen = await _until_disconnected(request, serving.generate(er, timer))
    if gen is None:
        log.info("%s: client disconnected, request aborted", er.request_id)
        return Response(status_code=_CLIENT_CLOSED)
    if gen.finish_reason in (FinishReason.ERROR, FinishReason.ABORT):
        err = finish_error(gen.error, gen.finish_reason, serving.engine.is_alive)
        log.warning("%s: %s", er.request_id, err.message)
        return err.response(headers)
    return JSONResponse(fmt.full(gen).model_dump(mode="json"), headers=headers)


async def _sse_events(
    serving: OpenAIServing,
    outputs: AsyncIterator[RequestOutput],
    fmt: ResponseFormat,
    include_usage: bool,
) -> AsyncIterator[str]:
    """OpenAI's server-sent events: `data: {chunk}` lines, `data: [DONE]` at the end.

    An engine failure becomes a `data: {"error": ...}` event (the 200 status is already
    sent), followed by [DONE] as usual.
    """
    n = 0
    async with aclosing(outputs):
        try:
            for chunk in fmt.head():
                yield _sse(chunk)
            async for out in outputs:
                n += len(out.new_token_ids)
                reason = out.finish_reason if out.finished else None
                if reason in (FinishReason.ERROR, FinishReason.ABORT):
                    yield _sse(finish_error(out.error, reason, serving.engine.is_alive).body())
                    break
                # One chunk per step with tokens, even when they end mid-character, so that
                # clients measure inter-token latency per token (as vLLM does).
                if out.new_token_ids or out.new_text or reason is not None:
                    kv = kv_transfer_params_of(out) if reason else None
                    yield _sse(fmt.chunk(out.new_text, reason, kv))
            else:
                if include_usage:
                    yield _sse(fmt.usage_chunk(n))
        except APIError as err:  # submission refused (engine dead, request id in use)
            yield _sse(err.body())
    yield "data: [DONE]\n\n"


def _sse(payload: BaseModel | dict) -> str:
    if isinstance(payload, BaseModel):
        return f"data: {payload.model_dump_json()}\n\n"
    return f"data: {JSONResponse(payload).body.decode()}\n\n"


class _SSEResponse(StreamingResponse):
    """A StreamingResponse that always closes its event iterator, so that a disconnect
    detected by a failed send (not only by Starlette's cancellation) aborts the request."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


async def _until_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """`work`'s result, or None if the client disconnected first (then `work` is
    cancelled, and awaited so that its cleanup - the engine abort - has run)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    return None if task.cancelled() else task.result()


async def _wait_for_disconnect(request: Request) -> None:
    # The body has been read, so the next ASGI message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass
