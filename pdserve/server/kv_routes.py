"""P/D routes of an instance, for routers: `GET /kv/info` (identity), `GET /load` (load
report, `pdserve.server.load_report`), `POST /kv/release` (the router gives up a transfer,
`pdserve.transfer.release`), `POST /tokenize` (a prompt's tokens and their count) and
`POST /detokenize` (`{"tokens": [ids]}` -> `{"prompt": text}`), as vLLM names them.

With a cluster token, `/kv/info` and `/load` answer only a caller that proves it
(`X-PDServe-Cluster-Auth`, `pdserve.server.proofs.route_guard`): they name the side
channel and the engine's identity, what a forged push leg would need. `/kv/release` has its
own signature; `/tokenize` and `/detokenize` stay behind the API key like /v1/*."""

from __future__ import annotations

import time
from collections.abc import Sequence
from http import HTTPStatus
from typing import Any

import msgspec
from fastapi import APIRouter, Request, Response
from fastapi.params import Depends

from pdserve.engine.handle import EngineHandle
from pdserve.server.errors import APIError, bad_request, read_json_object
from pdserve.server.load_report import LoadMeter, TokenCount
from pdserve.server.proofs import route_guard
from pdserve.server.protocol import ChatCompletionRequest, CompletionRequest
from pdserve.server.serving import OpenAIServing
from pdserve.transfer.params import MAX_ID_CHARS, valid_id
from pdserve.transfer.release import RELEASE_PATH, SIGNATURE_HEADER, ReleaseAuth


def kv_routes(
    async_engine: EngineHandle,
    serving: OpenAIServing | None = None,
    auth: Sequence[Depends] = (),
    cluster_token: str | None = None,
) -> APIRouter:
    """Routes reading the engine's connector (None on a monolithic instance); `/tokenize`
    only with `serving`; `/tokenize` and `/kv/release` behind `auth` like /v1/*;
    `/kv/info` and `/load` behind a proof of `cluster_token` when there is one. The load
    meter lives in this closure."""
    router = APIRouter()
    meter = LoadMeter()
    info_body = msgspec.json.encode(async_engine.info.instance)
    for_routers = route_guard(cluster_token)

    @router.get("/kv/info", dependencies=for_routers)
    async def kv_info() -> Response:
        return Response(info_body, media_type="application/json")

    @router.get("/load", dependencies=for_routers)
    async def load() -> Response:
        requests = async_engine.live_requests()
        report = meter.report(async_engine.stats(), requests, time.monotonic())
        return Response(msgspec.json.encode(report), media_type="application/json")

    @router.post(RELEASE_PATH, dependencies=list(auth), status_code=202)
    async def release(request: Request) -> Response:
        tid = _release_target(async_engine, await read_json_object(request))
        verdict = async_engine.check_release(tid, request.headers.get(SIGNATURE_HEADER))
        if verdict is not ReleaseAuth.OK:
            raise _release_refused(verdict)
        async_engine.release_transfer(tid)
        body = msgspec.json.encode({"transfer_id": tid, "status": "accepted"})
        return Response(body, status_code=202, media_type="application/json")

    if serving is not None:

        @router.post("/tokenize", dependencies=list(auth))
        async def tokenize(request: Request) -> Response:
            ids = _prompt_ids(serving, await read_json_object(request))
            count = TokenCount(
                count=len(ids), max_model_len=serving.limits.max_model_len, tokens=ids
            )
            return Response(msgspec.json.encode(count), media_type="application/json")

        @router.post("/detokenize", dependencies=list(auth))
        async def detokenize(request: Request) -> Response:
            ids = _token_ids(serving, await read_json_object(request))
            text = serving.tokenizer.decode(ids, skip_special_tokens=False)
            return Response(msgspec.json.encode({"prompt": text}), media_type="application/json")

    return router


def _release_target(engine: EngineHandle, body: dict[str, Any]) -> str:
    """The transfer id a release names, or a 400 saying why it cannot be released here."""
    if engine.info.limits.role == "both":
        raise bad_request("this instance is monolithic: it holds no KV for transfers")
    tid = body.get("transfer_id")
    if not (isinstance(tid, str) and valid_id(tid)):
        raise bad_request(
            f"transfer_id must be 1-{MAX_ID_CHARS} printable ASCII characters, no spaces",
            param="transfer_id",
        )
    return tid


def _release_refused(verdict: ReleaseAuth) -> APIError:
    if verdict is ReleaseAuth.MISSING:
        return APIError(
            HTTPStatus.UNAUTHORIZED,
            f"this instance has a cluster token: a release needs {SIGNATURE_HEADER}",
            code="missing_release_signature",
        )
    return APIError(
        HTTPStatus.FORBIDDEN,
        f"{SIGNATURE_HEADER} does not match this instance's cluster token",
        code="invalid_release_signature",
    )


def _prompt_ids(serving: OpenAIServing, body: dict[str, Any]) -> list[int]:
    """The prompt of a completion body, or of a chat body (one with `messages`)."""
    try:
        if "messages" in body:
            return serving.chat_prompt(ChatCompletionRequest.model_validate(body))
        return serving.completion_prompt(CompletionRequest.model_validate(body))
    except ValueError as exc:  # pydantic's ValidationError
        raise bad_request(f"Not a completion or chat request: {exc}") from None


def _token_ids(serving: OpenAIServing, body: dict[str, Any]) -> list[int]:
    """The `tokens` of a /detokenize body: a list of this model's token ids."""
    ids = body.get("tokens")
    if not isinstance(ids, list) or not all(type(t) is int for t in ids):
        raise bad_request("tokens must be a list of token ids.", param="tokens")
    if len(ids) > serving.limits.max_model_len:
        raise bad_request(
            f"At most {serving.limits.max_model_len} tokens can be detokenized.", param="tokens"
        )
    serving.check_vocab(ids, "tokens")
    return ids
