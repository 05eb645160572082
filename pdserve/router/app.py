"""The router's FastAPI app: OpenAI-compatible front door of a P/D cluster.

One app owns one pooled `Upstream` client (opened and closed by its lifespan), the
instance pool, the health monitor's tasks and the metrics registry; nothing is global,
so tests can run several routers in one process.

Client disconnects: while the legs run and before any response exists (P's prefill in
pull mode, D's queueing and KV transfer in push mode) a watcher waits on the ASGI
`http.disconnect`; if it comes first the dispatch is cancelled, which closes every
upstream request (aborting it on its instance). Once D's stream is relayed, Starlette's
own disconnect listener cancels the relay, which closes D's stream.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import msgspec
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pdserve.router.config import RouterConfig
from pdserve.router.dispatch import Call, Dispatcher, cancel_and_wait
from pdserve.router.health import NO_PREFILL_DEGRADED, HealthMonitor, Instance, InstancePool
from pdserve.router.membership import MembershipSource, MembershipWatcher
from pdserve.router.metrics import RouterMetrics
from pdserve.router.upstream import Answer, Upstream
from pdserve.server.body_limit import BodySizeLimit
from pdserve.server.errors import (
    APIError,
    install_error_handlers,
    read_json_object,
)
from pdserve.server.proofs import route_guard
from pdserve.server.request_ids import request_id_of

CLIENT_CLOSED_REQUEST = 499  # nginx's code; nobody reads it, it only reaches the access log


@dataclass
class RouterState:
    """What the routes need; `app.state.router`, set by the lifespan."""

    config: RouterConfig
    pool: InstancePool
    metrics: RouterMetrics
    upstream: Upstream
    dispatcher: Dispatcher


def _upstream(config: RouterConfig) -> Upstream:
    return Upstream(config.request_timeout_s, config.connect_timeout_s, config.max_connections)


def create_app(config: RouterConfig, membership: MembershipSource | None = None) -> FastAPI:
    """A router app for `config`; serve it with uvicorn (its lifespan starts health checks).
    With `membership`, the instances are the source's (pdserve.router.membership), the
    config's URLs only the first ones."""
    pool = InstancePool(config)
    metrics = RouterMetrics(pool)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with _upstream(config) as upstream:
            dispatcher = Dispatcher(config, upstream, pool, metrics)
            monitor = HealthMonitor(pool, upstream, config)
            app.state.router = RouterState(config, pool, metrics, upstream, dispatcher)
            watcher = None
            if membership is not None:
                watcher = MembershipWatcher(pool, membership, config.health_interval_s / 2)
                await watcher.start()
            await monitor.start()
            try:
                yield
            finally:
                if watcher is not None:
                    await watcher.stop()
                await monitor.stop()
                await dispatcher.aclose()

    # No /docs, /redoc or /openapi.json: nothing a client needs, and a map for strangers.
    app = FastAPI(
        title="pdserve router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    install_error_handlers(app)
    app.add_middleware(BodySizeLimit, max_bytes=config.max_body_bytes)
    _add_routes(app, config)
    return app


def _add_routes(app: FastAPI, config: RouterConfig) -> None:
    auth = [Depends(_api_key_checker(config.api_key))]

    @app.post("/v1/completions", dependencies=auth)
    async def completions(request: Request) -> Response:
        return await _generate(request, "/v1/completions")

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(request: Request) -> Response:
        return await _generate(request, "/v1/chat/completions")

    @app.get("/v1/models", dependencies=auth)
    async def models(request: Request) -> Response:
        return await _models(_state(request))

    @app.get("/health")
    async def health(request: Request) -> Response:
        state = _state(request)
        return _health(state.pool, state.config.concurrent_legs)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        body, content_type = _state(request).metrics.render()
        return Response(body, media_type=content_type)

    # Instance addresses and side channels are internal: behind the key like /v1/*, and
    # with a cluster token behind a proof of it (X-PDServe-Cluster-Auth), as on instances.
    @app.get("/router/instances", dependencies=[*auth, *route_guard(config.cluster_token)])
    async def instances(request: Request) -> Response:
        return JSONResponse([_describe(i) for i in _state(request).pool.instances])


def _state(request: Request) -> RouterState:
    return request.app.state.router


def _api_key_checker(api_key: str | None) -> Any:
    async def check(request: Request) -> None:
        if api_key is None:
            return
        given = request.headers.get("authorization", "").encode()
        if not secrets.compare_digest(given, f"Bearer {api_key}".encode()):
            raise APIError(
                HTTPStatus.UNAUTHORIZED,
                "Missing or invalid API key: send 'Authorization: Bearer <key>'.",
                code="invalid_api_key",
            )

    return check


async def _generate(request: Request, path: str) -> Response:
    body = await read_json_object(request)
    call = Call(
        path=path,
        body=body,
        stream=body.get("stream") is True,
        request_id=request_id_of(request.headers),
        arrival=time.monotonic(),
    )
    response = await until_disconnect(request, _state(request).dispatcher.dispatch(call))
    return response or Response(status_code=CLIENT_CLOSED_REQUEST)


async def until_disconnect(request: Request, work: Awaitable[Response]) -> Response | None:
    """`work`'s result, or None (and `work` cancelled) if the client disconnects first.
    Call after the body has been read: the watcher consumes ASGI receive messages."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            await cancel_and_wait(task, watcher)
        else:
            await cancel_and_wait(watcher)
    return None if task.cancelled() else task.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _health(pool: InstancePool, push: bool) -> Response:
    """200 while a decode instance is admitted (with no usable prefill instance the router
    prefills on decode instances, and says so as `degraded`), else 503. Instances refused
    for not fitting the cluster are listed with the mismatch."""
    counts = {
        role: {"healthy": len(pool.admitted(role)), "total": len(pool.by_role(role))}
        for role in ("prefill", "decode")
    }
    ready = bool(pool.admitted("decode"))
    body: dict[str, Any] = {"status": "ok" if ready else "unavailable", **counts}
    if ready and not pool.prefill_usable(push):
        body["degraded"] = NO_PREFILL_DEGRADED
    refused = [
        {"url": i.url, "role": i.role, "mismatch": r.mismatch.value, "detail": r.detail}
        for role in ("prefill", "decode")
        for i, r in pool.refusals(role)
    ]
    if refused:
        body["refused"] = refused
    return JSONResponse(body, status_code=200 if ready else 503)


async def _models(state: RouterState) -> Response:
    """The union of the models the admitted instances serve."""
    urls = [i.url for i in state.pool.instances if i.admitted]
    headers = {"Authorization": f"Bearer {state.config.api_key}"} if state.config.api_key else {}
    answers = await asyncio.gather(
        *(
            state.upstream.get(
                f"{u}/v1/models", headers=headers, timeout_s=state.config.health_timeout_s
            )
            for u in urls
        ),
        return_exceptions=True,
    )
    seen: dict[str, Any] = {}
    for r in answers:
        for model in _model_list(r):
            seen.setdefault(model.get("id"), model)
    if not seen:
        raise APIError(503, "no healthy instance answered /v1/models")
    return JSONResponse({"object": "list", "data": list(seen.values())})


def _model_list(answer: Answer | BaseException) -> list[dict[str, Any]]:
    if not isinstance(answer, Answer) or not answer.is_success:
        return []
    try:
        data = msgspec.json.decode(answer.content).get("data", [])
    except (msgspec.DecodeError, AttributeError):
        return []
    return [m for m in data if isinstance(m, dict)] if isinstance(data, list) else []


def _describe(inst: Instance) -> dict[str, Any]:
    info = msgspec.to_builtins(inst.info) if inst.info is not None else None
    load = msgspec.to_builtins(inst.load) if inst.load is not None else None
    return {
        "url": inst.url,
        "role": inst.role,
        "admitted": inst.admitted,
        "consecutive_failures": inst.failures,
        "refused": None if inst.refused is None else inst.refused.detail,
        "ejections": inst.ejections,
        "restarts": inst.restarts,
        "outstanding": inst.outstanding,
        "outstanding_tokens": inst.outstanding_tokens,
        "info": info,
        "load": load,
    }
