"""HTTP-side security: the router's API key, body size limits, and loopback-only defaults.

- With `--api-key`, every /v1/* route of the router (and its instance listing) refuses a
  missing or wrong bearer token with an OpenAI-style 401; probes (/health, /metrics) stay
  open. (The instance's own key is tested in tests/test_server_app.py.)
- A body over the limit gets a 413 from the router as from an instance.
- Instances, their side channel and transport, the router and `pdserve up` listen on
  127.0.0.1 unless `--host`/`--kv-host` say otherwise: checked on the flags' defaults and on
  the listening sockets of real started processes.
"""

from __future__ import annotations

import ipaddress
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from procs import PdserveProcess, free_port

from pdserve.cli import parse_args
from pdserve.config import ConnectorConfig, ServerConfig, TransportConfig
from pdserve.router.app import create_app
from pdserve.router.config import RouterConfig
from pdserve.server.body_limit import MAX_BODY_BYTES
from pdserve.server.exposure import router_warning, serve_warning, up_warning

pytestmark = pytest.mark.timeout(180)

KEY = "router-secret"
BODY = {"prompt": "hi", "max_tokens": 1}
V1_ROUTES = [
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("GET", "/v1/models"),
    ("GET", "/router/instances"),
]


@pytest.fixture
def router() -> Iterator[TestClient]:
    """A router with an API key in front of two addresses nobody listens at."""
    cfg = RouterConfig(
        prefill_urls=(f"http://127.0.0.1:{free_port()}",),
        decode_urls=(f"http://127.0.0.1:{free_port()}",),
        kv_transfer="pull",
        api_key=KEY,
        health_interval_s=0.05,
        health_timeout_s=0.2,
    )
    with TestClient(create_app(cfg), raise_server_exceptions=False) as client:
        yield client


def test_every_v1_route_of_the_router_is_covered(router: TestClient) -> None:
    paths = router.app.openapi()["paths"]  # type: ignore[attr-defined]
    v1 = {(method.upper(), p) for p, ops in paths.items() if p.startswith("/v1/") for method in ops}
    assert v1 <= set(V1_ROUTES), v1 - set(V1_ROUTES)


@pytest.mark.parametrize(("method", "path"), V1_ROUTES)
@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": f"Bearer {KEY}x"},
        {"Authorization": KEY},  # no scheme
        {"Authorization": f"Basic {KEY}"},
        {"Authorization": "Bearer "},
        {"X-Api-Key": KEY},  # not where OpenAI clients put it
    ],
    ids=["none", "wrong", "longer", "no-scheme", "basic", "empty", "other-header"],
)
def test_router_refuses_requests_without_the_key(
    router: TestClient, method: str, path: str, headers: dict[str, str]
) -> None:
    r = router.request(method, path, json=BODY if method == "POST" else None, headers=headers)
    assert r.status_code == 401, r.text
    err = r.json()["error"]
    assert err["type"] == "authentication_error" and err["code"] == "invalid_api_key"
    assert "Bearer" in err["message"]


@pytest.mark.parametrize(("method", "path"), V1_ROUTES)
def test_router_passes_requests_with_the_key(router: TestClient, method: str, path: str) -> None:
    good = {"Authorization": f"Bearer {KEY}"}
    r = router.request(method, path, json=BODY if method == "POST" else None, headers=good)
    assert r.status_code != 401, r.text  # 503 here: no instance is healthy


def test_router_probes_need_no_key(router: TestClient) -> None:
    assert router.get("/health").status_code in (200, 503)
    assert router.get("/metrics").status_code == 200


def test_router_refuses_a_body_over_the_limit(router: TestClient) -> None:
    huge = b'{"prompt": "' + b"x" * MAX_BODY_BYTES + b'"}'
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    r = router.post("/v1/completions", content=huge, headers=headers)
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]


# -- listening addresses ------------------------------------------------------------------


def test_defaults_are_loopback() -> None:
    assert ServerConfig().host == "127.0.0.1"
    assert TransportConfig().host == "127.0.0.1"
    assert ConnectorConfig(role="prefill", mode="pull", engine_id="e").side_host == "127.0.0.1"
    serve = parse_args(["serve"])
    assert (serve.host, serve.kv_host) == ("127.0.0.1", "127.0.0.1")
    router = parse_args(["router", "--prefill", "a:1", "--decode", "b:2", "--kv-transfer", "push"])
    assert router.host == "127.0.0.1"
    cfg = RouterConfig(prefill_urls=("a",), decode_urls=("b",), kv_transfer="pull")
    assert cfg.host == "127.0.0.1"
    assert parse_args(["up", "--kv-transfer", "push"]).host == "127.0.0.1"


def listening(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket of `pid` in LISTEN state (from /proc)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table in ("tcp", "tcp6"):
        lines = Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]
        for line in lines:
            cols = line.split()
            local, state, inode = cols[1], cols[3], cols[9]
            if state == "0A" and inode in inodes:  # 0A: LISTEN
                found.add(_address(local))
    return found


def _address(hex_addr: str) -> tuple[str, int]:
    ip_hex, port_hex = hex_addr.split(":")
    raw = bytes.fromhex(ip_hex)
    # /proc prints the address as 32-bit words in host (little-endian) order.
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(words)), int(port_hex, 16)


def assert_loopback_only(proc: PdserveProcess, at_least: int) -> set[tuple[str, int]]:
    sockets = listening(proc.pid)
    assert len(sockets) >= at_least, sockets
    for host, port in sockets:
        assert ipaddress.ip_address(host).is_loopback, (host, port)
    return sockets


def test_a_started_prefill_instance_listens_on_loopback_only() -> None:
    """HTTP, side channel and transport: three listeners, no --host/--kv-host given."""
    port = free_port()
    args = ["serve", "--model", "builtin:tiny", "--role", "prefill", "--kv-transfer", "push"]
    args += ["--threads", "1", "--num-kv-blocks", "32", "--max-model-len", "256"]
    args += ["--port", str(port), "--log-level", "warning"]
    with PdserveProcess(args, port=port, port_args=False) as proc:
        sockets = assert_loopback_only(proc, at_least=3)
        assert ("127.0.0.1", port) in sockets


def test_a_started_router_listens_on_loopback_only() -> None:
    port = free_port()
    args = ["router", "--prefill", f"127.0.0.1:{free_port()}", "--decode"]
    args += [f"127.0.0.1:{free_port()}", "--kv-transfer", "pull", "--port", str(port)]
    with PdserveProcess(args, port=port, port_args=False, health_path="/metrics") as proc:
        assert assert_loopback_only(proc, at_least=1) == {("127.0.0.1", port)}


@pytest.mark.parametrize("path", ["/docs", "/redoc", "/openapi.json"])
def test_the_router_publishes_no_api_map(router: TestClient, path: str) -> None:
    assert router.get(path).status_code == 404


# -- the loud warning ---------------------------------------------------------------------


def test_exposure_warnings_say_what_is_exposed_and_how_to_fix_it() -> None:
    assert serve_warning("prefill", "127.0.0.1", "127.0.0.1", None) is None
    assert serve_warning("decode", "0.0.0.0", "10.0.0.2", "token") is None
    assert serve_warning("both", "0.0.0.0", "0.0.0.0", None) is None  # no P/D legs
    text = serve_warning("decode", "0.0.0.0", "::1", None)
    assert text and "HTTP on 0.0.0.0" in text and "KV side" not in text
    assert "--cluster-token" in text and "P/D legs" in text
    assert "KV side channel and transport on 10.0.0.2" in str(
        serve_warning("prefill", "localhost", "10.0.0.2", None)
    )
    assert router_warning("127.0.0.1", ["http://127.0.0.1:1", "http://[::1]:2"], None) is None
    assert router_warning("0.0.0.0", ["http://10.0.0.1:1"], "token") is None
    assert "--cluster-token" in str(router_warning("0.0.0.0", ["http://127.0.0.1:1"], None))
    assert "http://10.0.0.1:1" in str(router_warning("127.0.0.1", ["http://10.0.0.1:1"], None))
    assert up_warning("127.0.0.1", None) is None and up_warning("0.0.0.0", "key") is None
    assert "--api-key" in str(up_warning("0.0.0.0", None))


def test_a_pd_instance_warns_at_start_when_its_kv_host_is_open_without_a_token() -> None:
    """A wildcard --kv-host without --kv-advertise-host is refused after the warning, so
    nothing ever listens beyond loopback here."""
    env = {k: v for k, v in os.environ.items() if k != "PDSERVE_CLUSTER_TOKEN"}
    args = ["serve", "--role", "prefill", "--kv-transfer", "push", "--kv-host", "0.0.0.0"]
    args += ["--port", "0", "--threads", "1", "--model", "builtin:tiny"]
    done = subprocess.run(
        [sys.executable, "-m", "pdserve", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert done.returncode == 2, done.stderr
    assert "WARNING pdserve.serve: this prefill instance listens beyond loopback" in done.stderr
    assert "WITHOUT a cluster token" in done.stderr and "--cluster-token" in done.stderr
