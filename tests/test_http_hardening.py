"""HTTP bounds of every pdserve server (instances and the router): JSON depth, slow headers.

- a body nested deeper than `MAX_JSON_DEPTH` gets a 400 from the router (it used to be a
  500 with a RecursionError), and `json_depth` measures any depth without recursing;
- `HeaderDeadlineProtocol` closes a connection whose request headers do not arrive in time
  (silent, or trickled), and leaves a normal keep-alive connection alone.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from hypothesis import given
from hypothesis import strategies as st

from pdserve.httpd.protocol import HeaderDeadlineProtocol
from pdserve.ports import free_port
from pdserve.server.errors import MAX_JSON_DEPTH, json_depth
from tests.test_router_fake_instance import FakeInstance, running_router

pytestmark = pytest.mark.timeout(60)


def nested(depth: int) -> object:
    value: object = 1
    for i in range(depth):
        value = [value] if i % 2 else {"k": value}
    return value


@given(st.integers(0, 300))
def test_json_depth_counts_every_level(depth: int) -> None:
    assert json_depth(nested(depth)) == depth


def test_json_depth_takes_the_deepest_branch() -> None:
    assert json_depth({"a": [1, 2], "b": {"c": [[{}]]}, "d": "x"}) == 5


def test_the_router_refuses_deep_json_with_a_400() -> None:
    with FakeInstance("prefill") as p, FakeInstance("decode") as d, running_router([p], [d]) as r:
        for depth in (MAX_JSON_DEPTH + 1, 1000, 200_000):
            raw = b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}"
            resp = httpx.post(
                f"{r}/v1/completions", content=raw, headers={"Content-Type": "application/json"}
            )
            assert resp.status_code == 400, resp.text[:300]
            assert resp.json()["error"]["type"] == "invalid_request_error"
        assert not p.received  # nothing too deep was passed on
        ok = {"prompt": [[1]] * 3, "max_tokens": 1}  # shallow nesting is fine
        assert httpx.post(f"{r}/v1/completions", json=ok).status_code != 400


class _Server:
    def __init__(self, header_timeout_s: float) -> None:
        app = FastAPI()

        @app.get("/ping")
        async def ping() -> dict[str, str]:
            return {"ok": "yes"}

        class Quick(HeaderDeadlineProtocol):
            pass

        Quick.header_timeout_s = header_timeout_s
        self.port = free_port()
        config = uvicorn.Config(
            app, host="127.0.0.1", port=self.port, log_level="warning", http=Quick
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)


@pytest.fixture
def server() -> Iterator[_Server]:
    s = _Server(header_timeout_s=0.5)
    s.thread.start()
    deadline = time.monotonic() + 10
    while not s.server.started:
        assert time.monotonic() < deadline and s.thread.is_alive(), "server did not start"
        time.sleep(0.01)
    try:
        yield s
    finally:
        s.server.should_exit = True
        s.thread.join(10)


def closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the server closes `sock` within `seconds` (reads until EOF)."""
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            pass
    except TimeoutError:
        return False
    return True


def test_a_silent_connection_is_closed(server: _Server) -> None:
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        assert closed_within(sock, 5.0)


def test_trickled_headers_are_cut_off(server: _Server) -> None:
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"GET /ping HTTP/1.1\r\nHost: x\r\n")
        end = time.monotonic() + 5.0
        closed = False
        while time.monotonic() < end and not closed:
            try:
                sock.sendall(b"X-Slow: 1\r\n")
            except OSError:
                closed = True
                break
            closed = closed_within(sock, 0.2)
        assert closed, "headers trickled for 5 s and the connection is still open"


def test_a_normal_keep_alive_connection_is_served(server: _Server) -> None:
    with httpx.Client(base_url=f"http://127.0.0.1:{server.port}") as client:
        for _ in range(3):
            assert client.get("/ping").json() == {"ok": "yes"}
            time.sleep(0.3)  # idle between requests is keep-alive's business, not ours
