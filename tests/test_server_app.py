"""In-process tests of the HTTP front end: the real AsyncEngine over a tiny fake LLMEngine.

The fake is scripted (it "generates" a b c ... with the real incremental detokenizer, so
stop strings behave as in the engine), fast, and records aborts and KV blocks, so the
protocol, validation, error and disconnect paths can be checked without loading a model.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from pdserve.config import CacheConfig, ServerConfig
from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.engine.handle import EngineInfo
from pdserve.engine.types import (
    EngineRequest,
    EngineStats,
    FinishReason,
    LiveRequest,
    RequestOutput,
)
from pdserve.server.app import create_app
from pdserve.sse import events_data
from pdserve.transfer.params import InstanceLimits, KVTransferParams
from tests.fake_engines import fake_info

EOS = 256
VOCAB = 257
MAX_MODEL_LEN = 64
BLOCK_SIZE = 4


class CharTokenizer:
    """One token per character (code points < 256), EOS = 256."""

    vocab_size = VOCAB
    eos_token_ids = frozenset({EOS})

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids if i != EOS)

    def apply_chat_template(self, messages: Sequence[dict[str, str]]) -> str:
        if messages[-1]["role"] == "assistant":
            raise ValueError("chat template failed: conversation must end with a user turn")
        turns = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return turns + "<assistant>"


@dataclass
class _Req:
    er: EngineRequest
    detok: IncrementalDetokenizer
    out: list[int] = field(default_factory=list)


class FakeEngine:
    """Scripted LLMEngine: one token per step per request. Prompts starting with "FAIL"
    end in an ERROR, prompts starting with "HANG" never produce a token, prompts starting
    with "NEL" generate U+0085 (a line break for str.splitlines, not for SSE)."""

    def __init__(self, num_blocks: int = 32) -> None:
        self.tokenizer = CharTokenizer()
        self.model_name = "fake-model"
        self.max_model_len = MAX_MODEL_LEN
        self.cfg = SimpleNamespace(cache=CacheConfig(block_size=BLOCK_SIZE))
        self.num_blocks = num_blocks
        self.requests: dict[str, _Req] = {}
        self.aborted: list[str] = []
        self.seen: list[EngineRequest] = []
        self.connector = None  # no P/D transfers in these tests

    def poll_connector(self) -> list[RequestOutput]:
        return []

    def instance_limits(self) -> InstanceLimits:
        return InstanceLimits(role="prefill", mode="pull", block_size=BLOCK_SIZE, vocab_size=VOCAB)

    def info(self) -> EngineInfo:
        return fake_info(self.model_name, self.max_model_len, self.instance_limits())

    def live_requests(self) -> list[LiveRequest]:
        return []

    def close(self) -> None:
        pass

    def add_request(self, er: EngineRequest) -> list[RequestOutput]:
        self.seen.append(er)
        self.requests[er.request_id] = _Req(
            er, IncrementalDetokenizer(self.tokenizer, er.params.stop)
        )
        return []

    def abort_request(self, request_id: str) -> list[RequestOutput]:
        req = self.requests.pop(request_id, None)
        if req is None:
            return []
        self.aborted.append(request_id)
        return [self._output(req, [], FinishReason.ABORT)]

    def has_work(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        time.sleep(0.001)  # pace the engine thread like a (very fast) model would
        return [o for r in list(self.requests.values()) if (o := self._advance(r)) is not None]

    def _advance(self, req: _Req) -> RequestOutput | None:
        prompt = self.tokenizer.decode(req.er.prompt_token_ids)
        if prompt.startswith("HANG"):
            return None
        if prompt.startswith("FAIL"):
            del self.requests[req.er.request_id]
            return self._output(req, [], FinishReason.ERROR, "injected failure")
        token = 0x85 if prompt.startswith("NEL") else ord("a") + len(req.out) % 26
        req.out.append(token)
        reason = None
        if req.detok.append(token):
            reason = FinishReason.STOP
        elif len(req.out) >= req.er.params.max_tokens:
            reason = FinishReason.LENGTH
        if reason is not None:
            del self.requests[req.er.request_id]
        return self._output(req, [token], reason)

    def _output(
        self, req: _Req, new: list[int], reason: FinishReason | None, error: str | None = None
    ) -> RequestOutput:
        kv = req.er.kv_transfer
        return RequestOutput(
            request_id=req.er.request_id,
            new_token_ids=new,
            new_text=req.detok.take(reason is not None),
            finished=reason is not None,
            finish_reason=reason,
            error=error,
            num_prompt_tokens=len(req.er.prompt_token_ids),
            num_output_tokens=len(req.out),
            kv_transfer_params=KVTransferParams(transfer_id="t1") if kv and reason else None,
        )

    def stats(self) -> EngineStats:
        used = sum(
            -(-(len(r.er.prompt_token_ids) + len(r.out)) // BLOCK_SIZE)
            for r in self.requests.values()
        )
        return EngineStats(
            num_running=len(self.requests),
            num_waiting=0,
            kv_blocks_used=used,
            kv_blocks_total=self.num_blocks,
        )


@dataclass
class Server:
    client: TestClient
    fake: FakeEngine
    engine: AsyncEngine


@contextlib.contextmanager
def serve_app(cfg: ServerConfig, num_blocks: int = 32) -> Iterator[Server]:
    """An app over a started AsyncEngine(FakeEngine), with a TestClient."""
    fake = FakeEngine(num_blocks)
    engine = AsyncEngine(fake)  # type: ignore[arg-type]
    engine.start()
    try:
        with TestClient(create_app(engine, cfg), raise_server_exceptions=False) as client:
            yield Server(client, fake, engine)
    finally:
        engine.shutdown()


@pytest.fixture
def server() -> Iterator[Server]:
    with serve_app(ServerConfig()) as srv:
        yield srv


@pytest.fixture
def client(server: Server) -> TestClient:
    return server.client


def complete(client: TestClient, **body: Any) -> Any:
    return client.post("/v1/completions", json={"prompt": "hi", **body})


def sse_events(text: str) -> list[Any]:
    """The `data:` payloads of an SSE body, JSON-decoded, with [DONE] as the string."""
    return [d if d == "[DONE]" else json.loads(d) for d in events_data(text)]


def assert_error(resp: Any, status: int, param: str | None = None) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    if param is not None:
        assert err["param"] == param
    return err


# -- happy paths ---------------------------------------------------------------------------


def test_completion(client: TestClient) -> None:
    resp = complete(client, max_tokens=5, temperature=0)
    assert resp.status_code == 200
    body = resp.json()
    assert body["object"] == "text_completion"
    assert body["id"].startswith("cmpl-")
    assert body["model"] == "fake-model"
    assert body["choices"][0]["text"] == "abcde"
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 5, "total_tokens": 7}


def test_completion_default_max_tokens_is_16(client: TestClient) -> None:
    body = complete(client).json()
    assert body["usage"]["completion_tokens"] == 16


def test_completion_default_max_tokens_clamped_to_context(client: TestClient) -> None:
    prompt = "x" * (MAX_MODEL_LEN - 3)
    body = complete(client, prompt=prompt).json()
    assert body["usage"]["completion_tokens"] == 3


def test_completion_token_id_prompt_and_list_of_one(client: TestClient) -> None:
    for prompt in ([104, 105], [[104, 105]], ["hi"]):
        body = complete(client, prompt=prompt, max_tokens=2).json()
        assert body["usage"]["prompt_tokens"] == 2, prompt
        assert body["choices"][0]["text"] == "ab"


def test_stop_string_excluded(client: TestClient) -> None:
    body = complete(client, max_tokens=10, stop=["cd", "zz"]).json()
    assert body["choices"][0]["text"] == "ab"
    assert body["choices"][0]["finish_reason"] == "stop"
    body = complete(client, max_tokens=10, stop="e").json()
    assert body["choices"][0]["text"] == "abcd"


def test_sampling_params_reach_the_engine(server: Server) -> None:
    complete(
        server.client,
        max_tokens=3,
        temperature=0.5,
        top_p=0.9,
        top_k=7,
        seed=11,
        stop="q",
        stop_token_ids=[5],
        ignore_eos=True,
    )
    p = server.fake.seen[-1].params
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed) == (3, 0.5, 0.9, 7, 11)
    assert (p.stop, p.stop_token_ids, p.ignore_eos) == (("q",), (5,), True)
    complete(server.client, top_k=-1)
    assert server.fake.seen[-1].params.top_k == 0


def test_chat_completion(server: Server) -> None:
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    resp = server.client.post("/v1/chat/completions", json={"messages": messages})
    assert resp.status_code == 200
    body = resp.json()
    assert body["object"] == "chat.completion"
    assert body["id"].startswith("chatcmpl-")
    assert body["choices"][0]["message"]["role"] == "assistant"
    prompt = "<system>s<user>u<assistant>"
    assert server.fake.seen[-1].prompt_token_ids == [ord(c) for c in prompt]
    # No max_tokens in chat: the whole remaining context.
    assert body["usage"]["completion_tokens"] == MAX_MODEL_LEN - len(prompt)
    assert body["choices"][0]["finish_reason"] == "length"


def test_chat_content_parts_and_max_completion_tokens(server: Server) -> None:
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    ]
    body = server.client.post(
        "/v1/chat/completions", json={"messages": messages, "max_completion_tokens": 2}
    ).json()
    assert body["choices"][0]["message"]["content"] == "ab"
    assert server.fake.seen[-1].prompt_token_ids == [ord(c) for c in "<user>ab<assistant>"]


def test_completion_stream_with_usage(client: TestClient) -> None:
    body = {"max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}
    resp = complete(client, **body)
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/event-stream")
    events = sse_events(resp.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == "abcd"
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-2])
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6}
    assert len({c["id"] for c in chunks}) == 1


def test_stream_escapes_unicode_line_separators(client: TestClient) -> None:
    # Written raw, U+0085 made clients that split lines like str.splitlines (httpx's
    # aiter_lines) cut the data line in two.
    resp = complete(client, prompt="NEL", max_tokens=2, stream=True)
    assert "\x85" not in resp.text and "\\u0085" in resp.text
    chunks = sse_events(resp.text)[:-1]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "\x85\x85"


def test_chat_stream(client: TestClient) -> None:
    body = {"messages": [{"role": "user", "content": "u"}], "max_tokens": 3, "stream": True}
    events = sse_events(client.post("/v1/chat/completions", json=body).text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == "abc"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all(c["usage"] is None for c in chunks)  # no include_usage: no usage chunk


def test_request_id_header_honoured(server: Server) -> None:
    resp = complete(server.client, max_tokens=1)
    assert resp.headers["x-request-id"] in resp.json()["id"]
    resp = server.client.post(
        "/v1/completions", json={"prompt": "hi", "max_tokens": 1}, headers={"X-Request-Id": "abc-1"}
    )
    assert resp.json()["id"] == "cmpl-abc-1"
    assert resp.headers["x-request-id"] == "abc-1"
    assert server.fake.seen[-1].request_id == "cmpl-abc-1"


def test_models_health_and_served_name() -> None:
    with serve_app(ServerConfig(served_model_name="alias")) as srv:
        models = srv.client.get("/v1/models").json()
        assert [m["id"] for m in models["data"]] == ["alias"]
        assert models["data"][0]["max_model_len"] == MAX_MODEL_LEN
        assert srv.client.get("/health").json() == {"status": "ok"}
        assert complete(srv.client, model="alias", max_tokens=1).status_code == 200
        assert_error(complete(srv.client, model="fake-model"), 404, "model")


def test_kv_transfer_params_round_trip(server: Server) -> None:
    params = {"do_remote_decode": True, "transfer_mode": "pull"}
    body = complete(server.client, max_tokens=1, kv_transfer_params=params).json()
    assert server.fake.seen[-1].kv_transfer == KVTransferParams(
        do_remote_decode=True, transfer_mode="pull"
    )
    assert body["kv_transfer_params"] == {"transfer_id": "t1"}
    assert complete(server.client, max_tokens=1).json()["kv_transfer_params"] is None
    bad = complete(server.client, kv_transfer_params={"do_remote_decode": True})
    assert_error(bad, 400, "kv_transfer_params")
    bad = complete(server.client, kv_transfer_params={"no_such_field": 1})
    assert_error(bad, 400, "kv_transfer_params")


# -- bad input -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "hi", "max_tokens": "5"}, "max_tokens"),
        ({"prompt": "hi", "max_tokens": 1.5}, "max_tokens"),
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "hi", "max_tokens": MAX_MODEL_LEN - 1}, "max_tokens"),
        ({"prompt": "hi", "temperature": -0.1}, "temperature"),
        ({"prompt": "hi", "temperature": 2.5}, "temperature"),
        ({"prompt": "hi", "temperature": "hot"}, "temperature"),
        ({"prompt": "hi", "top_p": 0}, "top_p"),
        ({"prompt": "hi", "top_p": 1.5}, "top_p"),
        ({"prompt": "hi", "top_k": -2}, "top_k"),
        ({"prompt": "hi", "seed": -1}, "seed"),
        ({"prompt": "hi", "stream": "yes"}, "stream"),
        ({"prompt": "hi", "stop": 5}, "stop"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [[]]}, "prompt"),
        ({"prompt": 42}, "prompt"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": [VOCAB]}, "prompt"),
        ({"prompt": [-1]}, "prompt"),
        ({"prompt": "x" * MAX_MODEL_LEN}, "prompt"),
        ({"prompt": "hi", "stop_token_ids": [VOCAB]}, "stop_token_ids"),
        ({"prompt": "hi", "n": 0}, "n"),
        ({"prompt": "hi", "n": 17}, "n"),
        ({"prompt": "hi", "logprobs": -1}, "logprobs"),
        ({"prompt": "hi", "logprobs": 21}, "logprobs"),
        ({"prompt": "hi", "logprobs": True}, "logprobs"),
        ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "hi", "best_of": 2}, "best_of"),
        ({"prompt": "hi", "presence_penalty": 2.5}, "presence_penalty"),
        ({"prompt": "hi", "frequency_penalty": -3}, "frequency_penalty"),
        ({"prompt": "hi", "repetition_penalty": 0}, "repetition_penalty"),
        ({"prompt": "hi", "logit_bias": {"1": 101}}, "logit_bias"),
        ({"prompt": "hi", "logit_bias": {"abc": 1}}, "logit_bias"),
        ({"prompt": "hi", "logit_bias": {str(VOCAB): 1}}, "logit_bias"),
        ({"prompt": "hi", "logit_bias": {"-1": 1}}, "logit_bias"),
        ({"prompt": "hi", "min_tokens": -1}, "min_tokens"),
        ({"prompt": "hi", "min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
        ({}, "prompt"),
    ],
)
def test_completion_rejects(client: TestClient, body: dict[str, Any], param: str) -> None:
    err = assert_error(client.post("/v1/completions", json=body), 400, param)
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
        ({"messages": [{"role": "user", "content": 1}]}, "messages"),
        ({"messages": [{"role": "assistant", "content": "x"}]}, "messages"),
        ({"messages": [{"role": "user", "content": "x" * MAX_MODEL_LEN}]}, "prompt"),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 10_000}, "max_tokens"),
        ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
        (
            {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
            "top_logprobs",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "logprobs": 1}, "logprobs"),
        ({"messages": [{"role": "user", "content": "x"}], "n": 99}, "n"),
        (
            {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
            "tools",
        ),
    ],
)
def test_chat_rejects(client: TestClient, body: dict[str, Any], param: str) -> None:
    assert_error(client.post("/v1/chat/completions", json=body), 400, param)


def test_malformed_json_and_wrong_body(client: TestClient) -> None:
    headers = {"content-type": "application/json"}
    resp = client.post("/v1/completions", content=b'{"prompt": "hi",', headers=headers)
    assert "JSON" in assert_error(resp, 400)["message"]
    assert_error(client.post("/v1/completions", content=b"[1, 2]", headers=headers), 400)
    assert_error(client.post("/v1/completions", content=b"", headers=headers), 400)


def test_unknown_model_route_and_method(client: TestClient) -> None:
    err = assert_error(complete(client, model="gpt-4"), 404, "model")
    assert err["code"] == "model_not_found"
    assert_error(client.get("/v1/nope"), 404)
    assert_error(client.get("/v1/completions"), 405)


def test_bad_request_id_header(client: TestClient) -> None:
    resp = client.post("/v1/completions", json={"prompt": "hi"}, headers={"X-Request-Id": "a b"})
    assert_error(resp, 400, "X-Request-Id")


def test_kv_capacity_limits_requests() -> None:
    # 8 blocks of 4 tokens: 32 tokens per request although the model allows 64.
    with serve_app(ServerConfig(), num_blocks=8) as srv:
        err = assert_error(complete(srv.client, prompt="x" * 20, max_tokens=20), 400, "max_tokens")
        assert "KV cache" in err["message"]
        ok = complete(srv.client, prompt="x" * 20, max_tokens=12)
        assert ok.status_code == 200
        chat = {"messages": [{"role": "user", "content": "u"}]}
        usage = srv.client.post("/v1/chat/completions", json=chat).json()["usage"]
        assert usage["total_tokens"] == 32


def test_serves_after_bad_requests(client: TestClient) -> None:
    for body in ({"prompt": ""}, {"prompt": "hi", "max_tokens": -1}, {"prompt": [10**9]}):
        assert client.post("/v1/completions", json=body).status_code == 400
    resp = complete(client, max_tokens=2)
    assert resp.status_code == 200
    assert resp.json()["choices"][0]["text"] == "ab"


# -- server-side failures ------------------------------------------------------------------


def test_engine_error_non_streaming_is_5xx(client: TestClient) -> None:
    err = assert_error(complete(client, prompt="FAIL"), 500)
    assert err["type"] == "server_error"
    assert "injected failure" in err["message"]
    assert complete(client, max_tokens=1).status_code == 200


def test_engine_error_streaming_is_an_error_event(client: TestClient) -> None:
    resp = complete(client, prompt="FAIL", stream=True)
    assert resp.status_code == 200
    events = sse_events(resp.text)
    assert events[-1] == "[DONE]"
    assert "injected failure" in events[-2]["error"]["message"]


def test_dead_engine_health_503(server: Server) -> None:
    server.engine.shutdown()
    assert_error(server.client.get("/health"), 503)
    assert_error(complete(server.client), 503)
    assert_error(complete(server.client, stream=True), 503)  # refused before streaming


def test_internal_bug_is_json_500(server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*_: Any) -> None:
        raise RuntimeError("bug")

    monkeypatch.setattr(server.client.app.state.serving, "sampling_params", boom)
    err = assert_error(complete(server.client), 500)
    assert err["type"] == "server_error"


# -- auth ----------------------------------------------------------------------------------


def test_api_key() -> None:
    with serve_app(ServerConfig(api_key="sekret")) as srv:
        err = assert_error(srv.client.get("/v1/models"), 401)
        assert err["code"] == "invalid_api_key"
        bad = {"Authorization": "Bearer nope"}
        assert_error(complete(srv.client, max_tokens=1), 401)
        assert_error(srv.client.post("/v1/completions", json={"prompt": "x"}, headers=bad), 401)
        good = {"Authorization": "Bearer sekret"}
        assert srv.client.get("/v1/models", headers=good).status_code == 200
        resp = srv.client.post("/v1/completions", json={"prompt": "x"}, headers=good)
        assert resp.status_code == 200
        assert srv.client.get("/health").status_code == 200  # probes need no key


# -- metrics -------------------------------------------------------------------------------


def metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def test_metrics(client: TestClient) -> None:
    complete(client, max_tokens=3)
    complete(client, max_tokens=2, stream=True)
    complete(client, max_tokens=0)
    text = client.get("/metrics").text
    series = 'pdserve_requests_total{endpoint="/v1/completions",model_name="fake-model",status='
    ok, bad = series + '"200"}', series + '"400"}'
    assert metric(text, ok) == 2
    assert metric(text, bad) == 1
    assert metric(text, "pdserve_prompt_tokens_total") == 4
    assert metric(text, "pdserve_generation_tokens_total") == 5
    assert metric(text, "pdserve_time_to_first_token_seconds_count") == 2
    assert metric(text, "pdserve_time_per_output_token_seconds_count") == 2
    # One inter-token latency per token after the first (the fake engine yields one a step).
    assert metric(text, "pdserve_inter_token_latency_seconds_count") == (3 - 1) + (2 - 1)
    assert 'pdserve_generation_tokens_total{model_name="fake-model"} 5.0' in text
    assert metric(text, "pdserve:num_requests_running") == 0
    assert metric(text, "pdserve:kv_cache_usage_perc") == 0
    assert metric(text, "pdserve_kv_blocks_total") == 32
    assert metric(text, "pdserve_kv_blocks_used") == 0
    assert metric(text, "pdserve_num_requests_running") == 0
    assert metric(text, "pdserve_num_requests_waiting") == 0


def test_metrics_registries_are_per_app() -> None:
    with serve_app(ServerConfig()) as a:
        complete(a.client, max_tokens=1)
        with serve_app(ServerConfig()) as b:
            assert metric(b.client.get("/metrics").text, "pdserve_prompt_tokens_total") == 0
        assert metric(a.client.get("/metrics").text, "pdserve_prompt_tokens_total") == 2


# -- client disconnects (raw ASGI, so the disconnect can be scripted) ------------------------


async def _call_then_disconnect(
    app: Any, body: dict[str, Any], ready: Callable[[], bool]
) -> list[Any]:
    """POST `body`; the client disconnects as soon as `ready()`. Returns what was sent."""
    sent: list[Any] = []
    delivered = False

    async def receive() -> dict[str, Any]:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}
        while not ready():
            await asyncio.sleep(0.005)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    await asyncio.wait_for(app(scope, receive, send), timeout=30)
    return sent


def _wait_until(cond: Any, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


@pytest.mark.parametrize("stream", [False, True])
def test_disconnect_aborts_request(stream: bool) -> None:
    fake = FakeEngine()
    engine = AsyncEngine(fake)  # type: ignore[arg-type]
    engine.start()
    try:
        app = create_app(engine, ServerConfig())
        body = {"prompt": "HANG", "max_tokens": 5, "stream": stream}
        # The client goes away once the engine holds its request.
        sent = asyncio.run(_call_then_disconnect(app, body, ready=lambda: bool(fake.requests)))
        assert _wait_until(lambda: len(fake.aborted) == 1)
        assert fake.requests == {}
        assert fake.stats().kv_blocks_used == 0
        status = next(m["status"] for m in sent if m["type"] == "http.response.start")
        assert status == (200 if stream else 499)
    finally:
        engine.shutdown()


def test_request_id_in_use_is_409_and_cancel_aborts() -> None:
    fake = FakeEngine()
    engine = AsyncEngine(fake)  # type: ignore[arg-type]
    engine.start()
    app = create_app(engine, ServerConfig())
    headers = {"X-Request-Id": "dup"}
    body = {"prompt": "HANG", "max_tokens": 3}

    async def scenario() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            first = asyncio.ensure_future(http.post("/v1/completions", json=body, headers=headers))
            while not fake.requests:
                await asyncio.sleep(0.005)
            second = await http.post("/v1/completions", json=body, headers=headers)
            first.cancel()  # the caller gives up: the handler is cancelled
            await asyncio.gather(first, return_exceptions=True)
            return second

    try:
        resp = asyncio.run(asyncio.wait_for(scenario(), timeout=30))
        assert_error(resp, 409, "X-Request-Id")
        assert _wait_until(lambda: fake.aborted == ["cmpl-dup"])
        assert fake.stats().kv_blocks_used == 0
    finally:
        engine.shutdown()
