"""`n` > 1 through P/D (pdserve.router.choices), against fake instances: one P/D request per
choice with the monolithic instance's seeds and request ids, every choice on choice 0's
prefill instance, the answers merged (index per choice, one [DONE], usage summed); a
choice failing gives a clean error and closes the others' decode streams. That the merged
answer equals one instance's is tested with real processes in test_sampling_pd_e2e."""

from __future__ import annotations

import threading
import time

import httpx
import msgspec
import pytest
from test_router_fake_instance import FakeInstance, running_router

from pdserve.router.choices import (
    StreamMerge,
    choice_body,
    choice_count,
    choices_fit,
    merge_whole,
)
from pdserve.server.protocol import SEED_MAX

# Slow (a router and fake instances served over real sockets (uvicorn threads)): `make test` runs
# it, the unit tier (`make test-fast`) does not.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]

BODY = {"model": "fake-model", "prompt": "hello", "max_tokens": 4, "seed": 5, "n": 3}


def test_choice_bodies_and_counts() -> None:
    assert [choice_body(BODY, i)["seed"] for i in range(3)] == [5, 6, 7]
    assert "n" not in choice_body(BODY, 1)
    assert "seed" not in choice_body({"n": 2}, 1)
    assert [choice_count({"n": v}) for v in (2, 16, 1, 17, "2", True, None)] == [
        2,
        16,
        1,
        1,
        1,
        1,
        1,
    ]


def test_choices_that_one_instance_could_run_but_not_as_requests_are_not_fanned_out() -> None:
    assert choices_fit(BODY, "r", 3) and choices_fit({"seed": SEED_MAX - 2}, "r", 3)
    assert not choices_fit({"seed": SEED_MAX - 1}, "r", 3)  # choice 2's seed: too large
    assert choices_fit({}, "x" * 126, 3) and not choices_fit({}, "x" * 126, 11)  # id length


def test_long_ids_and_large_seeds_go_whole_to_a_decode_instance() -> None:
    with (
        FakeInstance("prefill") as p,
        FakeInstance("decode") as d,
        running_router([p], [d], "pull") as r,
    ):
        for body, rid in (({**BODY, "seed": SEED_MAX}, "a"), (BODY, "y" * 127)):
            resp = httpx.post(f"{r}/v1/completions", json=body, headers={"X-Request-Id": rid})
            assert resp.status_code == 200, resp.text
    assert not p.received and [q.body["n"] for q in d.received] == [3, 3]


def _answer(rid: str, i: int, text: str, completion: int) -> bytes:
    return msgspec.json.encode(
        {
            "id": f"cmpl-{rid}-{i}",
            "choices": [{"index": 0, "text": text, "finish_reason": "length"}],
            "usage": {"prompt_tokens": 9, "completion_tokens": completion, "total_tokens": 0},
        }
    )


def test_whole_answers_merge_as_one_instance_answers() -> None:
    merged = msgspec.json.decode(
        merge_whole([_answer("r", 0, "a", 2), _answer("r", 1, "b", 3)], "r")
    )
    assert merged["id"] == "cmpl-r"
    assert [(c["index"], c["text"]) for c in merged["choices"]] == [(0, "a"), (1, "b")]
    assert merged["usage"] == {"prompt_tokens": 9, "completion_tokens": 5, "total_tokens": 14}


def _event(payload: dict) -> bytes:
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


def test_streams_merge_with_one_done_and_summed_usage() -> None:
    m = StreamMerge(2, "r")
    text = {"choices": [{"index": 0, "text": "x", "finish_reason": None}]}
    usage = {"choices": [], "usage": {"prompt_tokens": 4, "completion_tokens": 2}}
    out = m.feed(1, _event({"id": "cmpl-r-1", **text}) + _event({"id": "cmpl-r-1", **usage}))
    out += m.feed(1, b"data: [DONE]\n\n")
    out += m.feed(0, _event({"id": "cmpl-r-0", **usage}) + b"data: [DONE]\n\n")
    out += m.finish()
    events = [e for e in out.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]" and out.count(b"[DONE]") == 1
    first = msgspec.json.decode(events[0][6:])
    assert first["id"] == "cmpl-r" and first["choices"][0]["index"] == 1
    last = msgspec.json.decode(events[1][6:])
    assert last["usage"] == {"prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8}
    assert len(events) == 3
    failing = StreamMerge(2, "r")
    assert b"boom" in failing.feed(0, _event({"error": {"message": "boom"}}) + _event(text))
    assert failing.failed


def _stream_events(r: httpx.Response) -> list[dict]:
    return [
        msgspec.json.decode(e[6:]) for e in r.content.split(b"\n\n") if e.startswith(b"data: {")
    ]


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("stream", [False, True])
def test_choices_go_through_pd_on_one_prefill_instance(mode: str, stream: bool) -> None:
    with (
        FakeInstance("prefill") as p0,
        FakeInstance("prefill") as p1,
        FakeInstance("decode") as d0,
        FakeInstance("decode") as d1,
        running_router([p0, p1], [d0, d1], mode) as r,
    ):
        resp = httpx.post(
            f"{r}/v1/completions",
            json={**BODY, "stream": stream},
            headers={"X-Request-Id": "abc"},
        )
        assert resp.status_code == 200, resp.text
        assert resp.headers["x-request-id"] == "abc"
        prefill_legs = p0.received + p1.received
        decode_legs = d0.received + d1.received
        assert {len(p0.received), len(p1.received)} == {0, 3}  # all on choice 0's P
    assert prefill_legs[0].headers["x-request-id"] == "abc-0"  # choice 0 first
    for legs in (prefill_legs, decode_legs):
        got = sorted((q.headers["x-request-id"], q.body["seed"], "n" in q.body) for q in legs)
        assert got == [("abc-0", 5, False), ("abc-1", 6, False), ("abc-2", 7, False)]
        assert all(q.params for q in legs)  # every choice disaggregated
    if not stream:
        assert [c["index"] for c in resp.json()["choices"]] == [0, 1, 2]
        return
    events = _stream_events(resp)
    indexes = sorted({c["index"] for e in events for c in e["choices"]})
    assert indexes == [0, 1, 2] and len(events) == 3 * 3  # the fake's 3 chunks per choice
    assert resp.content.count(b"[DONE]") == 1 and resp.content.endswith(b"data: [DONE]\n\n")


@pytest.mark.parametrize("mode", ["pull", "push"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_failing_choice_fails_the_request_and_closes_the_others(mode: str, stream: bool) -> None:
    hold = threading.Event()  # the healthy decode instance never starts its choices
    with (
        FakeInstance("prefill") as p,
        FakeInstance("decode", hold=hold) as good,
        FakeInstance("decode", fail_status=500) as bad,
        running_router([p], [good, bad], mode, policy="round_robin") as r,
    ):
        resp = httpx.post(f"{r}/v1/completions", json={**BODY, "stream": stream})
        assert resp.status_code == 502, resp.text
        assert bad.url in resp.json()["error"]["message"]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not all(q.disconnected for q in good.received):
            time.sleep(0.02)
        assert good.received and all(q.disconnected for q in good.received)
        assert len(p.received) == 3
        # P's holds of the choices whose decode leg never started are released.
        while time.monotonic() < deadline and len(p.released) < 3:
            time.sleep(0.02)
        assert len(p.released) == 3
        hold.set()
        again = httpx.post(f"{r}/v1/completions", json={**BODY, "n": 1})
        assert again.status_code in (200, 502)  # the router still serves
