"""pdserve.ports: distinct free ports, the kernel behaviour `bind_socket` relies on, and the
"who listens here" check that keeps a health probe from trusting another process's answer."""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import zmq

from pdserve.http_client import Client
from pdserve.launcher import ManagedProcess, is_healthy
from pdserve.ports import bind_socket, free_ports, is_address_in_use, listens

pytestmark = pytest.mark.timeout(60)


@contextmanager
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    """A child process that listens on nothing."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        yield child
    finally:
        child.kill()
        child.wait()


def test_free_ports_are_distinct_and_bindable() -> None:
    ports = free_ports(64)
    assert len(set(ports)) == 64
    with bind_socket("127.0.0.1", ports[0]) as s:
        s.listen()


def test_listens_tells_the_owner_of_a_listening_socket() -> None:
    with socket.socket() as s, sleeper() as child:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        assert not listens(os.getpid(), port)  # bound, not listening yet
        s.listen()
        assert listens(os.getpid(), port)
        assert not listens(child.pid, port)


def test_a_second_socket_can_bind_but_not_listen_on_a_port() -> None:
    """Why `pdserve serve` calls listen() itself before it says it serves: with SO_REUSEADDR
    two not-yet-listening sockets can share a port, and only the first to listen gets it."""
    first = bind_socket("127.0.0.1", 0)
    port = first.getsockname()[1]
    with first, bind_socket("127.0.0.1", port) as second:
        first.listen()
        with pytest.raises(OSError) as info:
            second.listen()
        assert is_address_in_use(info.value)


def test_is_address_in_use_reads_oserror_and_zmq_errors() -> None:
    assert is_address_in_use(OSError(errno.EADDRINUSE, "taken"))
    assert not is_address_in_use(OSError(errno.ECONNREFUSED, "refused"))
    assert not is_address_in_use(ValueError("x"))
    with socket.socket() as taken, zmq.Context() as ctx, ctx.socket(zmq.PULL) as pull:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(zmq.ZMQError) as info:
            pull.bind(f"tcp://127.0.0.1:{taken.getsockname()[1]}")
        assert is_address_in_use(info.value)


class _Ok(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_health_answered_by_another_process_does_not_count(tmp_path: Path) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Ok)  # stands for the port's taker
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with sleeper() as child, Client(timeout_s=5.0) as client:
            assert client.get(f"{url}/health").status == 200
            beaten = ManagedProcess("prefill-0", "prefill", url, child, None, tmp_path / "log")
            assert not is_healthy(client, beaten)
    finally:
        server.shutdown()
        server.server_close()
