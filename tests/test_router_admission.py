"""The router checks what it fronts (/kv/info against its place), counts restarts and
ejections, and prefills on decode instances when no prefill instance is left."""

from __future__ import annotations

import logging
import uuid

import httpx
import pytest
from test_router_fake_instance import FakeInstance, running_router, wait_for

# Slow (a router and fake instances served over real sockets (uvicorn threads)): `make test` runs
# it, the unit tier (`make test-fast`) does not.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]

PROMPT = {"model": "fake-model", "prompt": "hello", "max_tokens": 4}


def _rows(router: str) -> dict[str, dict]:
    return {r["url"]: r for r in httpx.get(f"{router}/router/instances").json()}


def test_wrong_transfer_mode_is_refused_with_a_clear_503(caplog) -> None:
    """A pull router in front of push instances admits neither: /health says why, and a
    request gets a 503 naming the mismatch, never a 4xx the client would take for its own."""
    caplog.set_level(logging.WARNING, logger="pdserve.router.health")
    with (
        FakeInstance("prefill", mode="push") as p,
        FakeInstance("decode", mode="push") as d,
        running_router([p], [d], mode="pull", wait_ready=False) as r,
    ):
        wait_for(lambda: len(httpx.get(f"{r}/health").json().get("refused", [])) == 2)
        health = httpx.get(f"{r}/health")
        resp = httpx.post(f"{r}/v1/completions", json=PROMPT)
        rows = _rows(r)
    assert health.status_code == 503
    refused = {x["url"]: x for x in health.json()["refused"]}
    assert refused[p.url]["mismatch"] == "transfer_mode" and refused[p.url]["role"] == "prefill"
    assert "push" in refused[d.url]["detail"] and "pull" in refused[d.url]["detail"]
    assert resp.status_code == 503
    message = resp.json()["error"]["message"]
    assert d.url in message and "transfer mode is push" in message
    assert p.received == [] and d.received == []
    assert not rows[p.url]["admitted"] and rows[p.url]["refused"]
    logged = [rec.getMessage() for rec in caplog.records if "refused" in rec.getMessage()]
    assert any(p.url in line and "--kv-transfer is pull" in line for line in logged), logged
    assert len([line for line in logged if d.url in line]) == 1  # once, not every round


@pytest.mark.parametrize(
    ("field", "value", "mismatch"),
    [("model", "another-model", "model"), ("transport", "nixl", "transport")],
)
def test_instance_with_another_model_or_transport_is_refused(field, value, mismatch) -> None:
    with (
        FakeInstance("prefill") as p,
        FakeInstance("decode") as d1,
        FakeInstance("decode") as d2,
    ):
        setattr(d2, field, value)
        with running_router([p], [d1, d2]) as r:
            wait_for(lambda: httpx.get(f"{r}/health").json().get("refused"))
            health = httpx.get(f"{r}/health").json()
            for _ in range(3):
                assert httpx.post(f"{r}/v1/completions", json=PROMPT).status_code == 200
            metrics = httpx.get(f"{r}/metrics").text
            # Fixed and still healthy: admitted at the next round, no router restart.
            setattr(d2, field, getattr(d1, field))
            wait_for(lambda: _rows(r)[d2.url]["admitted"])
    assert health["refused"] == [
        {
            "url": d2.url,
            "role": "decode",
            "mismatch": mismatch,
            "detail": health["refused"][0]["detail"],
        }
    ]
    assert value in health["refused"][0]["detail"]
    assert d2.received == [] and len(d1.received) == 3
    assert f'pdserve_router_instance_refused{{role="decode",url="{d2.url}"}} 1.0' in metrics


def test_instance_in_the_wrong_role_is_refused() -> None:
    with (
        FakeInstance("decode") as p,  # given to the router as a prefill instance
        FakeInstance("decode") as d,
        running_router([p], [d], wait_ready=False) as r,
    ):
        wait_for(lambda: httpx.get(f"{r}/health").json().get("refused"))
        (refused,) = httpx.get(f"{r}/health").json()["refused"]
    assert refused["url"] == p.url and refused["mismatch"] == "role"
    assert "configured as prefill" in refused["detail"]


def test_no_prefill_left_prefills_on_decode_instances(caplog) -> None:
    caplog.set_level(logging.INFO, logger="pdserve.router.dispatch")
    with (
        FakeInstance("prefill") as p,
        FakeInstance("decode") as d,
        running_router([p], [d]) as r,
    ):
        p.behavior.healthy = False
        wait_for(lambda: not _rows(r)[p.url]["admitted"])
        health = httpx.get(f"{r}/health")
        for _ in range(2):
            assert httpx.post(f"{r}/v1/completions", json=PROMPT).status_code == 200
        p.behavior.healthy = True
        wait_for(lambda: _rows(r)[p.url]["admitted"])
        assert httpx.post(f"{r}/v1/completions", json=PROMPT).status_code == 200
        metrics = httpx.get(f"{r}/metrics").text
        back = httpx.get(f"{r}/health").json()
    assert health.status_code == 200
    assert health.json()["degraded"] == "no prefill instance: prefilling on decode instances"
    assert "degraded" not in back
    assert [("kv_transfer_params" in x.body) for x in d.received] == [False, False, True]
    assert len(p.received) == 1  # only the request after P came back
    assert 'pdserve_router_requests_total{mode="local_fallback",status="200"} 2.0' in metrics
    assert 'pdserve_router_requests_total{mode="pull",status="200"} 1.0' in metrics
    transitions = [
        rec.getMessage()
        for rec in caplog.records
        if "prefilling on decode" in rec.getMessage() or "disaggregating again" in rec.getMessage()
    ]
    assert len(transitions) == 2, transitions  # once per change, not once per request


def test_restarts_and_ejections_are_counted() -> None:
    with (
        FakeInstance("prefill") as p,
        FakeInstance("decode") as d,
        running_router([p], [d]) as r,
    ):
        # D restarts: ejected, back with a new incarnation.
        d.behavior.healthy = False
        wait_for(lambda: not _rows(r)[d.url]["admitted"])
        d.incarnation = uuid.uuid4().hex
        d.behavior.healthy = True
        wait_for(lambda: _rows(r)[d.url]["admitted"])
        # P is frozen for a while: ejected, back with the same incarnation (not a restart).
        p.behavior.healthy = False
        wait_for(lambda: not _rows(r)[p.url]["admitted"])
        p.behavior.healthy = True
        wait_for(lambda: _rows(r)[p.url]["admitted"])
        metrics = httpx.get(f"{r}/metrics").text
    for inst, role, restarts in ((d, "decode", 1.0), (p, "prefill", 0.0)):
        labels = f'{{role="{role}",url="{inst.url}"}}'
        assert f"pdserve_router_instance_ejections_total{labels} 1.0" in metrics
        assert f"pdserve_router_instance_restarts_total{labels} {restarts}" in metrics
