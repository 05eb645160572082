"""Router dispatch against fake instances: pull and push legs, errors, disconnects."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time

import httpx
import pytest
from test_router_fake_instance import FakeInstance, running_router, wait_for

# Slow (a router and fake instances served over real sockets (uvicorn threads)): `make test` runs
# it, the unit tier (`make test-fast`) does not.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]

PROMPT = {"model": "fake-model", "prompt": "hello", "max_tokens": 8, "temperature": 0}


def _instances(router: str) -> list[dict]:
    return httpx.get(f"{router}/router/instances").json()


def test_pull_forwards_prefill_params_to_decode() -> None:
    with FakeInstance("prefill") as p, FakeInstance("decode") as d, running_router([p], [d]) as r:
        body = {**PROMPT, "stream": True, "stream_options": {"include_usage": True}}
        resp = httpx.post(f"{r}/v1/completions", json=body, headers={"X-Request-Id": "abc"})
    assert resp.status_code == 200
    assert resp.headers["x-request-id"] == "abc"
    assert 0 < float(resp.headers["x-pdserve-prefill-done"]) <= time.time()
    assert resp.text.count("data: ") == 4 and resp.text.endswith("data: [DONE]\n\n")
    (p_req,), (d_req,) = p.received, d.received
    assert p_req.body["max_tokens"] == 1 and p_req.body["stream"] is False
    assert "stream_options" not in p_req.body
    tid = p_req.params["transfer_id"]
    assert p_req.params == {"do_remote_decode": True, "transfer_mode": "pull", "transfer_id": tid}
    assert p_req.headers["x-request-id"] == d_req.headers["x-request-id"] == "abc"
    # D gets the client's request unchanged, plus everything P returned.
    assert {k: v for k, v in d_req.body.items() if k != "kv_transfer_params"} == body
    assert d_req.params["do_remote_prefill"] is True
    assert d_req.params["transfer_mode"] == "pull"
    assert d_req.params["remote_engine_id"] == p.engine_id
    assert d_req.params["remote_block_ids"] == [3, 4]
    assert "do_remote_decode" not in d_req.params
    assert d_req.arrived > p_req.responded  # pull is sequential


def test_pull_non_streaming_returns_decode_json() -> None:
    with FakeInstance("prefill") as p, FakeInstance("decode") as d, running_router([p], [d]) as r:
        resp = httpx.post(
            f"{r}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5},
        )
        metrics = httpx.get(f"{r}/metrics").text
    assert resp.status_code == 200
    assert resp.json()["choices"][0]["text"] == "x"
    assert p.received[0].path == "/v1/chat/completions"
    assert p.received[0].body["max_completion_tokens"] == 1
    assert d.received[0].body["max_completion_tokens"] == 5
    assert 'pdserve_router_requests_total{mode="pull",status="200"} 1.0' in metrics
    assert "pdserve_router_handoff_seconds_count 1.0" in metrics


def test_pull_without_params_from_prefill_is_502() -> None:
    with (
        FakeInstance("prefill", return_params=False) as p,
        FakeInstance("decode") as d,
        running_router([p], [d]) as r,
    ):
        resp = httpx.post(f"{r}/v1/completions", json=PROMPT)
    assert resp.status_code == 502
    assert "kv_transfer_params" in resp.json()["error"]["message"]
    assert d.received == []


def test_push_sends_both_legs_concurrently() -> None:
    # P answers only once D's leg has arrived (or after 30 s): a router that sent the legs
    # one after the other would make D arrive after P's answer.
    d = FakeInstance("decode")
    p = FakeInstance("prefill", hold=d.arrived, hold_timeout_s=30)
    with d, p, running_router([p], [d], "push") as r:
        resp = httpx.post(f"{r}/v1/completions", json={**PROMPT, "stream": True})
        wait_for(lambda: p.received and p.received[0].responded is not None)
        wait_for(lambda: _instances(r)[0]["outstanding"] == 0)
    assert resp.status_code == 200 and resp.text.endswith("data: [DONE]\n\n")
    (p_req,), (d_req,) = p.received, d.received
    assert d_req.arrived < p_req.responded
    tid = p_req.params["transfer_id"]
    assert len(tid) == 32
    assert p_req.params == {"do_remote_decode": True, "transfer_mode": "push", "transfer_id": tid}
    assert p_req.body["max_tokens"] == 1 and p_req.body["stream"] is False
    assert d_req.params == {
        "do_remote_prefill": True,
        "transfer_mode": "push",
        "transfer_id": tid,
        "remote_engine_id": p.engine_id,
        "remote_incarnation": p.incarnation,
        "remote_host": "127.0.0.1",
        "remote_port": p.side_channel_port,
    }


def test_push_prefill_answering_late_reports_its_done_time_in_the_stream() -> None:
    late = threading.Event()
    body = {**PROMPT, "stream": True}
    with (
        FakeInstance("prefill", hold=late, hold_timeout_s=600) as p,  # until `late` only
        FakeInstance("decode", num_chunks=100_000, chunk_delay_s=0.01) as d,
        running_router([p], [d], mode="push") as r,
        httpx.stream("POST", f"{r}/v1/completions", json=body) as stream,
    ):
        lines = (line for line in stream.iter_lines() if line)
        first = next(lines)  # D's first token reached the client before P answered
        late.set()
        noted = next(line for line in lines if '"pdserve"' in line or "[DONE]" in line)
        header = stream.headers.get("x-pdserve-prefill-done")
    assert header is None
    assert first.startswith("data: {") and '"pdserve"' not in first
    chunk = json.loads(noted[len("data: ") :])
    assert chunk["choices"][0]["text"].startswith("t")  # a normal chunk, annotated
    assert 0 < chunk["pdserve"]["prefill_done"] <= time.time()


def test_push_failing_prefill_returns_502_and_cancels_decode() -> None:
    never = threading.Event()
    d = FakeInstance("decode", hold=never)  # D waits for KV that never comes
    # P fails only once D's leg has arrived: failing at once, P could make the router cancel
    # D's leg before it reached D (both legs leave together), and D would never see it.
    with (
        d,
        FakeInstance("prefill", fail_status=500, hold=d.arrived, hold_timeout_s=30) as p,
        running_router([p], [d], mode="push") as r,
    ):
        resp = httpx.post(f"{r}/v1/completions", json={**PROMPT, "stream": True})
        wait_for(lambda: d.received and d.received[0].disconnected)
        wait_for(lambda: all(i["outstanding"] == 0 for i in _instances(r)))
    assert resp.status_code == 502
    assert resp.headers["content-type"] == "application/json"
    error = resp.json()["error"]
    assert "prefill instance" in error["message"] and "fake failure 500" in error["message"]


def test_push_prefill_failure_after_a_token_less_head_still_cancels_decode() -> None:
    """D opens its stream with a role-only event before it has the KV: that is not its
    first token, so a failing P still gets the client a JSON 502 and D is cancelled."""
    never = threading.Event()
    with (
        FakeInstance("prefill", fail_status=503, hold=never) as p,
        FakeInstance("decode", hold=never, head_event=True) as d,
        running_router([p], [d], mode="push") as r,
    ):
        p.behavior.hold = d.arrived  # P fails only once D has sent its head
        resp = httpx.post(
            f"{r}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "stream": True},
        )
        wait_for(lambda: d.received and d.received[0].disconnected)
    assert resp.status_code == 502
    assert "fake failure 503" in resp.json()["error"]["message"]


def test_head_event_is_forwarded_with_the_first_token() -> None:
    with (
        FakeInstance("prefill") as p,
        FakeInstance("decode", head_event=True) as d,
        running_router([p], [d]) as r,
    ):
        resp = httpx.post(
            f"{r}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "stream": True},
        )
    events = [e for e in resp.text.split("\n\n") if e]
    assert resp.status_code == 200 and len(events) == 5  # head, 3 chunks, [DONE]
    assert '"role":"assistant"' in events[0] and "t0" in events[1]


def test_push_decode_error_is_relayed_and_cancels_prefill() -> None:
    never = threading.Event()
    with (
        FakeInstance("prefill", hold=never) as p,
        # D fails only once P's leg has arrived, so that there is a P leg to cancel.
        FakeInstance("decode", fail_status=400, hold=p.arrived, hold_timeout_s=30) as d,
        running_router([p], [d], mode="push") as r,
    ):
        resp = httpx.post(f"{r}/v1/completions", json={**PROMPT, "stream": True})
        wait_for(lambda: p.received and p.received[0].disconnected)
    assert resp.status_code == 400
    assert resp.json()["error"]["message"] == "fake failure 400"
    assert d.received[0].params["do_remote_prefill"] is True


def test_unreachable_prefill_is_502() -> None:
    with FakeInstance("decode") as d:
        p = FakeInstance("prefill")
        with p, running_router([p], [d], health_interval_s=60.0) as r:
            p.__exit__()  # P dies while the router still counts it as healthy
            resp = httpx.post(f"{r}/v1/completions", json=PROMPT)
    assert resp.status_code == 502
    assert "prefill instance" in resp.json()["error"]["message"]


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_slow_leg_times_out_with_504(mode: str) -> None:
    never = threading.Event()
    with (
        FakeInstance("prefill", hold=never) as p,
        FakeInstance("decode", hold=never) as d,
        running_router([p], [d], mode=mode, request_timeout_s=0.3) as r,
    ):
        resp = httpx.post(f"{r}/v1/completions", json={**PROMPT, "stream": True})
    assert resp.status_code == 504
    assert "timed out" in resp.json()["error"]["message"]


def test_client_disconnect_mid_stream_closes_decode_stream() -> None:
    with (
        FakeInstance("prefill") as p,
        FakeInstance("decode", num_chunks=10_000, chunk_delay_s=0.01) as d,
        running_router([p], [d]) as r,
    ):
        with httpx.stream("POST", f"{r}/v1/completions", json={**PROMPT, "stream": True}) as s:
            first = next(s.iter_lines())
        wait_for(lambda: d.received and d.received[0].disconnected)
        wait_for(lambda: all(i["outstanding"] == 0 for i in _instances(r)))
        metrics = httpx.get(f"{r}/metrics").text
    assert first.startswith("data: ")
    assert d.received[0].responded is None  # the stream never ran to its end
    assert 'status="client_disconnect"' in metrics


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_client_disconnect_during_prefill_cancels_prefill(mode: str) -> None:
    never = threading.Event()
    with (
        FakeInstance("prefill", hold=never) as p,
        FakeInstance("decode", hold=never) as d,
        running_router([p], [d], mode=mode) as r,
    ):
        # The client goes away once the legs it cancels have arrived (a fixed client
        # timeout could expire before the router had sent them, on a loaded machine).
        legs = (p.arrived, d.arrived) if mode == "push" else (p.arrived,)
        _post_then_hang_up(f"{r}/v1/completions", {**PROMPT, "stream": True}, legs)
        wait_for(lambda: p.received and p.received[0].disconnected)
        if mode == "push":
            wait_for(lambda: d.received and d.received[0].disconnected)
        wait_for(lambda: all(i["outstanding"] == 0 for i in _instances(r)))


def _post_then_hang_up(url: str, body: dict, arrived: tuple[threading.Event, ...]) -> None:
    """POST `body` and close the connection once every event of `arrived` is set."""

    async def run() -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            post = asyncio.ensure_future(client.post(url, json=body))
            await asyncio.to_thread(wait_for, lambda: all(e.is_set() for e in arrived))
            assert not post.done(), "the router answered a request that cannot be answered"
            post.cancel()  # closes the connection: the client went away
            with contextlib.suppress(asyncio.CancelledError):
                await post

    asyncio.run(run())


def test_decode_dying_mid_stream_ends_with_sse_error() -> None:
    with (
        FakeInstance("prefill") as p,
        FakeInstance("decode", num_chunks=5, die_after_chunks=2) as d,
        running_router([p], [d]) as r,
    ):
        resp = httpx.post(f"{r}/v1/completions", json={**PROMPT, "stream": True})
    assert resp.status_code == 200
    events = [e for e in resp.text.split("\n\n") if e]
    assert len(events) == 3
    assert '"error"' in events[-1] and "decode instance" in events[-1]


def test_decode_dying_inside_an_event_drops_the_half_event() -> None:
    with (
        FakeInstance("prefill") as p,
        FakeInstance("decode", num_chunks=5, die_after_chunks=2, die_inside_an_event=True) as d,
        running_router([p], [d]) as r,
    ):
        resp = httpx.post(f"{r}/v1/completions", json={**PROMPT, "stream": True})
    assert resp.status_code == 200
    events = [e for e in resp.text.split("\n\n") if e]
    assert len(events) == 3  # two whole token events, then the router's error event
    for event in events:
        assert event.startswith("data: ") and "\n" not in event, event
        json.loads(event.removeprefix("data: "))  # every event is whole JSON
    assert '"error"' in events[-1] and "decode instance" in events[-1]


def test_no_healthy_decode_is_503_and_health_reports_it() -> None:
    with (
        FakeInstance("prefill") as p,
        FakeInstance("decode", healthy=False) as d,
        running_router([p], [d], wait_ready=False) as r,
    ):
        health = httpx.get(f"{r}/health")
        resp = httpx.post(f"{r}/v1/completions", json=PROMPT)
    assert health.status_code == 503
    assert health.json()["decode"] == {"healthy": 0, "total": 1}
    assert resp.status_code == 503
    assert "decode" in resp.json()["error"]["message"]
    assert p.received == []


def test_api_key_is_checked_and_sent_upstream() -> None:
    with (
        FakeInstance("prefill") as p,
        FakeInstance("decode") as d,
        running_router([p], [d], api_key="sekrit") as r,
    ):
        denied = httpx.post(f"{r}/v1/completions", json=PROMPT)
        ok = httpx.post(
            f"{r}/v1/completions", json=PROMPT, headers={"Authorization": "Bearer sekrit"}
        )
    assert denied.status_code == 401 and "error" in denied.json()
    assert ok.status_code == 200
    assert d.received[0].headers["authorization"] == "Bearer sekrit"


def test_models_and_bad_json() -> None:
    with FakeInstance("prefill") as p, FakeInstance("decode") as d, running_router([p], [d]) as r:
        models = httpx.get(f"{r}/v1/models").json()
        bad = httpx.post(
            f"{r}/v1/completions",
            content=b"{not json",
            headers={"Content-Type": "application/json"},
        )
    assert [m["id"] for m in models["data"]] == ["fake-model"]
    assert bad.status_code == 400 and "JSON" in bad.json()["error"]["message"]
