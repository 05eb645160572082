"""Each of D's events reaches the client before D sends the next one.

A fake decode instance streams its events in lock-step with the client: it sends event k,
then waits until the client, reading through a real router over real sockets, has parsed
event k. A router that held any event back (to batch it with the next one) would make that
wait time out, so the test fails on structure, not on speed: each wait is bounded at
seconds while a relayed event takes about a millisecond.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import msgspec
import pytest
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from test_router_fake_instance import MODEL, FakeInstance, ThreadServer, running_router

pytestmark = pytest.mark.timeout(60)

NUM_EVENTS = 20
WAIT_S = 2.0  # far above a relay's latency (~1 ms): only an event held back runs into it


class LockstepDecode:
    """A decode instance whose stream sends event k+1 only once the client saw event k."""

    def __init__(self) -> None:
        self.seen = [threading.Event() for _ in range(NUM_EVENTS)]
        self.held_back: list[int] = []  # the first event the client had not seen in WAIT_S
        self.sent = 0
        self._fake = FakeInstance("decode")  # only its identity (`/kv/info`) is used
        self._server = ThreadServer(self._app())
        self.url = self._server.url

    @property
    def mode(self) -> str | None:
        """The transfer mode `/kv/info` reports (`running_router` fits it to the router)."""
        return self._fake.mode

    @mode.setter
    def mode(self, value: str | None) -> None:
        self._fake.mode = value

    def __enter__(self) -> LockstepDecode:
        self._server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        for e in self.seen:
            e.set()  # release a stream still waiting
        self._server.stop()

    def _app(self) -> FastAPI:
        app = FastAPI()
        app.get("/health")(lambda: {})
        app.get("/kv/info")(lambda: self._fake.info())
        app.get("/v1/models")(lambda: {"object": "list", "data": [{"id": MODEL}]})

        @app.post("/v1/completions")
        async def completions() -> StreamingResponse:
            return StreamingResponse(self._events(), media_type="text/event-stream")

        return app

    async def _events(self) -> AsyncIterator[bytes]:
        for k in range(NUM_EVENTS):
            self.sent = k + 1  # before the yield: the client may parse it before we resume
            yield _token_event(k)
            # After one event held back, stop waiting: the test has failed, end it quickly.
            if not self.held_back and not await _wait(self.seen[k], WAIT_S):
                self.held_back.append(k)
        yield b"data: [DONE]\n\n"


def _token_event(k: int) -> bytes:
    chunk = {"id": "cmpl-x", "model": MODEL, "choices": [{"index": 0, "text": f"t{k} "}]}
    return b"data: " + msgspec.json.encode(chunk) + b"\n\n"


async def _wait(event: threading.Event, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not event.is_set():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.0005)
    return True


def _read_in_lockstep(url: str, d: LockstepDecode, body: dict[str, Any]) -> list[int]:
    """Stream `body` from `url`, telling `d` about each token event as it is parsed;
    returns, per token event, how many events D had sent when the client parsed it."""
    sent_when_seen: list[int] = []
    buffer = b""
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        for raw in r.iter_raw():
            buffer += raw
            *events, buffer = buffer.split(b"\n\n")
            for event in events:
                if b'"choices"' in event:
                    sent_when_seen.append(d.sent)
                    d.seen[len(sent_when_seen) - 1].set()
    return sent_when_seen


@pytest.mark.parametrize("mode", ["push", "pull", "local"])
def test_each_event_reaches_the_client_before_the_next_is_sent(mode: str) -> None:
    body = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": NUM_EVENTS, "stream": True}
    config: dict[str, Any] = {"local_prefill_below": 1000} if mode == "local" else {}
    with (
        FakeInstance("prefill") as p,
        LockstepDecode() as d,
        running_router([p], [d], "pull" if mode == "pull" else "push", **config) as url,
    ):
        sent_when_seen = _read_in_lockstep(url, d, body)
    assert d.held_back == []
    # The client parsed event k while D had sent k events: never two at once.
    assert sent_when_seen == list(range(1, NUM_EVENTS + 1))
