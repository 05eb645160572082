"""The sampling API over HTTP on the built-in model: logprobs in OpenAI's shapes (completions
with echo for prompt tokens, as lm-eval's loglikelihood asks; chat), `n` choices (seeded:
reproducible, choice i = seed + i), `/v1/models/{id}`, and OpenAI-style 400s."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient

from pdserve.config import CacheConfig, EngineConfig, ModelConfig, ServerConfig
from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.engine import LLMEngine
from pdserve.server.app import create_app
from pdserve.sse import events_data

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[tuple[TestClient, LLMEngine]]:
    cfg = EngineConfig(
        model=ModelConfig(cache_dir=tmp_path_factory.mktemp("models"), dtype="float32"),
        cache=CacheConfig(block_size=16, num_blocks=128),
        threads=1,
    )
    llm = LLMEngine.from_config(cfg)
    engine = AsyncEngine(llm)
    engine.start()
    try:
        with TestClient(create_app(engine, ServerConfig()), raise_server_exceptions=False) as c:
            yield c, llm
    finally:
        engine.shutdown()
    llm.check_integrity()
    assert llm.pool.num_used == 0


@pytest.fixture(scope="module")
def hf(served):
    _, llm = served
    return transformers.AutoModelForCausalLM.from_pretrained(llm.loaded.path, dtype=torch.float32)


def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def post(client: TestClient, path: str, **body: Any) -> dict[str, Any]:
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def tokens_of(client: TestClient, text: str) -> list[int]:
    return client.post("/tokenize", json={"prompt": text}).json()["tokens"]


def test_echo_logprobs_of_the_prompt_match_transformers(served, hf) -> None:
    """lm-eval's loglikelihood: echo, logprobs, max_tokens=0 -> the prompt's logprobs."""
    client, _ = served
    text = "The quick brown fox jumps over the lazy dog"
    ids = tokens_of(client, text)
    body = post(client, "/v1/completions", prompt=text, echo=True, logprobs=2, max_tokens=0)
    (choice,) = body["choices"]
    assert choice["text"] == text and choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 0
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) == len(lp["token_logprobs"]) == len(lp["text_offset"])
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    expected = hf_logprobs(hf, ids)
    for t in range(1, len(ids)):
        assert abs(lp["token_logprobs"][t] - expected[t - 1, ids[t]].item()) < 1e-4
        top = lp["top_logprobs"][t]
        assert 2 <= len(top) <= 3  # the two most likely, and the token itself
        assert max(top.values()) == pytest.approx(expected[t - 1].max().item(), abs=1e-4)
    assert "".join(lp["tokens"]) == text
    assert lp["text_offset"] == [sum(len(x) for x in lp["tokens"][:i]) for i in range(len(ids))]


def test_echo_with_generation_continues_the_logprobs(served, hf) -> None:
    client, _ = served
    ids = [10, 20, 30, 40, 50]
    body = post(
        client,
        "/v1/completions",
        prompt=ids,
        echo=True,
        logprobs=0,
        max_tokens=4,
        temperature=0,
        ignore_eos=True,
        return_token_ids=True,
    )
    (choice,) = body["choices"]
    out = choice["token_ids"]
    lp = choice["logprobs"]
    assert len(lp["token_logprobs"]) == len(ids) + len(out) == 9
    expected = hf_logprobs(hf, ids + out)
    for t in range(1, 9):
        assert abs(lp["token_logprobs"][t] - expected[t - 1, (ids + out)[t]].item()) < 1e-4
        assert len(lp["top_logprobs"][t]) == 1  # k = 0: the token itself


def test_streamed_completion_logprobs_equal_the_whole_response(served) -> None:
    client, _ = served
    body = {"prompt": "Hello there", "max_tokens": 6, "temperature": 0, "logprobs": 3}
    body["ignore_eos"] = True
    whole = post(client, "/v1/completions", **body)["choices"][0]["logprobs"]
    r = client.post("/v1/completions", json={**body, "stream": True})
    chunks = [json.loads(d) for d in events_data(r.content) if d != "[DONE]"]
    merged: dict[str, list] = {"tokens": [], "token_logprobs": [], "text_offset": []}
    for c in chunks:
        for key in merged:
            merged[key] += (c["choices"][0]["logprobs"] or {}).get(key, [])
    assert merged == {k: whole[k] for k in merged}


def test_chat_logprobs_shape(served, hf) -> None:
    client, _ = served
    messages = [{"role": "user", "content": "Say something"}]
    body = post(
        client,
        "/v1/chat/completions",
        messages=messages,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        ignore_eos=True,
    )
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == body["usage"]["completion_tokens"] == 5
    for entry in content:
        assert set(entry) == {"token", "logprob", "bytes", "top_logprobs"}
        assert entry["bytes"] == list(entry["token"].encode("utf-8"))
        assert len(entry["top_logprobs"]) == 3
        values = [t["logprob"] for t in entry["top_logprobs"]]
        assert values == sorted(values, reverse=True)
        assert entry["logprob"] == pytest.approx(values[0])  # greedy: the top token
    text = "".join(e["token"] for e in content)
    assert text == body["choices"][0]["message"]["content"]
    plain = post(client, "/v1/chat/completions", messages=messages, max_tokens=2)
    assert plain["choices"][0]["logprobs"] is None


def test_n_choices_with_a_seed_are_reproducible(served) -> None:
    client, _ = served
    body = {"prompt": "Once upon", "max_tokens": 8, "temperature": 1.0, "seed": 7, "n": 3}
    body["ignore_eos"] = True
    first = post(client, "/v1/completions", **body)
    again = post(client, "/v1/completions", **body)
    texts = [c["text"] for c in first["choices"]]
    assert [c["index"] for c in first["choices"]] == [0, 1, 2]
    assert texts == [c["text"] for c in again["choices"]]
    assert len(set(texts)) > 1  # different seeds, different samples
    singles = [
        post(client, "/v1/completions", **{**body, "n": 1, "seed": 7 + i})["choices"][0]["text"]
        for i in range(3)
    ]
    assert singles == texts
    assert first["usage"]["completion_tokens"] == 24


def test_n_choices_stream_each_index(served) -> None:
    client, _ = served
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "n": 2}
    body.update(stream=True, seed=1, ignore_eos=True)
    r = client.post("/v1/chat/completions", json=body)
    chunks = [json.loads(d) for d in events_data(r.content) if d != "[DONE]"]
    finished = [c["choices"][0]["index"] for c in chunks if c["choices"][0]["finish_reason"]]
    assert sorted(finished) == [0, 1]
    roles = [c["choices"][0]["index"] for c in chunks if c["choices"][0]["delta"].get("role")]
    assert roles == [0, 1]
    assert r.text.endswith("data: [DONE]\n\n")


def test_model_by_id(served) -> None:
    client, _ = served
    name = client.get("/v1/models").json()["data"][0]["id"]
    card = client.get(f"/v1/models/{name}")
    assert card.status_code == 200 and card.json()["id"] == name
    missing = client.get("/v1/models/no-such-model")
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"


def test_penalties_change_the_served_output(served) -> None:
    client, _ = served
    body = {"prompt": "a a a a", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    plain = post(client, "/v1/completions", **body)["choices"][0]["text"]
    for extra in (
        {"frequency_penalty": 2.0},
        {"repetition_penalty": 3.0},
        {"logit_bias": {str(tokens_of(client, "z")[0]): 100}},
    ):
        assert post(client, "/v1/completions", **body, **extra)["choices"][0]["text"] != plain
    biased = post(client, "/v1/completions", **body, logit_bias={"122": 100})
    assert set(biased["choices"][0]["text"]) == {"z"}  # byte-level: id 122 is "z"


def test_logprob_values_are_finite_json(served) -> None:
    client, _ = served
    body = post(
        client,
        "/v1/completions",
        prompt="x",
        max_tokens=3,
        logprobs=20,
        logit_bias={"5": -100},
        temperature=0,
    )
    # Up to 21 entries: tokens whose text is the same (bytes decoding to U+FFFD) share a key,
    # as in OpenAI's and vLLM's dict.
    for top in body["choices"][0]["logprobs"]["top_logprobs"]:
        assert 1 < len(top) <= 21
        assert all(math.isfinite(v) and v <= 0 for v in top.values())


def test_min_tokens_holds_back_stop_strings(served) -> None:
    client, _ = served
    body = {"prompt": "x", "max_tokens": 8, "temperature": 0, "logit_bias": {"98": 100}}
    body["stop"] = ["b"]  # byte-level: id 98 is "b", which the bias makes every token
    assert post(client, "/v1/completions", **body)["choices"][0]["text"] == ""
    held = post(client, "/v1/completions", **body, min_tokens=3)
    assert held["choices"][0] == {**held["choices"][0], "text": "bbb", "finish_reason": "stop"}
    assert held["usage"]["completion_tokens"] == 4
