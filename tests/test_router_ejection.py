"""Legs on an instance that the health monitor ejects end at once with an error naming it
(issue 10), not when the router's request timeout fires; the other leg is aborted.

The router runs with a 300 s request timeout and each fake holds its answer for longer, so
only the ejection can end these requests before the test's own timeout (pytest-timeout).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager

import httpx
import pytest
from test_router_fake_instance import FakeInstance, ScriptedHealth, running_router, wait_for

from pdserve.router.config import RouterConfig
from pdserve.router.health import EJECTED_REASON, HealthMonitor, InstancePool
from pdserve.router.load_model import Demand

# Slow (a router and fake instances served over real sockets (uvicorn threads)): `make test` runs
# it, the unit tier (`make test-fast`) does not.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(30)]

ROUTER_TIMEOUT_S = 300.0  # far beyond the test's timeout: reaching it fails the test
FROZEN_S = 600.0  # how long a "frozen" fake holds its answer
PROMPT = {"model": "fake-model", "prompt": "hello", "max_tokens": 4}


def _frozen(**behavior: object) -> dict[str, object]:
    return {"hold": threading.Event(), "hold_timeout_s": FROZEN_S, **behavior}


@contextmanager
def _unhealthy_once_it_has_a_request(fake: FakeInstance) -> Iterator[None]:
    """Fail `fake`'s health checks from its first completion request on (mid-request)."""

    def flip() -> None:
        if fake.arrived.wait(10):
            fake.behavior.healthy = False

    thread = threading.Thread(target=flip, daemon=True)
    thread.start()
    yield
    thread.join(timeout=10)


def _assert_ejected_error(r: httpx.Response, role: str, fake: FakeInstance) -> None:
    assert r.status_code == 502, r.text
    message = r.json()["error"]["message"]
    assert f"{role} instance {fake.url}" in message and EJECTED_REASON in message, message


def _admitted(router: str, fake: FakeInstance) -> bool:
    rows = httpx.get(f"{router}/router/instances").json()
    return next(row["admitted"] for row in rows if row["url"] == fake.url)


def _router(
    p: FakeInstance, d: FakeInstance, mode: str, grace_s: float = 0.5
) -> AbstractContextManager[str]:
    return running_router(
        [p], [d], mode=mode, request_timeout_s=ROUTER_TIMEOUT_S, ejected_stream_grace_s=grace_s
    )


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_ejected_prefill_ends_the_request_and_aborts_both_legs(mode: str) -> None:
    with (
        FakeInstance("prefill", **_frozen()) as p,
        FakeInstance("decode", **_frozen()) as d,  # in push mode D waits for the KV
        _router(p, d, mode) as r,
        _unhealthy_once_it_has_a_request(p),
    ):
        resp = httpx.post(f"{r}/v1/completions", json=PROMPT, timeout=FROZEN_S)
        _assert_ejected_error(resp, "prefill", p)
        wait_for(lambda: p.received[0].disconnected)  # P's leg was closed
        if mode == "push":
            wait_for(lambda: d.received[0].disconnected)  # and D's abort reached D
        else:
            assert not d.received  # pull: D is only asked once P has answered
        metrics = httpx.get(f"{r}/metrics").text
    assert 'pdserve_router_leg_errors_total{leg="prefill",reason="ejected"} 1.0' in metrics


def test_ejected_decode_before_its_first_token_aborts_the_prefill_leg() -> None:
    with (
        FakeInstance("prefill", **_frozen()) as p,  # still prefilling when D goes away
        FakeInstance("decode", **_frozen()) as d,
        _router(p, d, "push") as r,
        _unhealthy_once_it_has_a_request(d),
    ):
        resp = httpx.post(f"{r}/v1/completions", json={**PROMPT, "stream": True}, timeout=FROZEN_S)
        _assert_ejected_error(resp, "decode", d)
        wait_for(lambda: d.received[0].disconnected)
        wait_for(lambda: p.received[0].disconnected)


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_decode_ejected_mid_stream_ends_the_stream_with_an_error_event(mode: str) -> None:
    with (
        FakeInstance("prefill") as p,
        FakeInstance("decode", stall_after_chunks=1, hold_timeout_s=FROZEN_S) as d,
        _router(p, d, mode) as r,
        httpx.stream(
            "POST", f"{r}/v1/completions", json={**PROMPT, "stream": True}, timeout=FROZEN_S
        ) as resp,
    ):
        assert resp.status_code == 200
        lines = resp.iter_lines()
        first = next(x for x in lines if x.startswith("data: "))
        assert '"t0 "' in first
        d.behavior.healthy = False
        rest = [x for x in lines if x.startswith("data: ")]  # ends only by the ejection
        wait_for(lambda: d.received[0].disconnected)
    assert len(rest) == 1 and '"error"' in rest[0], rest
    assert f"decode instance {d.url} {EJECTED_REASON}" in rest[0]


def test_an_ejected_decode_that_speaks_again_within_the_grace_is_left_to_finish() -> None:
    """Ejected only for slow health answers (a busy D): once it sends again within the
    grace period the router keeps relaying its stream; only new legs avoid D."""
    resume = threading.Event()
    with (
        FakeInstance("prefill") as p,
        FakeInstance("decode", stall_after_chunks=1, resume=resume, hold_timeout_s=FROZEN_S) as d,
        _router(p, d, "pull", grace_s=60.0) as r,
        httpx.stream(
            "POST", f"{r}/v1/completions", json={**PROMPT, "stream": True}, timeout=FROZEN_S
        ) as resp,
    ):
        lines = (x for x in resp.iter_lines() if x.startswith("data: "))
        assert '"t0 "' in next(lines)
        d.behavior.healthy = False
        wait_for(lambda: not _admitted(r, d))
        resume.set()  # D speaks again, ejected
        rest = list(lines)
    assert '"t1 "' in rest[0]
    assert rest[-1] == "data: [DONE]" and not any('"error"' in x for x in rest), rest
    assert len(rest) == 3  # t1, t2 and [DONE]


def test_each_admission_has_its_own_ejection_signal() -> None:
    """A leg opened before an ejection stays ended after the re-admission; a new leg gets
    the new admission's signal."""
    script = iter([200, 503, 503, 200])

    async def run() -> None:
        config = RouterConfig(
            prefill_urls=("http://p",),
            decode_urls=("http://d",),
            kv_transfer="pull",
            health_failures_to_eject=2,
        )
        pool = InstancePool(config)
        (p,) = pool.by_role("prefill")
        monitor = HealthMonitor(pool, ScriptedHealth(script), config)  # type: ignore[arg-type]
        await monitor._check(p)
        acquired = pool.acquire("prefill", Demand(1, 0))
        assert acquired is not None
        old_leg = acquired[1]
        for _ in range(3):
            await monitor._check(p)  # fail, fail (ejected), succeed (re-admitted)
        assert p.admitted and old_leg.ejected.is_set() and not p.ejected.is_set()
        acquired = pool.acquire("prefill", Demand(1, 0))
        assert acquired is not None and not acquired[1].ejected.is_set()

    asyncio.run(run())
