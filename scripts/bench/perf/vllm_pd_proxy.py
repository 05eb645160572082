"""A minimal P/D proxy for vLLM's NIXL connectors, so that vLLM's own 1P1D runs beside pdserve's.

vLLM ships no proxy in its wheel; this one does what its toy proxy does for pull, plus push:
- pull (`NixlConnector` / `NixlPullConnector`): the prompt goes to P with `do_remote_decode`
  and `max_tokens=1`; P's answer carries `kv_transfer_params` (P's block ids, engine id and
  side channel), which go with the request to D, whose stream is the client's answer.
- push (`NixlPushConnector`): the request goes to P and D *at once*, under one
  `X-Request-Id`. D gets P's coordinates up front (`remote_engine_id`, `remote_host`,
  `remote_port`), allocates, and registers its blocks with P over NIXL; P pairs registration
  and finished prefill by the request id's base and WRITEs into D.

Only `/v1/completions` and `/v1/models` are served: that is what `pdserve bench` uses.
usage: vllm_pd_proxy.py --port N --prefill URL --decode URL --mode push|pull
       [--p-engine-id P --p-side-port N]
"""

from __future__ import annotations

import argparse
import asyncio
import uuid
from collections.abc import AsyncIterator

import httpx
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse


def p_body(body: dict) -> dict:
    """P computes the prompt only: one token, no stream, blocks kept for D."""
    out = {**body, "max_tokens": 1, "stream": False}
    for key in ("stream_options", "min_tokens"):
        out.pop(key, None)
    out["kv_transfer_params"] = {"do_remote_decode": True, "do_remote_prefill": False}
    return out


def push_params(a: argparse.Namespace, rid: str) -> dict:
    """What D needs to register with P before P has finished (push).

    vLLM 0.32's D scheduler reads `remote_request_id` even in push mode (a missing key kills
    its engine core); P's request id is `cmpl-<X-Request-Id>-0` before vLLM's random suffix.
    """
    return {
        "remote_request_id": f"cmpl-{rid}-0",
        "remote_block_ids": [],
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": a.p_engine_id,
        "remote_host": "127.0.0.1",
        "remote_port": a.p_side_port,
        "tp_size": 1,
    }


def make_app(a: argparse.Namespace) -> FastAPI:
    app = FastAPI()
    limits = httpx.Limits(max_keepalive_connections=64, keepalive_expiry=4)
    client = httpx.AsyncClient(timeout=None, limits=limits)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        """D's model list, but only once P answers too (a push request needs both up)."""
        try:
            p = await client.get(f"{a.prefill}/v1/models")
            r = await client.get(f"{a.decode}/v1/models")
        except httpx.HTTPError as e:
            return JSONResponse({"error": {"message": f"P or D not up: {e!r}"}}, status_code=503)
        if p.status_code != 200:
            return JSONResponse(p.json(), status_code=p.status_code)
        return JSONResponse(r.json(), status_code=r.status_code)

    async def stream_d(body: dict, rid: str, p_task: asyncio.Task | None) -> AsyncIterator[bytes]:
        headers = {"X-Request-Id": rid}
        async with client.stream(
            "POST", f"{a.decode}/v1/completions", json=body, headers=headers
        ) as r:
            async for chunk in r.aiter_raw():
                yield chunk
        if p_task is not None:
            (await p_task).raise_for_status()

    @app.post("/v1/completions", response_model=None)
    async def completions(req: Request) -> StreamingResponse | JSONResponse:
        body = await req.json()
        rid = uuid.uuid4().hex
        post_p = client.post(
            f"{a.prefill}/v1/completions", json=p_body(body), headers={"X-Request-Id": rid}
        )
        if a.mode == "push":
            p_task = asyncio.create_task(post_p)
            d_body = {**body, "kv_transfer_params": push_params(a, rid)}
            return StreamingResponse(stream_d(d_body, rid, p_task), media_type="text/event-stream")
        p = await post_p
        if p.status_code != 200:
            return JSONResponse(p.json(), status_code=p.status_code)
        d_body = {**body, "kv_transfer_params": p.json()["kv_transfer_params"]}
        return StreamingResponse(stream_d(d_body, rid, None), media_type="text/event-stream")

    return app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--prefill", required=True, help="P's base URL")
    ap.add_argument("--decode", required=True, help="D's base URL")
    ap.add_argument("--mode", choices=("push", "pull"), required=True)
    ap.add_argument("--p-engine-id", default="P", help="push: P's kv_transfer_config engine_id")
    ap.add_argument("--p-side-port", type=int, help="push: P's VLLM_NIXL_SIDE_CHANNEL_PORT")
    a = ap.parse_args()
    if a.mode == "push" and a.p_side_port is None:
        ap.error("--p-side-port is required in push mode")
    uvicorn.run(
        make_app(a), host="127.0.0.1", port=a.port, log_level="warning", timeout_keep_alive=30
    )


if __name__ == "__main__":
    main()
