"""A fake pdserve instance for router and launcher tests (no model, no engine).

It serves the HTTP contract a router relies on (`/health`, `/kv/info`, `/load`,
`/kv/release` (recorded in `released`), `/tokenize`, `/v1/models`, `/v1/completions`,
`/v1/chat/completions` with SSE streaming) and records every completion request it
receives: the body (so `kv_transfer_params` can be checked),
when it arrived, when the answer was sent, and whether the client went away first.
Tests change `behavior` while it runs (they share the process when it runs in a thread).

Run in a thread: `with FakeInstance("prefill") as p: ...`; run as a process (launcher
tests): `python tests/test_router_fake_instance.py --role decode --port N`.
"""

from __future__ import annotations

import argparse
import asyncio
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import msgspec
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pdserve.ports import free_port
from pdserve.router.upstream import Answer
from pdserve.transfer.cluster_auth import CLUSTER_AUTH_HEADER, Proof, check_route
from pdserve.transfer.release import SIGNATURE_HEADER as RELEASE_HEADER

MODEL = "fake-model"

pytestmark = pytest.mark.timeout(60)


class ThreadServer:
    """Serves an ASGI app with uvicorn on 127.0.0.1 in a daemon thread of this process."""

    def __init__(self, app: Any, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            app, host="127.0.0.1", port=self.port, log_level="warning", timeout_graceful_shutdown=1
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    def start(self) -> ThreadServer:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"server on port {self.port} did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)


@dataclass
class Received:
    """One completion request as the fake saw it (times are time.monotonic())."""

    path: str
    body: dict[str, Any]
    headers: dict[str, str]
    arrived: float
    responded: float | None = None  # when the answer (non-stream) or last chunk was sent
    disconnected: bool = False  # the client went away before the answer was complete

    @property
    def params(self) -> dict[str, Any]:
        return self.body.get("kv_transfer_params") or {}


@dataclass
class Behavior:
    """What the fake does; tests may change fields while it runs."""

    healthy: bool = True
    fail_status: int | None = None  # answer completions with this error status
    hold: threading.Event | None = None  # wait for this before answering, failing, 1st chunk
    hold_timeout_s: float = 10.0
    num_chunks: int = 3
    chunk_delay_s: float = 0.0
    die_after_chunks: int | None = None  # drop the connection mid-stream (a crashed D)
    die_inside_an_event: bool = False  # ... after sending the first half of an event
    # Go silent mid-stream (a frozen D) until `resume` is set, at most hold_timeout_s.
    stall_after_chunks: int | None = None
    resume: threading.Event | None = None
    head_event: bool = False  # a stream opens with a token-less role event (like chat)
    return_params: bool = True  # a prefill leg answers with kv_transfer_params
    load: dict[str, Any] = field(
        default_factory=lambda: {
            "num_running": 0,
            "num_waiting": 0,
            "num_waiting_for_kv": 0,
            "kv_blocks_used": 0,
            "kv_blocks_total": 100,
        }
    )


class FakeInstance:
    """A fake P or D instance; `received` lists its completion requests in arrival order."""

    def __init__(
        self,
        role: str = "decode",
        port: int | None = None,
        mode: str | None = None,
        **kw: Any,
    ) -> None:
        self.role = role
        # The transfer mode /kv/info reports; None: the mode of the router it is put behind
        # (`running_router`), else push.
        self.mode = mode
        self.model = MODEL  # the model /kv/info reports
        self.transport = "tcp"
        # With a token, /kv/info and /load answer 401 without a proof of it, as instances do.
        self.cluster_token: str | None = None
        self.released: list[tuple[str, str | None]] = []  # POST /kv/release: (id, signature)
        self.behavior = Behavior(**kw)
        self.engine_id = f"fake-{role}-{uuid.uuid4().hex[:8]}"
        self.incarnation = uuid.uuid4().hex
        self.side_channel_port = free_port()
        self.received: list[Received] = []
        self.tokenized = 0  # POST /tokenize calls
        self.arrived = threading.Event()  # set at the first completion request
        self.app = build_app(self)
        self._server = ThreadServer(self.app, port)
        self.url = self._server.url

    def __enter__(self) -> FakeInstance:
        self._server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.stop()

    def info(self) -> dict[str, Any]:
        return {
            "engine_id": self.engine_id,
            "incarnation": self.incarnation,
            "role": self.role,
            "transfer_mode": self.mode or "push",
            "transport": self.transport,
            "side_channel_host": "127.0.0.1",
            "side_channel_port": self.side_channel_port,
            "model": self.model,
        }


def build_app(fake: FakeInstance) -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if fake.behavior.healthy else 503)

    @app.get("/kv/info")
    async def kv_info(request: Request) -> Any:
        return _unproven(fake, request) or fake.info()

    @app.post("/kv/release")
    async def release(request: Request) -> Response:
        body = msgspec.json.decode(await request.body())
        fake.released.append((body["transfer_id"], request.headers.get(RELEASE_HEADER)))
        return JSONResponse({"transfer_id": body["transfer_id"]}, status_code=202)

    @app.get("/load")
    async def load(request: Request) -> Any:
        return _unproven(fake, request) or fake.behavior.load

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, int]:
        # Byte-level, like builtin models: one token per UTF-8 byte of the prompt text.
        body = msgspec.json.decode(await request.body())
        fake.tokenized += 1
        return {"count": len(str(body.get("prompt", "")).encode())}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": MODEL, "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _complete(fake, request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await _complete(fake, request)

    return app


def _unproven(fake: FakeInstance, request: Request) -> Response | None:
    """A 401 for a route for routers read without a proof of the fake's cluster token."""
    header = request.headers.get(CLUSTER_AUTH_HEADER)
    if check_route(fake.cluster_token, request.url.path, header) is Proof.OK:
        return None
    return JSONResponse({"error": {"message": "no proof"}}, status_code=401)


async def _complete(fake: FakeInstance, request: Request) -> Response:
    body = msgspec.json.decode(await request.body())
    rec = Received(request.url.path, body, dict(request.headers), time.monotonic())
    fake.received.append(rec)
    fake.arrived.set()
    b = fake.behavior
    if b.fail_status is not None:
        await _hold(b, request)  # a held failure comes after the hold
        rec.responded = time.monotonic()
        error = {"message": f"fake failure {b.fail_status}", "type": "server_error"}
        return JSONResponse({"error": error}, status_code=b.fail_status)
    if body.get("stream") is True:
        return StreamingResponse(_stream(fake, rec, request), media_type="text/event-stream")
    if not await _hold(b, request):
        rec.disconnected = True
        return Response(status_code=499)
    answer = {
        "id": "cmpl-fake",
        "object": "text_completion",
        "model": MODEL,
        "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
    }
    params = _params_back(fake, rec.params)
    if params is not None:
        answer["kv_transfer_params"] = params
    rec.responded = time.monotonic()
    return JSONResponse(answer)


async def _hold(b: Behavior, request: Request) -> bool:
    """Wait for `b.hold` (bounded); False if the client disconnected meanwhile."""
    deadline = time.monotonic() + b.hold_timeout_s
    while b.hold is not None and not b.hold.is_set() and time.monotonic() < deadline:
        if await request.is_disconnected():
            return False
        await asyncio.sleep(0.005)
    return True


async def _stall(b: Behavior) -> None:
    deadline = time.monotonic() + b.hold_timeout_s
    while not (b.resume is not None and b.resume.is_set()) and time.monotonic() < deadline:
        await asyncio.sleep(0.005)


def _params_back(fake: FakeInstance, sent: dict[str, Any]) -> dict[str, Any] | None:
    if not (sent.get("do_remote_decode") and fake.behavior.return_params):
        return None
    back: dict[str, Any] = {"remote_num_tokens": 5, "prefill_done_time": time.time()}
    if sent.get("transfer_mode") == "push":
        return {**back, "transfer_id": sent.get("transfer_id")}
    return {
        **back,
        "remote_engine_id": fake.engine_id,
        "remote_host": "127.0.0.1",
        "remote_port": fake.side_channel_port,
        "remote_block_ids": [3, 4],
        "first_token_id": 7,
        "transfer_id": uuid.uuid4().hex,
    }


async def _stream(fake: FakeInstance, rec: Received, request: Request) -> AsyncIterator[bytes]:
    b = fake.behavior
    try:
        if b.head_event:
            head = {"id": "cmpl-fake", "choices": [{"index": 0, "delta": {"role": "assistant"}}]}
            yield b"data: " + msgspec.json.encode(head) + b"\n\n"
        if not await _hold(b, request):
            rec.disconnected = True
            return
        for i in range(b.num_chunks):
            if i == b.die_after_chunks:
                if b.die_inside_an_event:
                    yield b'data: {"id":"cmpl-fake","choices":[{"index":0,"te'
                    await asyncio.sleep(0.05)  # sent on its own, before the connection drops
                raise RuntimeError("fake decode instance died mid-stream")
            if i == b.stall_after_chunks:
                await _stall(b)
            chunk = {
                "id": "cmpl-fake",
                "object": "text_completion",
                "model": MODEL,
                "choices": [{"index": 0, "text": f"t{i} ", "finish_reason": None}],
            }
            yield b"data: " + msgspec.json.encode(chunk) + b"\n\n"
            await asyncio.sleep(b.chunk_delay_s)
        yield b"data: [DONE]\n\n"
        rec.responded = time.monotonic()
    except asyncio.CancelledError:
        rec.disconnected = True
        raise


@contextmanager
def running_router(
    prefill: list[FakeInstance], decode: list[FakeInstance], mode: str = "pull", **config: Any
) -> Iterator[str]:
    """A router app on a free port in this process, health-checking fast; yields its URL
    once it reports healthy (or at once with `wait_ready=False`)."""
    from pdserve.router.app import create_app
    from pdserve.router.config import RouterConfig

    wait_ready = config.pop("wait_ready", True)
    for fake in (*prefill, *decode):
        fake.mode = fake.mode or mode  # fits the router unless the test says otherwise
    # Local prefill off unless a test asks for it: these tests are about the P/D legs.
    defaults = {
        "health_interval_s": 0.05,
        "load_interval_s": 0.05,
        "request_timeout_s": 30.0,
        "local_prefill_below": 0,
    }
    cfg = RouterConfig(
        prefill_urls=tuple(f.url for f in prefill),
        decode_urls=tuple(f.url for f in decode),
        kv_transfer=mode,  # type: ignore[arg-type]
        **{**defaults, **config},
    )
    server = ThreadServer(create_app(cfg)).start()
    try:
        if wait_ready:
            wait_for(lambda: httpx.get(f"{server.url}/health").status_code == 200)
        yield server.url
    finally:
        server.stop()


class ScriptedHealth:
    """Stands in for the router's `Upstream` in health-monitor tests: `/health` answers
    the next status of `script`, any other GET (e.g. `/kv/info`) 404."""

    def __init__(self, script: Iterator[int]) -> None:
        self._script = script

    async def get(self, url: str, *, timeout_s: float, headers: Any = None) -> Answer:
        return Answer(next(self._script) if url.endswith("/health") else 404, b"")


def wait_for(condition: Callable[[], object], timeout: float = 10.0) -> None:
    """Poll `condition` until true; fail the test if it never is."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(0.01)


def test_fake_instance_answers_a_prefill_leg() -> None:
    """The fake itself: a P leg gets kv_transfer_params back (guards the other tests)."""
    with FakeInstance("prefill") as p:
        r = httpx.post(
            f"{p.url}/v1/completions",
            json={
                "prompt": "hi",
                "max_tokens": 1,
                "kv_transfer_params": {"do_remote_decode": True, "transfer_mode": "pull"},
            },
        )
    assert r.status_code == 200
    assert r.json()["kv_transfer_params"]["remote_engine_id"] == p.engine_id
    assert p.received[0].params["transfer_mode"] == "pull"


def main() -> None:
    """Run as a process, with the flags `pdserve serve` takes (unknown ones are ignored)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--role", default="both")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--threads", type=int)
    parser.add_argument("--kv-transfer", default=None)
    args, _ = parser.parse_known_args()
    fake = FakeInstance(args.role, port=args.port, mode=args.kv_transfer)
    uvicorn.run(fake.app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
