"""Health checks: ejection after failed checks, re-admission, restarts seen via /kv/info."""

from __future__ import annotations

import asyncio
import uuid

import httpx
import pytest
from test_router_fake_instance import FakeInstance, ScriptedHealth, running_router, wait_for

from pdserve.router.config import RouterConfig
from pdserve.router.health import HealthMonitor, InstancePool

pytestmark = pytest.mark.timeout(60)

PROMPT = {"model": "fake-model", "prompt": "hello", "max_tokens": 4}


def _admitted(router: str, fake: FakeInstance) -> bool:
    rows = httpx.get(f"{router}/router/instances").json()
    return next(r["admitted"] for r in rows if r["url"] == fake.url)


def test_failing_instance_is_ejected_and_readmitted() -> None:
    with (
        FakeInstance("prefill") as p1,
        FakeInstance("prefill") as p2,
        FakeInstance("decode") as d,
        running_router([p1, p2], [d]) as r,
    ):
        p1.behavior.healthy = False
        wait_for(lambda: not _admitted(r, p1))
        for _ in range(4):
            assert httpx.post(f"{r}/v1/completions", json=PROMPT).status_code == 200
        assert (len(p1.received), len(p2.received)) == (0, 4)
        assert httpx.get(f"{r}/health").status_code == 200  # p2 and d still serve

        p1.behavior.healthy = True
        wait_for(lambda: _admitted(r, p1))
        for _ in range(2):
            assert httpx.post(f"{r}/v1/completions", json=PROMPT).status_code == 200
        metrics = httpx.get(f"{r}/metrics").text
    assert len(p1.received) == 1 and len(p2.received) == 5
    assert f'pdserve_router_instance_admitted{{role="prefill",url="{p1.url}"}} 1.0' in metrics


def test_ejection_needs_consecutive_failures() -> None:
    """Round by round, with a scripted /health: admitted after one success, kept after one
    failure, ejected after the second in a row, re-admitted after one success."""
    script = iter([200, 503, 200, 503, 503, 503, 200])

    async def rounds() -> list[bool]:
        config = RouterConfig(
            prefill_urls=("http://p",),
            decode_urls=("http://d",),
            kv_transfer="pull",
            health_failures_to_eject=2,
        )
        pool = InstancePool(config)
        (p,) = pool.by_role("prefill")
        seen = []
        monitor = HealthMonitor(pool, ScriptedHealth(script), config)  # type: ignore[arg-type]
        for _ in range(7):
            await monitor._check(p)
            seen.append(p.admitted)
        return seen

    assert asyncio.run(rounds()) == [True, True, True, True, False, False, True]


def test_never_healthy_instance_is_not_admitted() -> None:
    with (
        FakeInstance("prefill", healthy=False) as p,
        FakeInstance("decode") as d,
        running_router([p], [d], wait_ready=False) as r,
    ):
        wait_for(lambda: _admitted(r, d))
        assert not _admitted(r, p)
        # With no prefill instance the decode instances prefill themselves (no P leg).
        resp = httpx.post(f"{r}/v1/completions", json=PROMPT)
    assert resp.status_code == 200
    assert p.received == [] and "kv_transfer_params" not in d.received[0].body


def test_push_router_notices_a_restarted_prefill() -> None:
    with (
        FakeInstance("prefill") as p,
        FakeInstance("decode") as d,
        running_router([p], [d], mode="push") as r,
    ):
        assert httpx.post(f"{r}/v1/completions", json=PROMPT).status_code == 200
        old_engine = d.received[0].params["remote_engine_id"]
        # The same URL now answers as a new incarnation with a new side channel.
        p.incarnation, p.engine_id, p.side_channel_port = uuid.uuid4().hex, "restarted", 1234

        def sees_new_incarnation() -> bool:
            rows = httpx.get(f"{r}/router/instances").json()
            return rows[0]["info"]["incarnation"] == p.incarnation

        wait_for(sees_new_incarnation)
        assert httpx.post(f"{r}/v1/completions", json=PROMPT).status_code == 200
    assert old_engine != "restarted"
    assert d.received[1].params["remote_engine_id"] == "restarted"
    assert d.received[1].params["remote_port"] == 1234
