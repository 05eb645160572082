"""P/D routes of an instance, for routers: `GET /kv/info` (identity), `GET /load` (load
report, `pdserve.server.load_report`) and `POST /tokenize` (a prompt's token count)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import msgspec
from fastapi import APIRouter, Request, Response
from fastapi.params import Depends

from pdserve.engine.async_engine import AsyncEngine
from pdserve.server.errors import bad_request, read_json_object
from pdserve.server.load_report import LoadMeter, TokenCount
from pdserve.server.protocol import ChatCompletionRequest, CompletionRequest
from pdserve.server.serving import OpenAIServing
from pdserve.transfer.params import InstanceInfo


def kv_routes(
    async_engine: AsyncEngine,
    serving: OpenAIServing | None = None,
    auth: Sequence[Depends] = (),
) -> APIRouter:
    """Routes reading the engine's connector (None on a monolithic instance); `/tokenize`
    only with `serving`, behind `auth` like /v1/*. The load meter lives in this closure."""
    router = APIRouter()
    engine = async_engine.engine
    meter = LoadMeter()

    @router.get("/kv/info")
    async def kv_info() -> Response:
        c = engine.connector
        info = InstanceInfo(
            engine_id=c.cfg.engine_id if c else "monolithic",
            incarnation=c.cfg.incarnation if c else "",
            role=c.cfg.role if c else "both",
            transfer_mode=c.cfg.mode if c else None,
            transport=c.transport_kind if c else None,
            side_channel_host=c.side.address[0] if c else None,
            side_channel_port=c.side.address[1] if c else None,
            model=engine.model_name,
        )
        return Response(msgspec.json.encode(info), media_type="application/json")

    @router.get("/load")
    async def load() -> Response:
        # One atomic copy of the engine's live requests (see load_report on the racy reads).
        requests = list(engine.requests.values())
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
