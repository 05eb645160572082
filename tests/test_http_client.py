"""pdserve.http_client against a local stdlib server: answers whole whatever their status,
no redirect followed, pooled connections, and every failure (refused, timed out) as one
`HttpError`."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from pdserve import http_client
from pdserve.http_client import Client, HttpError
from pdserve.keepalive import CLIENT_KEEPALIVE_S

pytestmark = pytest.mark.timeout(60)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, so that a pooled connection can be reused

    def do_GET(self) -> None:
        self.server.peers.append(self.client_address)  # type: ignore[attr-defined]
        if self.path == "/json":
            self._answer(200, json.dumps({"seen": self.headers.get("x-probe")}).encode())
        elif self.path == "/text":
            self._answer(200, "zwölf\n".encode())
        elif self.path == "/redirect":
            self._answer(302, b"", location="/json")
        else:
            self._answer(404, b'{"detail":"Not Found"}')

    def _answer(self, status: int, body: bytes, location: str | None = None) -> None:
        self.send_response(status)
        self.send_header("content-length", str(len(body)))
        if location is not None:
            self.send_header("location", location)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[tuple[str, ThreadingHTTPServer]]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.daemon_threads = True
    httpd.peers = []  # type: ignore[attr-defined]
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", httpd
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(timeout=5)


def test_status_text_and_json_come_back_whole(server: tuple[str, ThreadingHTTPServer]) -> None:
    url, _ = server
    with Client(timeout_s=5.0) as client:
        resp = client.get(f"{url}/json", headers={"x-probe": "yes"})
        assert resp.status == 200 and resp.json() == {"seen": "yes"}
        assert resp.raise_for_status() is resp
        text = client.get(f"{url}/text")
        assert text.text == "zwölf\n" and text.body == "zwölf\n".encode()
        with pytest.raises(ValueError):
            text.json()


def test_an_error_status_is_an_answer_until_raise_for_status(
    server: tuple[str, ThreadingHTTPServer],
) -> None:
    url, _ = server
    resp = http_client.get(f"{url}/missing", timeout_s=5.0)
    assert resp.status == 404 and resp.json() == {"detail": "Not Found"}
    with pytest.raises(HttpError, match="HTTP 404 Not Found") as failed:
        resp.raise_for_status()
    assert failed.value.status == 404


def test_a_redirect_is_not_followed(server: tuple[str, ThreadingHTTPServer]) -> None:
    url, httpd = server
    resp = http_client.get(f"{url}/redirect", timeout_s=5.0)
    assert resp.status == 302 and len(httpd.peers) == 1  # type: ignore[attr-defined]
    with pytest.raises(HttpError):
        resp.raise_for_status()


def test_a_client_reuses_its_connection(server: tuple[str, ThreadingHTTPServer]) -> None:
    url, httpd = server
    with Client(timeout_s=5.0) as client:
        for _ in range(3):
            assert client.get(f"{url}/json").status == 200
    peers = httpd.peers  # type: ignore[attr-defined]
    assert len(peers) == 3 and len(set(peers)) == 1, peers


@pytest.mark.slow  # waits out the real CLIENT_KEEPALIVE_S (4 s) that pdserve's clients use
def test_a_client_drops_an_idle_connection_after_the_client_keepalive(
    server: tuple[str, ThreadingHTTPServer],
) -> None:
    url, httpd = server
    with Client(timeout_s=5.0) as client:
        assert client.get(f"{url}/json").status == 200
        time.sleep(CLIENT_KEEPALIVE_S + 0.5)  # well before any server of pdserve drops it
        assert client.get(f"{url}/json").status == 200
    first, second = httpd.peers  # type: ignore[attr-defined]
    assert first != second


def test_connection_refused_raises_http_error() -> None:
    with socket.socket() as bound:  # bound, not listening: connecting is refused
        bound.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{bound.getsockname()[1]}/health"
        with Client(timeout_s=5.0) as client, pytest.raises(HttpError, match="/health"):
            client.get(url)


def test_no_answer_in_time_raises_http_error() -> None:
    with socket.socket() as mute:  # the kernel accepts the connection; nobody answers
        mute.bind(("127.0.0.1", 0))
        mute.listen()
        url = f"http://127.0.0.1:{mute.getsockname()[1]}/health"
        start = time.monotonic()
        with pytest.raises(HttpError, match=r"no answer within 0\.3 s"):
            http_client.get(url, timeout_s=0.3)
        assert time.monotonic() - start < 3.0
