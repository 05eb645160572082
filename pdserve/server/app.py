"""The FastAPI app of one instance: OpenAI-compatible routes, /health and /metrics.

`create_app` wires an already started engine (an `EngineHandle`: `AsyncEngine` in this
process, or `EngineCoreClient` for an engine core process) into a new app; the caller (serve.py,
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
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Header, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from pdserve import __version__
from pdserve.config import ServerConfig
from pdserve.engine.handle import EngineHandle
from pdserve.engine.types import EngineRequest, FinishReason, RequestOutput
from pdserve.server.body_limit import MAX_BODY_BYTES, BodySizeLimit
from pdserve.server.errors import APIError, install_error_handlers
from pdserve.server.fanout import child_requests, merged
from pdserve.server.kv_routes import kv_routes
from pdserve.server.metrics import RequestCountMiddleware, ServerMetrics
from pdserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
)
from pdserve.server.request_ids import REQUEST_ID_HEADER, request_id_of
from pdserve.server.responses import ChatFormat, CompletionFormat, Echo, ResponseFormat
from pdserve.server.serving import (
    COMPLETION_DEFAULT_MAX_TOKENS,
    Generation,
    OpenAIServing,
    build_engine_request,
    finish_error,
    kv_transfer_params_of,
)
from pdserve.server.transfers import TransferClaim, TransferGate
from pdserve.sse import data_event
from pdserve.tracelog import hop
from pdserve.transfer.cluster_auth import LEG_SIGNATURE_HEADER
from pdserve.transfer.metrics import ConnectorCollector
from pdserve.transfer.release import ReleaseAuth, release_signature

log = logging.getLogger(__name__)

T = TypeVar("T")

COMPLETIONS_PATH = "/v1/completions"
CHAT_PATH = "/v1/chat/completions"
# nginx's code for "client closed request": only ever seen in logs and metrics.
_CLIENT_CLOSED = 499


def create_app(async_engine: EngineHandle, cfg: ServerConfig) -> FastAPI:
    """An app serving `async_engine` (already started) under `cfg`'s model name and key;
    `cfg.cluster_token` must be the engine's connector's (ValueError otherwise)."""
    check_token_matches(async_engine, cfg.cluster_token)
    served_name = cfg.served_model_name or async_engine.info.model_name
    metrics = ServerMetrics(async_engine.stats, served_name, async_engine.info.block_size)
    serving = OpenAIServing(async_engine, served_name, metrics)
    # No /docs, /redoc or /openapi.json: nothing a client needs, and a map for strangers.
    app = FastAPI(
        title="pdserve", version=__version__, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.serving = serving
    app.state.metrics = metrics
    install_error_handlers(app)
    app.add_middleware(
        RequestCountMiddleware, metrics=metrics, endpoints=frozenset({COMPLETIONS_PATH, CHAT_PATH})
    )
    app.add_middleware(BodySizeLimit, max_bytes=MAX_BODY_BYTES)
    gate = TransferGate(async_engine, cfg.cluster_token)
    app.include_router(_api_routes(serving, gate, cfg.api_key))
    app.include_router(_ops_routes(serving, metrics))
    # /tokenize (for routers' local-prefill choice) sits behind the same key as /v1/*.
    tokenize_auth = [Depends(_bearer_auth(cfg.api_key))] if cfg.api_key else []
    app.include_router(kv_routes(async_engine, serving, tokenize_auth, cfg.cluster_token))
    if async_engine.info.limits.role != "both":
        metrics.registry.register(ConnectorCollector(async_engine.connector_metrics))
    return app


def check_token_matches(engine: EngineHandle, token: str | None) -> None:
    """Raise ValueError unless the front end's cluster token is the engine's connector's:
    a front end without it would admit anyone's P/D legs to an engine whose transport
    trusts only the cluster. The handle does not expose the token; its release check
    answers whether it has one and whether ours is it."""
    probe = "token-probe"
    engine_has_one = engine.check_release(probe, None) is ReleaseAuth.MISSING
    if engine_has_one != (token is not None):
        raise ValueError(
            "ServerConfig.cluster_token must be the engine's connector's cluster token "
            f"(the engine has {'one' if engine_has_one else 'none'}, the config "
            f"{'has one' if token else 'none'})"
        )
    if token is not None:
        verdict = engine.check_release(probe, release_signature(token, probe))
        if verdict is not ReleaseAuth.OK:
            raise ValueError("ServerConfig.cluster_token differs from the engine's cluster token")


def _api_routes(serving: OpenAIServing, gate: TransferGate, api_key: str | None) -> APIRouter:
    deps = [Depends(_bearer_auth(api_key))] if api_key else []
    api = APIRouter(prefix="/v1", dependencies=deps)

    @api.get("/models")
    async def models() -> ModelList:
        return serving.models()

    @api.get("/models/{model_id:path}")
    async def model(model_id: str) -> ModelCard:
        return serving.model_card(model_id)

    @api.post("/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        kv = gate.leg_params(body.kv_transfer_params, request.headers.get(LEG_SIGNATURE_HEADER))
        serving.check_model(body.model)
        prompt = serving.completion_prompt(body)
        max_tokens = serving.max_tokens(body.max_tokens, COMPLETION_DEFAULT_MAX_TOKENS, len(prompt))
        params = serving.sampling_params(body, max_tokens)
        serving.check_leg(params, body.n, kv)
        rid = request_id_of(request.headers)
        hop(rid, "d.http_handler")
        er = build_engine_request(f"cmpl-{rid}", prompt, params, kv)
        claim = gate.admit(er)
        echo = Echo(serving.prompt_text(body.prompt, prompt), prompt) if body.echo else None
        fmt = CompletionFormat(
            er.request_id,
            serving.model_name,
            len(prompt),
            body.return_token_ids,
            serving.tokenizer,
            body.logprobs,
            echo,
        )
        run = _Run(er, body.n, body.stream, _usage_wanted(body), max_tokens > 0)
        return await _respond(request, serving, run, fmt, rid, claim)

    @api.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        kv = gate.leg_params(body.kv_transfer_params, request.headers.get(LEG_SIGNATURE_HEADER))
        serving.check_model(body.model)
        prompt = serving.chat_prompt(body)
        requested = body.max_completion_tokens or body.max_tokens
        max_tokens = serving.max_tokens(requested, None, len(prompt))
        params = serving.sampling_params(body, max_tokens)
        serving.check_leg(params, body.n, kv)
        rid = request_id_of(request.headers)
        er = build_engine_request(f"chatcmpl-{rid}", prompt, params, kv)
        claim = gate.admit(er)
        fmt = ChatFormat(
            er.request_id, serving.model_name, len(prompt), serving.tokenizer, params.logprobs
        )
        run = _Run(er, body.n, body.stream, _usage_wanted(body))
        return await _respond(request, serving, run, fmt, rid, claim)

    return api


def _ops_routes(serving: OpenAIServing, metrics: ServerMetrics) -> APIRouter:
    ops = APIRouter()

    @ops.get("/health")
    async def health() -> Response:
        serving.check_alive()  # 503 with the engine's error when its thread is dead
        serving.check_parts()  # 503 naming a dead connector thread or listener
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


def _usage_wanted(body: CompletionRequest | ChatCompletionRequest) -> bool:
    return body.stream_options is not None and body.stream_options.include_usage


@dataclass(frozen=True)
class _Run:
    """How to run an admitted request: `n` choices (pdserve.server.fanout), streamed or
    not, and whether generated tokens are kept (not for max_tokens 0 with echo)."""

    er: EngineRequest
    n: int
    stream: bool
    include_usage: bool
    keep_output: bool = True


async def _respond(
    request: Request,
    serving: OpenAIServing,
    run: _Run,
    fmt: ResponseFormat,
    rid: str,
    claim: TransferClaim | None,
) -> Response:
    """The response for an admitted request; `claim` (a P/D leg's transfer id) is released
    once the response has ended, whichever way (see pdserve.server.transfers)."""
    release = claim.release if claim is not None else _nothing
    headers = {REQUEST_ID_HEADER: rid}
    children = child_requests(run.er, run.n)
    timers = [serving.metrics.timer(len(c.prompt_token_ids)) for c in children]
    if run.stream:
        try:
            serving.check_alive()
        except APIError:
            release()
            raise
        outputs = merged(
            [serving.stream(c, t, run.keep_output) for c, t in zip(children, timers, strict=True)]
        )
        events = _sse_events(serving, outputs, fmt, run.include_usage, run.n)
        return _SSEResponse(events, release, media_type="text/event-stream", headers=headers)
    work = [serving.generate(c, t, run.keep_output) for c, t in zip(children, timers, strict=True)]
    try:
        gens = await _until_disconnected(request, _gather(work))
    finally:
        release()
    if gens is None:
        log.info("%s: client disconnected, request aborted", run.er.request_id)
        return Response(status_code=_CLIENT_CLOSED)
    for gen in gens:
        if gen.finish_reason in (FinishReason.ERROR, FinishReason.ABORT):
            err = finish_error(gen.error, gen.finish_reason, serving.engine.is_alive)
            log.warning("%s: %s", run.er.request_id, err.message)
            return err.response(headers)
    return JSONResponse(fmt.full(gens).model_dump(mode="json"), headers=headers)


async def _gather(work: list[Awaitable[Generation]]) -> list[Generation]:
    """Every choice's generation; cancelling this cancels (aborts) them all."""
    tasks = [asyncio.ensure_future(w) for w in work]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _sse_events(
    serving: OpenAIServing,
    outputs: AsyncIterator[tuple[int, RequestOutput]],
    fmt: ResponseFormat,
    include_usage: bool,
    n_choices: int,
) -> AsyncIterator[str]:
    """OpenAI's server-sent events: `data: {chunk}` lines, `data: [DONE]` at the end.

    An engine failure becomes a `data: {"error": ...}` event (the 200 status is already
    sent), followed by [DONE] as usual.
    """
    n = 0
    async with aclosing(outputs):
        try:
            for chunk in fmt.head(n_choices):
                yield _sse(chunk)
            async for index, out in outputs:
                n += len(out.new_token_ids)
                reason = out.finish_reason if out.finished else None
                if reason in (FinishReason.ERROR, FinishReason.ABORT):
                    yield _sse(finish_error(out.error, reason, serving.engine.is_alive).body())
                    break
                # One chunk per step with tokens, even when they end mid-character, so that
                # clients measure inter-token latency per token (as vLLM does).
                if out.new_token_ids or out.new_text or reason is not None:
                    kv = kv_transfer_params_of(out) if reason else None
                    if n == len(out.new_token_ids):
                        hop(out.request_id, "d.sse_first")
                    yield _sse(fmt.chunk(index, out, reason, kv))
            else:
                if include_usage:
                    yield _sse(fmt.usage_chunk(n))
        except APIError as err:  # submission refused (engine dead, request id in use)
            yield _sse(err.body())
    yield "data: [DONE]\n\n"


def _sse(payload: BaseModel | dict) -> str:
    if isinstance(payload, BaseModel):
        return data_event(payload.model_dump_json())
    return data_event(JSONResponse(payload).body.decode())


class _SSEResponse(StreamingResponse):
    """A StreamingResponse that always closes its event iterator, so that a disconnect
    detected by a failed send (not only by Starlette's cancellation) aborts the request,
    and then calls `on_close` (releases what the request held in the app)."""

    def __init__(
        self, content: AsyncIterator[str], on_close: Callable[[], None], **kw: Any
    ) -> None:
        super().__init__(content, **kw)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                aclose = getattr(self.body_iterator, "aclose", None)
                if aclose is not None:
                    await aclose()
            finally:
                self._on_close()


def _nothing() -> None:
    pass


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
