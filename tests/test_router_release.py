"""When the router releases P's hold (POST /kv/release), against fake instances: D refused
or failed before its stream, the client left between the legs; and when it must not."""

from __future__ import annotations

import threading

import httpx
import pytest
from test_router_fake_instance import FakeInstance, running_router, wait_for

from pdserve.transfer.release import release_signature

# Slow (a router and fake instances served over real sockets (uvicorn threads)): `make test` runs
# it, the unit tier (`make test-fast`) does not.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]

PROMPT = {"model": "fake-model", "prompt": "hello", "max_tokens": 8, "temperature": 0}
TOKEN = "cluster-secret"


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_refused_decode_leg_releases_p_signed(mode) -> None:
    with (
        FakeInstance("prefill") as p,
        FakeInstance("decode", fail_status=400) as d,
        running_router([p], [d], mode=mode, cluster_token=TOKEN) as r,
    ):
        resp = httpx.post(f"{r}/v1/completions", json=PROMPT)
        wait_for(lambda: p.released)
        metrics = httpx.get(f"{r}/metrics").text
    assert resp.status_code == 400  # D's refusal is relayed as before
    ((tid, signature),) = p.released
    assert tid == p.received[0].params["transfer_id"]
    assert signature == release_signature(TOKEN, tid)
    assert 'pdserve_router_prefill_releases_total{outcome="sent"} 1.0' in metrics


def test_pull_client_gone_between_the_legs_releases_p() -> None:
    never = threading.Event()
    with (
        FakeInstance("prefill") as p,
        FakeInstance("decode", hold=never) as d,
        running_router([p], [d]) as r,
    ):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{r}/v1/completions", json={**PROMPT, "stream": True}, timeout=0.5)
        wait_for(lambda: p.released)
    assert [tid for tid, _ in p.released] == [p.received[0].params["transfer_id"]]
    assert p.released[0][1] is None  # no token: unsigned
    assert len(d.received) == 1


def test_push_client_gone_before_the_first_token_releases_p() -> None:
    never = threading.Event()
    with (
        FakeInstance("prefill") as p,
        FakeInstance("decode", hold=never) as d,
        running_router([p], [d], mode="push") as r,
    ):
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{r}/v1/completions", json={**PROMPT, "stream": True}, timeout=0.5)
        wait_for(lambda: p.released)
    assert [tid for tid, _ in p.released] == [d.received[0].params["transfer_id"]]


def test_no_release_when_decode_streams_or_prefill_itself_failed() -> None:
    never = threading.Event()
    with (
        FakeInstance("prefill") as p,
        FakeInstance("decode") as d,
        running_router([p], [d], mode="push") as r,
    ):
        assert httpx.post(f"{r}/v1/completions", json=PROMPT).status_code == 200
        p.behavior.fail_status = 500  # P fails: it holds nothing
        d.behavior.hold = never
        assert httpx.post(f"{r}/v1/completions", json=PROMPT).status_code == 502
        metrics = httpx.get(f"{r}/metrics").text
    assert p.released == []
    assert "pdserve_router_prefill_releases_total{" not in metrics


def test_a_refused_release_is_counted_not_raised() -> None:
    with (
        FakeInstance("prefill") as p,
        FakeInstance("decode", fail_status=400) as d,
        running_router([p], [d]) as r,
    ):
        p.app.router.routes = [x for x in p.app.router.routes if x.path != "/kv/release"]
        assert httpx.post(f"{r}/v1/completions", json=PROMPT).status_code == 400
        wait_for(
            lambda: (
                'pdserve_router_prefill_releases_total{outcome="refused"} 1.0'
                in httpx.get(f"{r}/metrics").text
            )
        )
    assert len(d.received) == 1
