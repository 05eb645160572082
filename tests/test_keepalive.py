"""Keep-alive: pdserve's servers keep an idle connection open longer than pdserve's clients
keep theirs (pdserve.keepalive), so a client never sends a request on a connection that
the server is closing at that moment."""

from __future__ import annotations

import asyncio
import http.client
import select
import time

import pytest
from procs import PdserveProcess, free_port

from pdserve.bench.client import open_session
from pdserve.keepalive import CLIENT_KEEPALIVE_S, SERVER_KEEPALIVE_S

pytestmark = [pytest.mark.timeout(120)]

UVICORN_DEFAULT_KEEPALIVE_S = 5.0  # what the servers closed idle connections after before


def test_clients_drop_idle_connections_well_before_servers_do() -> None:
    async def bench_keepalive_s() -> float:  # `bench` and `soak`'s session
        async with open_session(5.0, 8) as session:
            return session.connector._keepalive_timeout  # type: ignore[union-attr]  # no getter

    assert asyncio.run(bench_keepalive_s()) == CLIENT_KEEPALIVE_S
    assert CLIENT_KEEPALIVE_S + 5 <= SERVER_KEEPALIVE_S


def _still_open_after_idle(url: str, path: str) -> None:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request("GET", path)
        first = conn.getresponse()
        first.read()  # the whole body: nothing of it may be left to look "readable" below
        assert first.status == 200 and not first.will_close
        sock = conn.sock
        time.sleep(UVICORN_DEFAULT_KEEPALIVE_S + 1.0)
        readable, _, _ = select.select([sock], [], [], 0)
        assert not readable, "the server closed the idle connection"  # EOF would be readable
        conn.request("GET", path)
        second = conn.getresponse()
        second.read()
        assert second.status == 200 and conn.sock is sock  # the same connection, reused
    finally:
        conn.close()


@pytest.mark.slow  # two real servers and a 6 s idle wait each
def test_instance_and_router_keep_idle_connections_past_the_old_five_seconds() -> None:
    with PdserveProcess(["serve", "--model", "builtin:tiny", "--threads", "1"]) as server:
        _still_open_after_idle(server.url, "/health")
    # a router needs no live instance to answer /metrics
    nowhere = f"http://127.0.0.1:{free_port()}"
    args = ["router", "--kv-transfer", "push", "--prefill", nowhere, "--decode", nowhere]
    with PdserveProcess(args, health_path="/metrics") as router:
        _still_open_after_idle(router.url, "/metrics")
