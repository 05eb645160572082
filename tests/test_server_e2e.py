"""A real `pdserve serve` process on builtin:tiny, driven by the official `openai` client.

One server for the module (model loading takes seconds); every test leaves it idle, which
the last checks rely on (no KV block stays in use).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from freeze import freeze
from procs import PdserveProcess, ProcessFailed, free_port

from pdserve.ports import EXIT_ADDRESS_IN_USE, bind_socket

MAX_MODEL_LEN = 2048  # long enough that a full-length reply takes seconds on a CPU
PROMPT = "The capital of France is"
LONG = MAX_MODEL_LEN - 64  # max_tokens of a request that is still running when we hang up


@pytest.fixture(scope="module")
def server() -> Iterator[PdserveProcess]:
    args = ["serve", "--model", "builtin:tiny", "--max-model-len", str(MAX_MODEL_LEN)]
    args += ["--threads", "1", "--num-kv-blocks", "256", "--log-level", "warning"]
    with PdserveProcess(args) as proc:
        yield proc
        assert proc.stop() == 0, proc.log()  # SIGTERM is a clean shutdown


@pytest.fixture(scope="module")
def client(server: PdserveProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def metrics(server: PdserveProcess) -> dict[str, float]:
    """Unlabelled samples and labelled ones (keyed with their labels) of /metrics."""
    text = httpx.get(f"{server.url}/metrics").text
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def aborts(server: PdserveProcess) -> float:
    """Generations the server finished as aborted (whatever its model_name label)."""
    return sum(
        v
        for k, v in metrics(server).items()
        if k.startswith("pdserve_request_finish_total{") and 'reason="abort"' in k
    )


def wait_for(cond: Any, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return bool(cond())


def test_models(client: openai.OpenAI, model: str) -> None:
    assert model == "builtin:tiny"


def test_completion(client: openai.OpenAI, model: str) -> None:
    resp = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)
    assert resp.id.startswith("cmpl-")
    assert resp.choices[0].finish_reason in ("stop", "length")
    assert isinstance(resp.choices[0].text, str)
    assert resp.usage is not None
    assert 1 <= resp.usage.completion_tokens <= 8
    assert resp.usage.prompt_tokens > 0
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_greedy_is_deterministic_and_stream_matches(client: openai.OpenAI, model: str) -> None:
    kw = {"model": model, "prompt": PROMPT, "max_tokens": 24, "temperature": 0}
    kw["extra_body"] = {"ignore_eos": True}
    first = client.completions.create(**kw)
    second = client.completions.create(**kw)
    assert first.choices[0].text == second.choices[0].text
    assert first.usage is not None and first.usage.completion_tokens == 24
    chunks = list(client.completions.create(**kw, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == first.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_completion_stream_include_usage(client: openai.OpenAI, model: str) -> None:
    stream = client.completions.create(
        model=model,
        prompt=PROMPT,
        max_tokens=6,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    assert all(c.usage is None for c in chunks[:-1])


def test_chat(client: openai.OpenAI, model: str) -> None:
    messages = [{"role": "user", "content": "Say hello."}]
    resp = client.chat.completions.create(
        model=model, messages=messages, max_tokens=10, temperature=0
    )
    assert resp.id.startswith("chatcmpl-")
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].finish_reason in ("stop", "length")
    assert resp.usage is not None and resp.usage.completion_tokens <= 10
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == resp.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == resp.usage.completion_tokens


def test_stop_string(client: openai.OpenAI, model: str) -> None:
    kw = {"model": model, "prompt": PROMPT, "max_tokens": 32, "temperature": 0}
    kw["extra_body"] = {"ignore_eos": True}
    full = client.completions.create(**kw).choices[0].text
    # A stop string taken from the middle of the greedy text: the output ends just before
    # its first occurrence.
    stop = next((full[i : i + 2] for i in range(1, len(full) - 2) if full[i : i + 2].strip()), None)
    if stop is None:
        pytest.skip(f"greedy text too short or blank to pick a stop string: {full!r}")
    resp = client.completions.create(**kw, stop=[stop])
    assert resp.choices[0].text == full[: full.index(stop)]
    assert resp.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"prompt": ""}, 400, "prompt"),
        ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ({"prompt": "x", "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens"),
        ({"prompt": "x" * (MAX_MODEL_LEN + 5)}, 400, "prompt"),
        ({"prompt": "x", "temperature": 9}, 400, "temperature"),
        ({"prompt": "x", "top_p": 0}, 400, "top_p"),
        ({"prompt": [10**7]}, 400, "prompt"),
        ({"prompt": "x", "max_tokens": "3"}, 400, "max_tokens"),
        ({"prompt": "x", "n": 100}, 400, "n"),
        ({"prompt": "x", "logprobs": 30}, 400, "logprobs"),
        ({"prompt": "x", "model": "no-such-model"}, 404, "model"),
    ],
)
def test_bad_input(server: PdserveProcess, body: dict[str, Any], status: int, param: str) -> None:
    resp = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["param"] == param


def test_malformed_json(server: PdserveProcess) -> None:
    resp = httpx.post(
        f"{server.url}/v1/chat/completions",
        content=b'{"messages": [',
        headers={"content-type": "application/json"},
    )
    assert resp.status_code == 400
    assert resp.json()["error"]["type"] == "invalid_request_error"


def test_openai_client_sees_errors(client: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=model, prompt="x", max_tokens=MAX_MODEL_LEN)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-nope", prompt="x")
    resp = client.completions.create(model=model, prompt="x", max_tokens=2)
    assert resp.usage is not None and resp.usage.completion_tokens >= 1


def test_stream_disconnect_aborts_and_frees_blocks(server: PdserveProcess) -> None:
    before = aborts(server)
    body = {"prompt": PROMPT, "max_tokens": LONG, "stream": True}
    body |= {"ignore_eos": True, "temperature": 0}
    with (
        httpx.Client(timeout=30) as http,
        http.stream("POST", f"{server.url}/v1/completions", json=body) as resp,
    ):
        assert resp.status_code == 200
        lines = resp.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        assert metrics(server)["pdserve_kv_blocks_used"] > 0  # the request holds blocks
    # The connection is closed: the server must abort the request and free its blocks.
    assert wait_for(lambda: metrics(server)["pdserve_kv_blocks_used"] == 0)
    assert aborts(server) == before + 1


def test_non_streaming_disconnect_aborts(server: PdserveProcess) -> None:
    before = aborts(server)
    body = json.dumps({"prompt": PROMPT, "max_tokens": LONG, "ignore_eos": True}).encode()
    head = "POST /v1/completions HTTP/1.1\r\nHost: localhost\r\n"
    head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(head.encode() + body)
        assert wait_for(lambda: metrics(server)["pdserve_num_requests_running"] == 1)
    # The client hung up before the answer: the server must abort the request.
    assert wait_for(lambda: aborts(server) == before + 1)
    assert wait_for(lambda: metrics(server)["pdserve_kv_blocks_used"] == 0)


def test_idle_server_holds_no_blocks(server: PdserveProcess) -> None:
    m = metrics(server)
    assert m["pdserve_kv_blocks_used"] == 0
    assert m["pdserve_kv_blocks_total"] == 256
    assert m["pdserve_num_requests_running"] == 0
    assert m["pdserve_num_requests_waiting"] == 0
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}


def test_unknown_model_fails_with_its_log() -> None:
    proc = PdserveProcess(["serve", "--model", "/no/such/model"], startup_timeout_s=60)
    with pytest.raises(ProcessFailed, match="no/such/model"):
        proc.start()
    assert proc.returncode not in (None, 0)


def test_port_in_use_exits_with_its_own_status() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        proc = PdserveProcess(["serve"], port=taken.getsockname()[1], startup_timeout_s=60)
        with pytest.raises(ProcessFailed, match="cannot listen"):
            proc.start()
    assert proc.returncode == EXIT_ADDRESS_IN_USE  # what tells a launcher to try other ports


def test_side_channel_port_in_use_exits_with_the_same_status() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        side = str(taken.getsockname()[1])
        args = ["serve", "--role", "prefill", "--kv-transfer", "push", "--model", "builtin:tiny"]
        cmd = [*args, "--side-channel-port", side]  # a port given: no re-picks on the 98
        proc = PdserveProcess(cmd, port=free_port(), startup_timeout_s=60)
        with pytest.raises(ProcessFailed, match=f"side channel: cannot bind 127.0.0.1:{side}"):
            proc.start()
    assert proc.returncode == EXIT_ADDRESS_IN_USE


def test_beaten_to_its_port_while_loading_it_exits_instead_of_serving(tmp_path) -> None:
    """Another process binds the same port with SO_REUSEADDR while the instance loads, and
    listens first: the instance must exit with the port-taken status, not live on unheard
    while the other process answers its health checks."""
    log = tmp_path / "serve.log"
    other = bind_socket("127.0.0.1", 0)
    port = other.getsockname()[1]
    cmd = [sys.executable, "-m", "pdserve", "serve", "--model", "builtin:tiny"]
    cmd += ["--host", "127.0.0.1", "--port", str(port)]
    with other, open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        try:
            # "loading" is logged once its socket is bound; stopped there, it cannot listen.
            assert wait_for(lambda: "loading" in log.read_text() or proc.poll() is not None)
            freeze(proc.pid)
            other.listen()
            os.kill(proc.pid, signal.SIGCONT)
            assert proc.wait(timeout=120) == EXIT_ADDRESS_IN_USE, log.read_text()
        finally:
            proc.kill()
            proc.wait()
    assert "another process listens there" in log.read_text()
