"""Fuzzing the router's HTTP API in front of a real P/D pair, in process.

The prefill and decode instances are real engines on builtin:tiny with real connectors over
tcp, each behind its own app served by uvicorn on 127.0.0.1 (threads of this process); the
router's app talks to them over HTTP as in production. The bodies and headers are the ones
that fuzz an instance (tests/test_fuzz_instance.py), sent through the router: the answer is
a 2xx or a 4xx, never a 5xx (a 5xx would mean the router or an instance failed, since both
instances stay healthy). Afterwards a normal request through the router gives the
monolithic engine's tokens, and both instances' block pools drain to zero.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient
from hypothesis import strategies as st
from test_fuzz_instance import (
    CAPACITY,
    NUM_BLOCKS,
    chat_bodies,
    completion_bodies,
    fuzz,
    json_values,
    post_json,
)
from test_router_fake_instance import ThreadServer

from pdserve.config import ModelConfig, ServerConfig
from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.engine import LLMEngine
from pdserve.model.loader import LoadedModel, load_model
from pdserve.router.app import create_app as create_router
from pdserve.router.config import RouterConfig
from pdserve.server.app import create_app
from tests.pd_harness import make_engine

# Slow (fuzzed requests through a router and a P/D pair on real sockets): `make test` runs it, the
# unit tier (`make test-fast`) does not.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

NORMAL = {"prompt": [5, 6, 7, 8], "max_tokens": 4, "temperature": 0, "ignore_eos": True}


@dataclass
class Cluster:
    router: TestClient
    engines: list[LLMEngine]
    reference: list[int]

    def drained(self, timeout: float = 15.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(e.pool.num_used == 0 for e in self.engines):
                return True
            time.sleep(0.02)
        return False

    def assert_healthy(self) -> None:
        assert self.router.get("/health").status_code == 200
        r = self.router.post("/v1/completions", json={**NORMAL, "return_token_ids": True})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == self.reference
        assert self.drained(), [e.stats() for e in self.engines]


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    torch.set_num_threads(1)  # threads fight over shared cores; one is much faster here
    return load_model(ModelConfig(cache_dir=tmp_path_factory.mktemp("models")))


def serve_instance(llm: LLMEngine, cleanup: list[Callable[[], None]]) -> str:
    engine = AsyncEngine(llm)
    engine.start()
    cleanup.append(engine.shutdown)
    server = ThreadServer(create_app(engine, ServerConfig())).start()
    cleanup.append(server.stop)
    return server.url


def reference_tokens(loaded: LoadedModel) -> list[int]:
    mono = make_engine(loaded, "both", "pull", num_blocks=NUM_BLOCKS)
    cleanup: list[Callable[[], None]] = []
    url = serve_instance(mono, cleanup)
    try:
        import httpx

        r = httpx.post(f"{url}/v1/completions", json={**NORMAL, "return_token_ids": True})
        return r.json()["choices"][0]["token_ids"]
    finally:
        for close in reversed(cleanup):
            close()


@pytest.fixture(scope="module", params=["pull", "push"])
def cluster(request: pytest.FixtureRequest, loaded: LoadedModel) -> Iterator[Cluster]:
    mode = request.param
    # P's lease is short: a body P accepts and D refuses leaves a hold nobody claims.
    p = make_engine(loaded, "prefill", mode, num_blocks=NUM_BLOCKS, lease_s=1.0)
    d = make_engine(loaded, "decode", mode, num_blocks=NUM_BLOCKS, recv_timeout_s=5.0)
    cleanup: list[Callable[[], None]] = []
    try:
        cfg = RouterConfig(
            prefill_urls=(serve_instance(p, cleanup),),
            decode_urls=(serve_instance(d, cleanup),),
            kv_transfer=mode,
            health_interval_s=0.05,
            load_interval_s=0.05,
            request_timeout_s=30.0,
        )
        with TestClient(create_router(cfg), raise_server_exceptions=False) as router:
            deadline = time.monotonic() + 10
            while router.get("/health").status_code != 200:
                assert time.monotonic() < deadline, "the router never saw both instances"
                time.sleep(0.05)
            yield Cluster(router, [p, d], reference_tokens(loaded))
    finally:
        for close in reversed(cleanup):
            close()
    for e in (p, d):
        e.check_integrity()


def test_router_completions_never_5xx(cluster: Cluster) -> None:
    seen = fuzz(
        cluster, 80, completion_bodies(), lambda b: post_json(cluster.router, "/v1/completions", b)
    )
    assert seen[2] >= 5 and seen[4] >= 5, seen


def test_router_chat_completions_never_5xx(cluster: Cluster) -> None:
    path = "/v1/chat/completions"
    seen = fuzz(cluster, 60, chat_bodies(), lambda b: post_json(cluster.router, path, b))
    assert seen[2] >= 5 and seen[4] >= 5, seen


def test_router_raw_bodies_and_headers_never_5xx(cluster: Cluster) -> None:
    latin1 = st.text(st.characters(min_codepoint=0x20, max_codepoint=0xFF), max_size=40)
    bodies = st.binary(max_size=40) | json_values.map(lambda v: repr(v).encode())

    def send(value: tuple[bytes, str, str]) -> Any:
        body, rid, path = value
        headers = {"Content-Type": "application/json", "X-Request-Id": rid.encode("latin-1")}
        return cluster.router.post(path, content=body, headers=headers)

    paths = st.sampled_from(["/v1/completions", "/v1/chat/completions"])
    fuzz(cluster, 60, st.tuples(bodies, latin1, paths), send)

    def valid_body(rid: str) -> Any:
        headers = {"Content-Type": "application/json", "X-Request-Id": rid.encode("latin-1")}
        return cluster.router.post("/v1/completions", json=NORMAL, headers=headers)

    fuzz(cluster, 40, latin1, valid_body)


def test_router_routes_and_methods_never_5xx(cluster: Cluster) -> None:
    known = sorted(cluster.router.app.openapi()["paths"])  # type: ignore[attr-defined]
    methods = st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"])

    def send(value: tuple[str, str]) -> Any:
        method, path = value
        return cluster.router.request(method, path)

    fuzz(cluster, 60, st.tuples(methods, st.sampled_from(known)), send)


def test_capacity_matches_the_instance_fuzz() -> None:
    """The bodies assume the instances' small capacity (one constant for both files)."""
    assert CAPACITY == 16 * NUM_BLOCKS
