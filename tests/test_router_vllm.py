"""The router in front of vLLM instances (`engine="vllm"`), against fake vLLM servers.

A fake vLLM server answers what vLLM's OpenAI server answers and nothing else: /health,
/v1/models and completions (404 for /kv/info, /load, /kv/release), and, as a prefill
instance, returns vLLM-shaped `kv_transfer_params`. It records every request's path.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import msgspec
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from test_router_fake_instance import ThreadServer, wait_for

from pdserve.router.config import RouterConfig
from pdserve.router.vllm_legs import PrefillPeer

# Slow (a router and fake vLLM servers served over real sockets (uvicorn threads)): `make test`
# runs it, the unit tier (`make test-fast`) does not.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]

MODEL = "fake-vllm"
PROMPT = {"model": MODEL, "prompt": "hello", "max_tokens": 4, "temperature": 0}


class FakeVllm:
    """A fake vLLM OpenAI server (see the module doc); `completions` and `paths` record it."""

    def __init__(self, engine_id: str, fail_status: int | None = None) -> None:
        self.engine_id = engine_id
        self.fail_status = fail_status
        self.completions: list[tuple[dict[str, Any], dict[str, str]]] = []  # body, headers
        self.paths: list[str] = []
        self.returned: list[dict[str, Any]] = []  # the kv_transfer_params it answered with
        self._server = ThreadServer(self._app())
        self.url = self._server.url

    def __enter__(self) -> FakeVllm:
        self._server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.stop()

    def _app(self) -> FastAPI:
        app = FastAPI()

        @app.middleware("http")
        async def record(request: Request, call_next: Any) -> Response:
            self.paths.append(request.url.path)
            return await call_next(request)

        @app.get("/health")
        async def health() -> Response:
            return Response(status_code=200)

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
            return {"object": "list", "data": [{"id": MODEL, "object": "model"}]}

        @app.post("/v1/completions")
        async def completions(request: Request) -> Response:
            body = msgspec.json.decode(await request.body())
            self.completions.append((body, dict(request.headers)))
            if self.fail_status is not None:
                error = {"message": "bad request", "type": "BadRequestError", "code": 400}
                return JSONResponse({"error": error}, status_code=self.fail_status)
            if body.get("stream"):
                return StreamingResponse(_chunks(), media_type="text/event-stream")
            return JSONResponse(self._answer(body.get("kv_transfer_params") or {}))

        return app

    def _answer(self, sent: dict[str, Any]) -> dict[str, Any]:
        params = None
        if sent.get("do_remote_decode"):  # what vLLM's NixlConnector returns, in shape
            params = {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_block_ids": [[1, 2]],
                "remote_engine_id": self.engine_id,
                "remote_request_id": f"cmpl-{uuid.uuid4().hex}-0",
                "remote_host": "127.0.0.1",
                "remote_port": 5600,
                "tp_size": 1,
            }
            self.returned.append(params)
        choice = {"index": 0, "text": "x", "finish_reason": "length"}
        return {"id": "cmpl-1", "choices": [choice], "kv_transfer_params": params}


async def _chunks() -> Any:
    for i in range(3):
        chunk = {"id": "cmpl-1", "choices": [{"index": 0, "text": f"t{i}"}]}
        yield b"data: " + msgspec.json.encode(chunk) + b"\n\n"
    yield b"data: [DONE]\n\n"


@contextmanager
def vllm_router(
    p: FakeVllm,
    d: FakeVllm,
    mode: str,
    peers: tuple[PrefillPeer, ...] = (),
    connector: str = "nixl",
    **config: Any,
) -> Iterator[str]:
    from pdserve.router.app import create_app

    cfg = RouterConfig(
        prefill_urls=(p.url,),
        decode_urls=(d.url,),
        kv_transfer=mode,  # type: ignore[arg-type]
        engine="vllm",
        connector=connector,  # type: ignore[arg-type]
        prefill_peers=peers,
        health_interval_s=0.05,
        local_prefill_below=0,
        **config,
    )
    server = ThreadServer(create_app(cfg)).start()
    try:
        wait_for(lambda: httpx.get(f"{server.url}/health").status_code == 200)
        yield server.url
    finally:
        server.stop()


def test_pull_passes_prefill_params_to_decode_untouched() -> None:
    with FakeVllm("P") as p, FakeVllm("D") as d, vllm_router(p, d, "pull", cluster_token="t") as r:
        resp = httpx.post(f"{r}/v1/completions", json={**PROMPT, "stream": True})
    assert resp.status_code == 200 and resp.text.endswith("data: [DONE]\n\n")
    (p_body, p_headers), (d_body, d_headers) = p.completions[0], d.completions[0]
    assert p_body["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False}
    assert p_body["max_tokens"] == 1 and p_body["stream"] is False
    assert d_body["kv_transfer_params"] == p.returned[0]  # as P returned it, not a key changed
    assert d_body["max_tokens"] == 4 and d_body["stream"] is True
    # vLLM checks no pdserve signature: none is sent, even with a cluster token.
    assert not any("signature" in k for k in (*p_headers, *d_headers))
    assert float(resp.headers["x-pdserve-prefill-done"]) <= time.time()


def test_vllm_instances_are_admitted_without_pdserve_routes() -> None:
    with FakeVllm("P") as p, FakeVllm("D") as d, vllm_router(p, d, "pull") as r:
        instances = httpx.get(f"{r}/router/instances").json()
        resp = httpx.post(f"{r}/v1/completions", json=PROMPT)
    assert resp.status_code == 200
    assert [i["admitted"] for i in instances] == [True, True]
    asked = {path for fake in (p, d) for path in fake.paths}
    assert asked <= {"/health", "/v1/completions", "/v1/models"}, asked


def test_push_names_the_configured_peer_and_shares_the_request_id() -> None:
    peer = PrefillPeer("prefill-0", "127.0.0.1", 5601)
    with FakeVllm("P") as p, FakeVllm("D") as d, vllm_router(p, d, "push", (peer,)) as r:
        resp = httpx.post(f"{r}/v1/completions", json={**PROMPT, "stream": True})
    assert resp.status_code == 200
    (p_body, p_headers), (d_body, d_headers) = p.completions[0], d.completions[0]
    rid = p_headers["x-request-id"]
    assert d_headers["x-request-id"] == rid
    assert p_body["kv_transfer_params"] == {"do_remote_decode": True, "do_remote_prefill": False}
    assert d_body["kv_transfer_params"] == {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "prefill-0",
        "remote_host": "127.0.0.1",
        "remote_port": 5601,
        "remote_request_id": f"cmpl-{rid}-0",
        "remote_block_ids": [],
        "tp_size": 1,
    }


def test_two_push_requests_get_different_request_ids() -> None:
    # vLLM pairs P's and D's legs by the request id: reusing one would cross transfers.
    peer = PrefillPeer("prefill-0", "127.0.0.1", 5601)
    with FakeVllm("P") as p, FakeVllm("D") as d, vllm_router(p, d, "push", (peer,)) as r:
        for _ in range(2):
            resp = httpx.post(f"{r}/v1/completions", json=PROMPT, headers={"X-Request-Id": "a"})
            assert resp.status_code == 200
    ids = [h["x-request-id"] for _, h in p.completions]
    assert len(set(ids)) == 2 and "a" not in ids


def test_push_with_pdserves_connector_sends_both_legs_paired_by_transfer_id() -> None:
    # pdserve's connector inside vLLM: D registers its blocks at admission, P writes once
    # its prefill ends; both legs go out at once and name the same transfer id.
    peer = PrefillPeer("prefill-0", "127.0.0.1", 5601)
    with (
        FakeVllm("P") as p,
        FakeVllm("D") as d,
        vllm_router(p, d, "push", (peer,), connector="pdserve") as r,
    ):
        resp = httpx.post(f"{r}/v1/completions", json={**PROMPT, "stream": True})
        resp2 = httpx.post(f"{r}/v1/completions", json=PROMPT)
        metrics = httpx.get(f"{r}/metrics").text
    assert resp.status_code == 200 and resp.text.endswith("data: [DONE]\n\n")
    assert resp2.status_code == 200
    (p_body, _), (d_body, _) = p.completions[0], d.completions[0]
    tid = p_body["kv_transfer_params"]["transfer_id"]
    assert p_body["kv_transfer_params"] == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "transfer_mode": "push",
        "transfer_id": tid,
    }
    assert p_body["max_tokens"] == 1
    assert d_body["kv_transfer_params"] == {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "prefill-0",
        "remote_host": "127.0.0.1",
        "remote_port": 5601,
        "transfer_mode": "push",
        "transfer_id": tid,
    }
    assert d_body["max_tokens"] == 4 and d_body["stream"] is True
    # each request gets its own transfer id
    assert p.completions[1][0]["kv_transfer_params"]["transfer_id"] != tid
    assert d.completions[1][0]["kv_transfer_params"]["transfer_id"] != tid
    assert 'pdserve_router_requests_total{mode="push",status="200"} 2.0' in metrics


def test_decode_refusal_is_relayed_and_no_release_is_sent() -> None:
    with FakeVllm("P") as p, FakeVllm("D", fail_status=400) as d, vllm_router(p, d, "pull") as r:
        resp = httpx.post(f"{r}/v1/completions", json=PROMPT)
        time.sleep(0.2)  # a release would go out in the background
    assert resp.status_code == 400
    assert resp.json()["error"]["message"] == "bad request"
    assert "/kv/release" not in p.paths


def test_push_to_vllm_needs_a_peer_per_prefill_instance() -> None:
    base = {"prefill_urls": ("http://p",), "decode_urls": ("http://d",), "engine": "vllm"}
    with pytest.raises(ValueError, match="peer"):
        RouterConfig(kv_transfer="push", connector="nixl", **base)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="peer"):  # pdserve's connector: D names P too
        RouterConfig(kv_transfer="push", connector="pdserve", **base)  # type: ignore[arg-type]
    assert not RouterConfig(kv_transfer="pull", **base).concurrent_legs  # type: ignore[arg-type]
    peer = PrefillPeer("p", "h", 1)
    with pytest.raises(ValueError, match="one prefill peer per prefill URL"):
        RouterConfig(kv_transfer="pull", prefill_peers=(peer, peer), **base)  # type: ignore[arg-type]
    for connector in ("nixl", "pdserve"):
        config = RouterConfig(
            kv_transfer="push",
            connector=connector,  # type: ignore[arg-type]
            prefill_peers=(peer,),
            **base,  # type: ignore[arg-type]
        )
        assert config.concurrent_legs


@pytest.mark.parametrize("text", ["p@h", "@h:1", "p@:1", "p@h:x", "ph:1"])
def test_prefill_peer_parse_refuses_bad_forms(text: str) -> None:
    with pytest.raises(ValueError, match="ENGINE_ID@HOST:PORT"):
        PrefillPeer.parse(text)


def test_prefill_peer_parse_round_trips() -> None:
    peer = PrefillPeer.parse("prefill-0@127.0.0.1:5601")
    assert peer == PrefillPeer("prefill-0", "127.0.0.1", 5601)
    assert PrefillPeer.parse(str(peer)) == peer
