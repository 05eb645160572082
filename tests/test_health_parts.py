"""An instance whose KV connector lost a part it needs answers /health 503, naming it:
a KV listener whose socket died, a connector thread that ended. While whole it answers 200,
and a listener that only ran out of file descriptors keeps going (test_transport_bounded)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from pdserve.config import ModelConfig, ServerConfig
from pdserve.engine.async_engine import AsyncEngine
from pdserve.model.loader import LoadedModel, load_model
from pdserve.server.app import create_app
from tests.pd_harness import make_engine

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return load_model(ModelConfig(cache_dir=tmp_path_factory.mktemp("models")))


@pytest.fixture(params=["push", "pull"])
def decode(loaded: LoadedModel, request: pytest.FixtureRequest) -> Iterator[tuple]:
    llm = make_engine(loaded, "decode", request.param)
    engine = AsyncEngine(llm)
    engine.start()
    try:
        with TestClient(create_app(engine, ServerConfig())) as client:
            yield client, llm
    finally:
        engine.shutdown()
        llm.close()


def health_within(client: TestClient, status: int, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while (r := client.get("/health")).status_code != status:
        assert time.monotonic() < deadline, (r.status_code, r.text)
        time.sleep(0.05)
    return r.json()


def test_a_dead_kv_listener_makes_health_503(decode: tuple) -> None:
    client, llm = decode
    assert health_within(client, 200) == {"status": "ok"}
    listener = llm.connector.transport.transport._listeners[0]
    listener._sock.close()  # the socket is gone: no retry can cure that
    body = health_within(client, 503)
    assert body["error"]["code"] == "connector_stopped"
    assert "KV listener" in body["error"]["message"]


def test_a_dead_side_channel_thread_makes_health_503(decode: tuple) -> None:
    client, llm = decode
    side = llm.connector.side
    side._stop.set()  # its receiver ends as on close, but nobody closed the channel
    side._wake()  # (idle, it blocks until woken)
    side._thread.join(5)
    side._stop.clear()
    assert "side channel receiver" in health_within(client, 503)["error"]["message"]
