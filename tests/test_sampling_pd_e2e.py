"""The sampling API through the router, monolithic and P/D (pull and push), with real
processes (`pdserve up`): logprobs (P samples the first token; its logprobs travel to D),
penalties, `logit_bias`, `min_tokens`, echo with prompt logprobs and `n` > 1 (greedy and
seeded, streamed and not: one P/D request per choice) answer as one monolithic instance
does (same engine, same weights: logprobs within 1e-4). A client leaving a stream of n
choices leaves no KV block in use (a choice failing: test_router_choices)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import httpx
import pytest
from test_pd_e2e import wait_blocks_free

from pdserve.launcher import Cluster, ClusterConfig
from pdserve.sse import events_data

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

TOL = 1e-4
RNG = random.Random(77)
PROMPT = [RNG.randrange(3, 250) for _ in range(90)]
CHAT = [{"role": "user", "content": "Tell me about the sea and the sky."}]

REQUESTS: list[tuple[str, dict[str, Any]]] = [
    (
        "/v1/completions",
        {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "logprobs": 3},
    ),
    (
        "/v1/completions",
        {
            "prompt": PROMPT,
            "max_tokens": 8,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": 1,
            "presence_penalty": 1.0,
            "frequency_penalty": 0.5,
            "repetition_penalty": 1.5,
            "logit_bias": {"101": 4.0},
            "stream": True,
        },
    ),
    (
        "/v1/chat/completions",
        {"messages": CHAT, "max_tokens": 6, "temperature": 0, "logprobs": True, "top_logprobs": 2},
    ),
    (
        "/v1/completions",  # EOS pushed to the top, held back by min_tokens
        {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "min_tokens": 3},
    ),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 2}),
    (
        "/v1/completions",
        {"prompt": "Once upon", "max_tokens": 8, "temperature": 1.0, "seed": 7, "n": 3},
    ),
    (
        "/v1/completions",
        {
            "prompt": PROMPT,
            "max_tokens": 6,
            "temperature": 0,
            "ignore_eos": True,
            "logprobs": 1,
            "n": 2,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ),
    (
        "/v1/chat/completions",
        {
            "messages": CHAT,
            "max_tokens": 6,
            "temperature": 0.9,
            "seed": 11,
            "n": 3,
            "ignore_eos": True,
        },
    ),
    (
        "/v1/chat/completions",
        {
            "messages": CHAT,
            "max_tokens": 6,
            "temperature": 0.9,
            "seed": 11,
            "n": 2,
            "ignore_eos": True,
            "stream": True,
            "logprobs": True,
            "top_logprobs": 1,
        },
    ),
]


def answers(url: str) -> list[dict[str, Any]]:
    out = []
    with httpx.Client(timeout=300, trust_env=False) as client:
        for path, body in REQUESTS:
            if "min_tokens" in body:
                body = {**body, "logit_bias": {str(i): 100.0 for i in EOS_IDS}}
            r = client.post(f"{url}{path}", json=body)
            assert r.status_code == 200, r.text
            out.append(_collect(r) if body.get("stream") else r.json())
    return out


EOS_IDS = (256, 258)  # the built-in tokenizer's <|endoftext|> and <|im_end|>


def _collect(r: httpx.Response) -> dict[str, Any]:
    """A streamed answer's text and logprobs per choice (by `index`), joined, and its usage;
    one [DONE], at the end."""

    assert r.text.count("[DONE]") == 1 and r.text.endswith("data: [DONE]\n\n"), r.text
    texts: dict[int, str] = {}
    logprobs: dict[int, list] = {}
    usage = None
    for data in events_data(r.content)[:-1]:  # the last is [DONE]
        event = json.loads(data)
        assert "error" not in event, event
        usage = event.get("usage") or usage
        for choice in event["choices"]:
            i = choice["index"]
            delta = choice.get("delta", {})
            texts[i] = texts.get(i, "") + (choice.get("text") or delta.get("content") or "")
            lp = choice.get("logprobs") or {}
            logprobs.setdefault(i, []).extend(
                lp.get("content")
                or list(zip(lp.get("tokens", []), lp.get("token_logprobs", []), strict=True))
            )
    choices = []
    for i in sorted(texts):
        entries = logprobs[i]
        if entries and isinstance(entries[0], dict):  # chat: content entries
            lp = {"content": entries}
        else:
            lp = {"tokens": [t for t, _ in entries], "token_logprobs": [v for _, v in entries]}
        choices.append({"index": i, "text": texts[i], "logprobs": lp})
    return {"choices": choices, "usage": usage}


def values_of(answer: dict[str, Any]) -> list[tuple[str, list]]:
    """(text, logprob values) of each choice, in either API's shape."""
    out = []
    for choice in answer["choices"]:
        text = choice.get("text", choice.get("message", {}).get("content"))
        lp = choice.get("logprobs")
        if lp is None:
            values: list = []
        elif "content" in lp:
            values = [e["logprob"] for e in lp["content"]]
            values += [t["logprob"] for e in lp["content"] for t in e["top_logprobs"]]
        else:
            values = list(lp["token_logprobs"])
        out.append((text, values))
    return out


def assert_same(got: dict[str, Any], want: dict[str, Any], what: str) -> None:
    g, w = values_of(got), values_of(want)
    assert [t for t, _ in g] == [t for t, _ in w], what
    assert [c.get("index") for c in got["choices"]] == [c.get("index") for c in want["choices"]]
    assert got.get("usage") == want.get("usage"), what
    for (_, gv), (_, wv) in zip(g, w, strict=True):
        assert len(gv) == len(wv), what
        for a, b in zip(gv, wv, strict=True):
            assert (a is None and b is None) or abs(a - b) < TOL, what


@pytest.fixture(scope="module")
def monolithic(tmp_path_factory) -> list[dict[str, Any]]:
    with Cluster(ClusterConfig(kv_transfer=None, log_dir=tmp_path_factory.mktemp("m"))) as c:
        out = answers(c.router_url)
        wait_blocks_free(c)
    return out


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_sampling_api_through_pd_equals_monolithic(tmp_path: Path, monolithic, mode) -> None:
    cfg = ClusterConfig(kv_transfer=mode, log_dir=tmp_path, local_prefill_below=0)
    with Cluster(cfg) as cluster:
        got = answers(cluster.router_url)
        wait_blocks_free(cluster)
        a_client_leaving_aborts_every_choice(cluster.router_url)
        wait_blocks_free(cluster)
    for i, ((path, body), g, w) in enumerate(zip(REQUESTS, got, monolithic, strict=True)):
        assert_same(g, w, f"request {i} {path} {sorted(body)} in {mode}")
    first = values_of(monolithic[0])[0][1]
    assert len(first) == 8 and all(v is not None for v in first)  # P's token has its logprob
    min_tokens = monolithic[3]["choices"][0]
    assert (
        min_tokens["finish_reason"] == "stop" and monolithic[3]["usage"]["completion_tokens"] == 4
    )
    echo = monolithic[4]["choices"][0]["logprobs"]["token_logprobs"]
    assert len(echo) == len(PROMPT) and echo[0] is None
    assert len({c["text"] for c in monolithic[5]["choices"]}) > 1
    assert monolithic[7]["usage"]["completion_tokens"] == 3 * 6
    streamed = monolithic[6]
    assert len(streamed["choices"]) == 2 and streamed["usage"]["completion_tokens"] == 12


def a_client_leaving_aborts_every_choice(url: str) -> None:
    """A client leaving a stream of n choices through P/D: every choice's decode stream
    is closed (aborted on D), so the caller finds every block free afterwards."""
    body = {"prompt": PROMPT, "max_tokens": 4000, "ignore_eos": True, "n": 3, "stream": True}
    with (
        httpx.Client(timeout=300, trust_env=False) as client,
        client.stream("POST", f"{url}/v1/completions", json=body) as r,
    ):
        assert r.status_code == 200
        seen: set[int] = set()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                seen |= {c["index"] for c in json.loads(line[6:])["choices"]}
            if seen == {0, 1, 2}:
                break
