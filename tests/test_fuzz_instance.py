"""Fuzzing every HTTP API of an instance: the real engine on builtin:tiny, in process.

Hypothesis generates request bodies (field-aware ones, close enough to valid that they reach
the deep paths, and arbitrary JSON or bytes), headers, methods and paths. The property: the
answer is a 2xx or a 4xx with an OpenAI-style error body, never a 5xx, and a streamed answer
never carries a server error. After each run the engine is alive, serves a normal request,
and holds no KV block; after the module its block pool passes the integrity check.

Examples are derandomized (the same inputs on every run) and bounded so the file runs in
well under a minute on one core.
"""

from __future__ import annotations

import json
import string
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.config import CacheConfig, EngineConfig, ModelConfig, ServerConfig
from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.engine import LLMEngine
from pdserve.server.app import create_app
from pdserve.server.body_limit import MAX_BODY_BYTES
from pdserve.server.protocol import MAX_STOP_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS
from pdserve.sse import events_data

# Slow (hundreds of fuzzed requests through a whole instance's HTTP stack): `make test` runs it,
# the unit tier (`make test-fast`) does not.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

# A small cache keeps the worst case (a reply filling the whole context) short.
BLOCK_SIZE = 16
NUM_BLOCKS = 4
CAPACITY = BLOCK_SIZE * NUM_BLOCKS
ERROR_KEYS = {"message", "type", "param", "code"}


def fuzz_settings(n: int) -> settings:
    return settings(
        max_examples=n,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


# -- strategies ---------------------------------------------------------------------------

# Strings that broke servers before: NUL, lone surrogates (JSON allows "\\ud800"; UTF-8 does
# not), emoji, bidi controls, long runs.
edge_text = st.sampled_from(["", "\x00", "\ud800", "a\udfffb", "\U0001f600", "\u202e", " " * 40])
surrogate_text = st.text(
    st.characters(min_codepoint=0xD7F0, max_codepoint=0xE010, exclude_categories=[]), max_size=3
)
short_text = st.one_of(st.text(max_size=24), st.text(max_size=24), edge_text, surrogate_text)
scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats()  # NaN and infinities too: Python's JSON parser accepts them
    | short_text
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(short_text, inner, max_size=4),
    max_leaves=10,
)
small_ints = st.integers(min_value=-3, max_value=6)
token_ids = st.integers(min_value=-2, max_value=300)  # the tiny vocabulary has 259 ids


def field(valid: st.SearchStrategy[Any], invalid: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """Mostly a valid value (so that whole bodies are often valid and reach the engine),
    sometimes an invalid one or any JSON value at all."""
    # sampled_from picks branches about uniformly (one_of favours some).
    return st.sampled_from([valid] * 14 + [invalid, json_values]).flatmap(lambda s: s)


def maybe(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    return field(strategy, strategy)


def kv_params() -> st.SearchStrategy[Any]:
    """Random dicts, and P and D legs that only an instance with a connector can check."""
    fields = {
        "do_remote_decode": st.booleans(),
        "do_remote_prefill": st.booleans(),
        "transfer_mode": st.sampled_from(["pull", "push", "other"]),
        "transfer_id": short_text,
        "remote_engine_id": short_text,
        "remote_host": st.sampled_from(["127.0.0.1", "a b", "", "::1"]),
        "remote_port": st.integers(min_value=-1, max_value=70000),
        "remote_block_ids": st.lists(st.integers(min_value=-2, max_value=10**6), max_size=4),
        "remote_num_tokens": small_ints,
        "first_token_id": token_ids,
        "surprise": json_values,
    }
    anything = st.fixed_dictionaries({}, optional={k: maybe(v) for k, v in fields.items()})
    ids = st.text("0123456789abcdef", min_size=1, max_size=32)
    modes = st.sampled_from(["pull", "push"])
    prefill_leg = st.fixed_dictionaries(
        {"do_remote_decode": st.just(True), "transfer_mode": modes, "transfer_id": ids}
    )
    decode_leg = st.fixed_dictionaries(
        {
            "do_remote_prefill": st.just(True),
            "transfer_mode": modes,
            "transfer_id": ids,
            "remote_engine_id": ids,
            "remote_host": st.just("127.0.0.1"),
            "remote_port": st.integers(min_value=1, max_value=65535),
            "remote_block_ids": st.lists(st.integers(0, 50), max_size=3, unique=True),
            "remote_num_tokens": st.integers(1, 30),
            "first_token_id": token_ids,
        }
    )
    return st.one_of(anything, prefill_leg, decode_leg)


def sampling_fields() -> dict[str, st.SearchStrategy[Any]]:
    any_int = st.integers(min_value=-(2**64), max_value=2**64)
    return {
        "model": field(st.just("builtin:tiny"), short_text),
        "max_tokens": field(st.integers(1, 6), any_int),
        # Subnormal temperatures once overflowed the sampler and failed the whole batch.
        "temperature": field(st.floats(0, 2) | st.sampled_from([5e-324, 1e-300]), st.floats()),
        "top_p": field(st.floats(0.01, 1), st.floats()),
        "top_k": field(st.integers(-1, 300), any_int),
        "seed": field(st.integers(0, 2**63 - 1), any_int),
        "stop": field(short_text | st.lists(short_text, max_size=4), st.lists(short_text)),
        "stop_token_ids": field(st.lists(st.integers(0, 258), max_size=4), st.lists(token_ids)),
        "ignore_eos": maybe(st.booleans()),
        "n": field(st.integers(1, 3), small_ints),
        "stream": maybe(st.booleans()),
        "stream_options": maybe(
            st.fixed_dictionaries({}, optional={"include_usage": maybe(st.booleans())})
        ),
        "presence_penalty": field(st.floats(-2, 2) | st.none(), st.floats()),
        "frequency_penalty": field(st.floats(-2, 2) | st.none(), st.floats()),
        "repetition_penalty": field(st.floats(0.5, 2) | st.none(), st.floats()),
        "min_tokens": field(st.integers(0, 1), any_int),
        "logit_bias": field(
            st.none() | st.dictionaries(st.integers(0, 258).map(str), st.floats(-100, 100)),
            st.dictionaries(short_text, st.floats()),
        ),
        "user": maybe(short_text),
        "kv_transfer_params": field(st.none(), kv_params()),
        "unknown_extension": json_values,
    }


def completion_bodies() -> st.SearchStrategy[Any]:
    prompts = (
        short_text
        | st.lists(st.integers(0, 258), min_size=1, max_size=24)
        | st.lists(st.lists(st.integers(0, 258), min_size=1, max_size=8), min_size=1, max_size=1)
    )
    bad_prompts = (
        st.lists(token_ids, max_size=24)
        | st.lists(short_text, max_size=3)
        | st.lists(st.lists(token_ids, max_size=8), max_size=2)
        | st.just("x" * (CAPACITY + 5))
    )
    fields = {
        **sampling_fields(),
        "logprobs": field(st.none() | st.integers(0, 5), small_ints),
        "echo": maybe(st.booleans()),
        "suffix": field(st.none() | st.just(""), short_text),
        "best_of": field(st.none() | st.just(1), small_ints),
        "return_token_ids": maybe(st.booleans()),
    }
    structured = st.fixed_dictionaries({"prompt": field(prompts, bad_prompts)}, optional=fields)
    return field(structured, json_values)


def chat_bodies() -> st.SearchStrategy[Any]:
    part = st.fixed_dictionaries({"type": maybe(st.just("text")), "text": maybe(short_text)})
    roles = st.sampled_from(["system", "developer", "user", "assistant", "tool"])
    message = st.fixed_dictionaries(
        {
            "role": field(st.just("user"), roles),
            "content": maybe(short_text | st.none() | st.lists(part, max_size=2)),
        },
        optional={"name": maybe(short_text)},
    )
    fields = {
        **sampling_fields(),
        "max_completion_tokens": field(st.integers(1, 6), small_ints),
        "logprobs": maybe(st.booleans()),
        "top_logprobs": field(st.none() | st.integers(0, 5), small_ints),
        "tools": field(st.none(), st.lists(json_values, max_size=1)),
        "tool_choice": field(st.none() | st.just("none"), json_values),
        "response_format": field(
            st.none() | st.just({"type": "text"}), st.fixed_dictionaries({"type": short_text})
        ),
    }
    messages = field(st.lists(message, min_size=1, max_size=3), st.lists(message, max_size=3))
    structured = st.fixed_dictionaries({"messages": messages}, optional=fields)
    return field(structured, json_values)


# -- the instance -------------------------------------------------------------------------


@dataclass
class Instance:
    client: TestClient
    engine: AsyncEngine

    def idle(self, timeout: float = 10.0) -> bool:
        """True once no request runs, waits or holds a KV block."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            s = self.engine.stats()
            if s.kv_blocks_used == 0 and s.num_running == 0 and s.num_waiting == 0:
                return True
            time.sleep(0.01)
        return False

    def assert_healthy(self) -> None:
        """Alive, serving a normal request, and no KV block in use."""
        assert self.client.get("/health").status_code == 200
        r = self.client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 3})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 3
        assert self.idle(), self.engine.stats()


@pytest.fixture(scope="module")
def instance(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Instance]:
    cfg = EngineConfig(
        model=ModelConfig(cache_dir=tmp_path_factory.mktemp("models"), max_model_len=CAPACITY),
        cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS),
        threads=1,  # torch threads fight over shared cores; one is much faster here
    )
    llm = LLMEngine.from_config(cfg)
    engine = AsyncEngine(llm)
    engine.start()
    try:
        with TestClient(create_app(engine, ServerConfig()), raise_server_exceptions=False) as c:
            yield Instance(c, engine)
    finally:
        engine.shutdown()
    llm.check_integrity()
    assert llm.pool.num_used == 0


# -- checks -------------------------------------------------------------------------------


def check_answer(r: Any) -> None:
    """2xx with a well-formed body, or 4xx with an OpenAI-style error; never 5xx."""
    assert r.status_code < 500, f"{r.status_code}: {r.text[:500]}"
    if r.request.method == "HEAD":
        return  # no body to check
    if r.status_code >= 400:
        assert set(r.json()["error"]) == ERROR_KEYS, r.text
        return
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        for event in sse_payloads(r.text):
            err = event.get("error") if isinstance(event, dict) else None
            assert err is None or err.get("type") != "server_error", event
        return
    if r.headers.get("content-type", "").startswith("application/json"):
        assert isinstance(r.json(), dict | list)


def sse_payloads(text: str) -> list[Any]:
    out = [d if d == "[DONE]" else json.loads(d) for d in events_data(text)]
    assert out and out[-1] == "[DONE]", text[-200:]
    return out


def post_json(client: TestClient, path: str, body: Any, **headers: str) -> Any:
    # json.dumps, not httpx's encoder: NaN and Infinity must get through as Python writes them.
    content = json.dumps(body).encode()
    return client.post(
        path, content=content, headers={"Content-Type": "application/json", **headers}
    )


class Fuzzed(Protocol):
    """What is fuzzed: an instance, or a router in front of a P/D pair."""

    def assert_healthy(self) -> None: ...


def fuzz(
    target: Fuzzed, n: int, strategy: st.SearchStrategy[Any], send: Callable[[Any], Any]
) -> Counter[int]:
    """Check every answer; then the target's health. Returns the count by status class."""
    seen: Counter[int] = Counter()

    @fuzz_settings(n)
    @given(strategy)
    def run(value: Any) -> None:
        r = send(value)
        check_answer(r)
        seen[r.status_code // 100] += 1

    run()
    target.assert_healthy()
    return seen


# -- tests --------------------------------------------------------------------------------


def test_completions_never_5xx(instance: Instance) -> None:
    seen = fuzz(
        instance,
        250,
        completion_bodies(),
        lambda b: post_json(instance.client, "/v1/completions", b),
    )
    # Both paths were exercised: bodies the engine ran, and bodies refused.
    assert seen[2] >= 10 and seen[4] >= 10, seen


def test_chat_completions_never_5xx(instance: Instance) -> None:
    seen = fuzz(
        instance,
        200,
        chat_bodies(),
        lambda b: post_json(instance.client, "/v1/chat/completions", b),
    )
    # Both paths were exercised: bodies the engine ran, and bodies refused.
    assert seen[2] >= 10 and seen[4] >= 10, seen


def test_raw_bodies_and_content_types_never_5xx(instance: Instance) -> None:
    bodies = st.binary(max_size=64) | st.text(max_size=64).map(str.encode)
    ctypes = st.sampled_from(
        ["application/json", "text/plain", "", "application/json; charset=latin-1"]
    )

    def send(value: tuple[bytes, str, str]) -> Any:
        body, ctype, path = value
        return instance.client.post(path, content=body, headers={"Content-Type": ctype})

    paths = st.sampled_from(["/v1/completions", "/v1/chat/completions"])
    fuzz(instance, 120, st.tuples(bodies, ctypes, paths), send)


def test_request_id_header_never_5xx(instance: Instance) -> None:
    printable = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=200)

    def send(rid: str) -> Any:
        return post_json(
            instance.client,
            "/v1/completions",
            {"prompt": "a", "max_tokens": 1},
            **{"X-Request-Id": rid},
        )

    fuzz(instance, 60, printable, send)


def test_every_route_and_method_never_5xx(instance: Instance) -> None:
    known = sorted(instance.client.app.openapi()["paths"])  # type: ignore[attr-defined]
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics"} <= set(
        known
    )
    assert {"/kv/info", "/load"} <= set(known)
    odd = st.text(string.ascii_letters + string.digits + "-._~/%:@!$&'()*+,;=", max_size=12)
    paths = st.sampled_from(known) | odd.map(lambda s: "/" + s)
    methods = st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"])

    def send(value: tuple[str, str, Any]) -> Any:
        method, path, body = value
        return instance.client.request(method, path, content=json.dumps(body).encode())

    fuzz(instance, 150, st.tuples(methods, paths, json_values), send)


# -- oversized requests -------------------------------------------------------------------

BIG = 30 * 2**20  # under the 32 MiB body limit: these reach the validation


def refused(instance: Instance, path: str, body: Any) -> dict[str, Any]:
    """POST `body`; the answer must be a 400 (the generous timeout only catches a hang)."""
    with ThreadPoolExecutor(1) as pool:
        r = pool.submit(post_json, instance.client, path, body).result(timeout=60)
    assert r.status_code == 400, r.text[:300]
    return r.json()["error"]


def test_prompt_beyond_capacity_is_refused(instance: Instance) -> None:
    for prompt in ("x" * (CAPACITY + 1), "hello world " * (BIG // 12), list(range(3, 250)) * 4000):
        err = refused(instance, "/v1/completions", {"prompt": prompt})
        assert err["code"] == "context_length_exceeded" and err["param"] == "prompt"
    messages = [{"role": "user", "content": "hi"}] * 100_000
    err = refused(instance, "/v1/chat/completions", {"messages": messages})
    assert err["code"] == "context_length_exceeded"
    instance.assert_healthy()


def test_huge_max_tokens_is_refused(instance: Instance) -> None:
    for n in (CAPACITY, 10**30):
        err = refused(instance, "/v1/completions", {"prompt": "hi", "max_tokens": n})
        assert err["param"] == "max_tokens" and f"at most {CAPACITY - 2}" in err["message"]
    instance.assert_healthy()


def test_stop_lists_are_bounded(instance: Instance) -> None:
    cases = {
        "stop": [["x"] * 5000, ["x"] * (MAX_STOP_STRINGS + 1), "x" * 10**6, ["x" * 1001]],
        "stop_token_ids": [[1] * 10**6, [1] * (MAX_STOP_TOKEN_IDS + 1)],
    }
    for name, values in cases.items():
        for value in values:
            err = refused(instance, "/v1/completions", {"prompt": "hi", name: value})
            assert err["param"] == name
    # At the limits they are accepted.
    body = {"prompt": "hi", "max_tokens": 2, "stop": ["q" * MAX_STOP_CHARS] * MAX_STOP_STRINGS}
    body["stop_token_ids"] = [258] * MAX_STOP_TOKEN_IDS
    assert post_json(instance.client, "/v1/completions", body).status_code == 200
    instance.assert_healthy()


def test_deeply_nested_json_is_refused(instance: Instance) -> None:
    for depth in (1000, 200_000):
        raw = b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}"
        r = instance.client.post(
            "/v1/completions", content=raw, headers={"Content-Type": "application/json"}
        )
        assert r.status_code == 400, r.text[:300]
    instance.assert_healthy()


def test_body_over_the_limit_gets_413(instance: Instance) -> None:
    huge = b'{"prompt": "' + b"x" * (MAX_BODY_BYTES + 1) + b'"}'
    r = instance.client.post(
        "/v1/completions", content=huge, headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 413 and str(MAX_BODY_BYTES) in r.json()["error"]["message"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        yield b'{"prompt": "'
        for _ in range(MAX_BODY_BYTES // 2**20 + 1):
            yield b"x" * 2**20
        yield b'"}'

    r = instance.client.post(
        "/v1/completions", content=chunks(), headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 413, r.text[:300]
    assert set(r.json()["error"]) == ERROR_KEYS
    instance.assert_healthy()


def test_pd_legs_on_a_monolithic_instance_are_a_400(instance: Instance) -> None:
    """No connector, no transfer: once an engine-side error (a 500), now the client's 400."""
    legs = [
        {"do_remote_decode": True, "transfer_mode": "pull", "transfer_id": "t1"},
        {"do_remote_prefill": True, "transfer_mode": "push", "transfer_id": "t2"}
        | {"remote_engine_id": "p", "remote_host": "127.0.0.1", "remote_port": 9},
    ]
    for kv in legs:
        err = refused(instance, "/v1/completions", {"prompt": "hi", "kv_transfer_params": kv})
        assert err["param"] == "kv_transfer_params" and "monolithic" in err["message"]
    instance.assert_healthy()


def test_deeply_nested_json_to_tokenize_is_refused(instance: Instance) -> None:
    for depth in (100, 1000, 200_000):
        raw = b'{"prompt": ' + b"[" * depth + b"]" * depth + b"}"
        r = instance.client.post(
            "/tokenize", content=raw, headers={"Content-Type": "application/json"}
        )
        assert r.status_code == 400, r.text[:300]
        assert "nested deeper" in r.json()["error"]["message"]
    instance.assert_healthy()


def test_the_instance_publishes_no_api_map(instance: Instance) -> None:
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert instance.client.get(path).status_code == 404, path
