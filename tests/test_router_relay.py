"""The router's relay of D's stream as ASGI messages: the status line and D's first token go
out from the calling task, before Starlette starts its body task and disconnect listener
(which cost the first token a loop iteration and router CPU on a shared core), and the rest
of D's stream follows whole, once."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace

import pytest

from pdserve.router.config import RouterConfig
from pdserve.router.dispatch import DecodeRelay, DecodeStart, RelayStreamingResponse
from pdserve.router.health import InstancePool
from pdserve.router.metrics import RouterMetrics

pytestmark = pytest.mark.timeout(30)

FIRST = b'data: {"choices": [{"text": "a"}]}\n\n'
REST = [b'data: {"choices": [{"text": "b"}]}\n\n', b"data: [DONE]\n\n"]


async def _rest() -> AsyncIterator[bytes]:
    for chunk in REST:
        yield chunk


class _Answer:
    """D's answer as the relay sees it (`pdserve.router.upstream.StreamAnswer`)."""

    status = 200
    content_type = "text/event-stream"

    def close(self) -> None:
        pass


class _Pool:
    def __init__(self) -> None:
        self.released = 0

    def release(self, inst: object, leg: object) -> None:
        self.released += 1


def _relay(pool: _Pool) -> DecodeRelay:
    start = DecodeStart(
        _Answer(),  # type: ignore[arg-type]
        time.monotonic(),
        FIRST,
        time.time(),
        _rest(),
    )
    leg = SimpleNamespace(ejected=asyncio.Event())
    metrics = RouterMetrics(InstancePool(RouterConfig(("http://p:1",), ("http://d:1",), "push")))
    return DecodeRelay(pool, metrics, "push", lambda e: None, 1.0, object(), leg, start, None)


@pytest.mark.parametrize("spec_version", ["2.3", "2.4"])
def test_first_token_goes_out_before_the_body_task_and_rest_follows_once(spec_version) -> None:
    seen: list[tuple[str, bytes]] = []
    pool = _Pool()

    async def receive() -> dict:
        seen.append(("receive", b""))
        await asyncio.Event().wait()  # the client stays connected
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        seen.append((message["type"], message.get("body", b"")))

    async def scenario() -> None:
        response = RelayStreamingResponse(_relay(pool), 200, {}, None)
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": spec_version}}
        await response(scope, receive, send)

    asyncio.run(scenario())
    kinds = [k for k, _ in seen]
    assert kinds[:2] == ["http.response.start", "http.response.body"]
    assert seen[1][1] == FIRST  # the first token, before anything else is awaited
    assert kinds.count("http.response.start") == 1
    body = b"".join(b for k, b in seen if k == "http.response.body")
    assert body == FIRST + b"".join(REST)
    assert pool.released == 1  # the relay gave D's leg back once
