"""Keep-alive: pdserve's servers keep an idle connection open longer than pdserve's clients
keep theirs (pdserve.keepalive), so a client never sends a request on a connection that
the server is closing at that moment."""

from __future__ import annotations

import select
import socket
import time

import pytest
from procs import PdserveProcess, free_port

from pdserve.keepalive import CLIENT_KEEPALIVE_S, SERVER_KEEPALIVE_S, client_limits

pytestmark = [pytest.mark.timeout(120)]

UVICORN_DEFAULT_KEEPALIVE_S = 5.0  # what the servers closed idle connections after before


def test_clients_drop_idle_connections_well_before_servers_do() -> None:
    assert client_limits(8).keepalive_expiry == CLIENT_KEEPALIVE_S
    assert CLIENT_KEEPALIVE_S + 5 <= SERVER_KEEPALIVE_S


def _get(sock: socket.socket, path: str) -> bytes:
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(65536)
        assert chunk, "the server closed the connection"
        head += chunk
    return head.split(b"\r\n", 1)[0]


def _still_open_after_idle(url: str, path: str) -> None:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        assert b" 200 " in _get(sock, path)
        time.sleep(UVICORN_DEFAULT_KEEPALIVE_S + 1.0)
        readable, _, _ = select.select([sock], [], [], 0)
        assert not readable, "the server closed the idle connection"  # EOF would be readable
        assert b" 200 " in _get(sock, path)


@pytest.mark.slow  # two real servers and a 6 s idle wait each
def test_instance_and_router_keep_idle_connections_past_the_old_five_seconds() -> None:
    with PdserveProcess(["serve", "--model", "builtin:tiny", "--threads", "1"]) as server:
        _still_open_after_idle(server.url, "/health")
    # a router needs no live instance to answer /metrics
    nowhere = f"http://127.0.0.1:{free_port()}"
    args = ["router", "--kv-transfer", "push", "--prefill", nowhere, "--decode", nowhere]
    with PdserveProcess(args, health_path="/metrics") as router:
        _still_open_after_idle(router.url, "/metrics")
