"""P/D routes of an instance, for routers: `GET /kv/info` (identity), `GET /load` (load
report, `pdserve.server.load_report`) and `POST /tokenize` (a prompt's token count)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import msgspec
from fastapi import APIRouter, Request, Response
from fastapi.params import Depends

from pdserve.engine.handle import EngineHandle
from pdserve.server.errors import bad_request, read_json_object
from pdserve.server.load_report import LoadMeter, TokenCount
from pdserve.server.protocol import ChatCompletionRequest, CompletionRequest
from pdserve.server.serving import OpenAIServing


def kv_routes(
    async_engine: EngineHandle,
    serving: OpenAIServing | None = None,
    auth: Sequence[Depends] = (),
) -> APIRouter:
    """Routes reading the engine's connector (None on a monolithic instance); `/tokenize`
    only with `serving`, behind `auth` like /v1/*. The load meter lives in this closure."""
    router = APIRouter()
    meter = LoadMeter()
    info_body = msgspec.json.encode(async_engine.info.instance)

    @router.get("/kv/info")
    async def kv_info() -> Response:
        return Response(info_body, media_type="application/json")

    @router.get("/load")
    async def load() -> Response:
        requests = async_engine.live_requests()
        report = meter.report(async_engine.stats(), requests, time.monotonic())
        return Response(msgspec.json.encode(report), media_type="application/json")

    if serving is not None:

        @router.post("/tokenize", dependencies=list(auth))
        async def tokenize(request: Request) -> Response:
            ids = _prompt_ids(serving, await read_json_object(request))
            body = msgspec.json.encode(TokenCount(count=len(ids)))
            return Response(body, media_type="application/json")

    return router


def _prompt_ids(serving: OpenAIServing, body: dict[str, Any]) -> list[int]:
    """The prompt of a completion body, or of a chat body (one with `messages`)."""
    try:
        if "messages" in body:
            return serving.chat_prompt(ChatCompletionRequest.model_validate(body))
        return serving.completion_prompt(CompletionRequest.model_validate(body))
    except ValueError as exc:  # pydantic's ValidationError
        raise bad_request(f"Not a completion or chat request: {exc}") from None
