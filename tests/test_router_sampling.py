"""The router and the sampling API, against fake instances: P's leg keeps the client's
sampling fields (P samples the first token as asked; `min_tokens` cut to its one token);
prompt logprobs and `max_tokens` 0 go whole to a decode instance (`n` > 1: test_router_choices)."""

from __future__ import annotations

import httpx
import pytest
from test_router_fake_instance import FakeInstance, running_router

from pdserve.router.dispatch import prefill_body
from pdserve.router.local_only import local_only_reason

pytestmark = pytest.mark.timeout(60)

SAMPLING = {
    "model": "fake-model",
    "prompt": "hello",
    "max_tokens": 8,
    "temperature": 0.7,
    "seed": 3,
    "logprobs": 2,
    "presence_penalty": 0.5,
    "frequency_penalty": 0.2,
    "repetition_penalty": 1.3,
    "logit_bias": {"5": -3.0},
    "stop_token_ids": [9],
}


def test_prefill_leg_keeps_the_sampling_fields() -> None:
    body = prefill_body({**SAMPLING, "min_tokens": 5, "stream": True}, {"x": 1})
    assert {k: body[k] for k in SAMPLING if k != "max_tokens"} == {
        k: v for k, v in SAMPLING.items() if k != "max_tokens"
    }
    assert body["max_tokens"] == 1 and body["min_tokens"] == 1 and body["stream"] is False
    assert prefill_body({**SAMPLING, "min_tokens": 0}, {})["min_tokens"] == 0


@pytest.mark.parametrize(
    ("path", "body", "local"),
    [
        ("/v1/completions", {"n": 2}, False),  # one P/D request per choice
        ("/v1/chat/completions", {"n": 3}, False),
        ("/v1/completions", {"n": 1}, False),
        ("/v1/completions", {"echo": True, "logprobs": 0}, True),
        ("/v1/completions", {"echo": True, "max_tokens": 0}, True),
        ("/v1/completions", {"echo": True}, False),
        ("/v1/completions", {"logprobs": 5}, False),
        ("/v1/chat/completions", {"echo": True, "logprobs": True}, False),
        ("/v1/completions", {"n": "2"}, False),  # the instance answers the 400
    ],
)
def test_local_only_requests(path: str, body: dict, local: bool) -> None:
    assert (local_only_reason(body, path) is not None) == local


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_prompt_logprobs_skip_the_prefill_instance(mode: str) -> None:
    with (
        FakeInstance("prefill") as p,
        FakeInstance("decode") as d,
        running_router([p], [d], mode) as r,
    ):
        for extra in ({"echo": True, "logprobs": 1}, {"echo": True, "max_tokens": 0}):
            resp = httpx.post(f"{r}/v1/completions", json={**SAMPLING, **extra})
            assert resp.status_code == 200, resp.text
        plain = httpx.post(f"{r}/v1/completions", json=SAMPLING)
        assert plain.status_code == 200
        metrics = httpx.get(f"{r}/metrics").text
    assert len(p.received) == 1  # only the plain request was disaggregated
    assert [q.params for q in d.received[:2]] == [{}, {}]
    assert 'pdserve_router_requests_total{mode="local",status="200"} 2.0' in metrics
