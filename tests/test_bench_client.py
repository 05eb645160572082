"""The benchmark client against a small fake OpenAI-compatible streaming server.

The fake server (FastAPI + uvicorn in a thread, 127.0.0.1, a free port) emits one token per
chunk after known delays. Its behaviour per request is chosen by the prompt text, so a trace
can mix good and failing requests: "http500", "break" (stream cut mid-way), "no-done"
(stream ends cleanly without [DONE]), "error-event", "hang" (sleeps past the client's
timeout), "handoff-chunk" (prefill-done time inside the final chunk), "separators" (token
texts hold U+2028, U+2029 and U+0085, written raw as pydantic writes them). Timing checks are
one-sided where physics allows (the server cannot answer earlier than it sleeps) and
generous the other way.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from pdserve.bench.arrivals import ArrivalConfig
from pdserve.bench.client import (
    PREFILL_DONE_HEADER,
    EndpointError,
    RunClock,
    StreamError,
    StreamTimer,
)
from pdserve.bench.dataset import BenchRequest, RandomDatasetConfig
from pdserve.bench.metrics import BenchResult, load_result
from pdserve.bench.serve import BenchConfig, run_benchmark
from pdserve.cli import main as cli_main

MODEL = "fake-model"
# Line breaks for str.splitlines (and so httpx's aiter_lines) but not for SSE; JSON encoders
# write them raw inside strings.
UNICODE_SEPARATORS = "\u2028\u2029\x85"
TTFT_S = 0.15
ITL_S = 0.02
SLACK_S = 3.0  # generous upper slack for a loaded 2-core machine


@dataclass(frozen=True)
class FakeServer:
    ttft_s: float = TTFT_S
    itl_s: float = ITL_S
    always_500: bool = False


def _chunk(text: str | None, finish: str | None = None, **extra: object) -> str:
    body: dict = {"id": "cmpl-1", "object": "text_completion", "model": MODEL, **extra}
    body["choices"] = [] if text is None else [{"index": 0, "text": text, "finish_reason": finish}]
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"  # raw non-ASCII, like pydantic


async def _tokens(cfg: FakeServer, behaviour: str, n: int, received: float) -> AsyncIterator[str]:
    await asyncio.sleep(cfg.ttft_s if behaviour != "hang" else 30.0)
    for i in range(n):
        if i:
            await asyncio.sleep(cfg.itl_s)
        if behaviour == "break" and i == 2:
            raise RuntimeError("fake server cuts the stream")
        if behaviour == "error-event" and i == 1:
            yield f"data: {json.dumps({'error': {'message': 'engine died', 'code': 500}})}\n\n"
            return
        extra = {"pdserve": {"prefill_done": received}} if behaviour == "handoff-chunk" else {}
        text = f"t{i}{UNICODE_SEPARATORS} " if behaviour == "separators" else f"t{i} "
        yield _chunk(text, "length" if i == n - 1 else None, **(extra if i == n - 1 else {}))
    yield _chunk(None, usage={"prompt_tokens": 7, "completion_tokens": n, "total_tokens": n + 7})
    if behaviour != "no-done":
        yield "data: [DONE]\n\n"


def make_app(cfg: FakeServer) -> FastAPI:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": MODEL, "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        received = time.time()
        body = await request.json()
        behaviour = body["prompt"] if isinstance(body["prompt"], str) else "ok"
        if cfg.always_500 or behaviour == "http500":
            return JSONResponse({"error": {"message": "fake failure"}}, status_code=500)
        assert body["stream"] and body["stream_options"] == {"include_usage": True}
        headers = {PREFILL_DONE_HEADER: f"{received + cfg.ttft_s / 2:.6f}"}
        stream = _tokens(cfg, behaviour, body["max_tokens"], received)
        return StreamingResponse(stream, media_type="text/event-stream", headers=headers)

    return app


@contextmanager
def serve(cfg: FakeServer) -> Iterator[str]:
    """Run the fake server on 127.0.0.1 in a thread; yields its base URL; stops it after."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        make_app(cfg), log_level="critical", lifespan="off", timeout_graceful_shutdown=1
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "fake server did not start"
            time.sleep(0.02)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    with serve(FakeServer()) as url:
        yield url


def _trace(tmp_path: Path, prompts: list[str], output_len: int = 5) -> Path:
    path = tmp_path / "trace.jsonl"
    lines = [json.dumps({"prompt": p, "output_len": output_len}) for p in prompts]
    path.write_text("\n".join(lines) + "\n")
    return path


def _run(cfg: BenchConfig) -> BenchResult:
    return asyncio.run(run_benchmark(cfg))


def test_random_run_counts_and_timing(base_url: str) -> None:
    cfg = BenchConfig(
        base_url=base_url,
        random=RandomDatasetConfig(input_len=12, output_len=6),
        num_prompts=8,
        arrivals=ArrivalConfig(request_rate=50.0),
        num_warmups=1,
        disable_tqdm=True,
    )
    r = _run(cfg)
    assert r.model_id == MODEL  # from GET /v1/models
    assert (r.completed, r.failed, r.num_prompts) == (8, 0, 8)
    assert r.output_lens == [6] * 8 and r.total_output_tokens == 48
    assert r.total_input_tokens == 8 * 7  # the server's usage.prompt_tokens wins
    # Floors only where physics gives one: a token is never read before the server sent it.
    # A gap between two reads has none (a client that stalls reads two chunks at once, and a
    # late first read shortens what follows), so gaps get a floor only summed from the send.
    last = TTFT_S + 5 * ITL_S  # the server sends the last token no earlier than this
    for ttft, itl, e2el in zip(r.ttfts, r.itls, r.latencies, strict=True):
        assert TTFT_S <= ttft < TTFT_S + SLACK_S
        assert len(itl) == 5
        assert ttft + sum(itl) >= last and e2el >= last
    assert r.median_itl_ms / 1000 < ITL_S + SLACK_S
    assert r.mean_tpot_ms is not None and r.mean_ttft_ms is not None
    assert (r.mean_ttft_ms + 5 * r.mean_tpot_ms) / 1000 >= last * 0.999  # means of the above
    assert r.median_handoff_ms is not None and 0 < r.median_handoff_ms < (TTFT_S + SLACK_S) * 1000
    assert r.generated_texts[0] == "t0 t1 t2 t3 t4 t5 "
    assert r.errors == [None] * 8
    assert all(s >= a for s, a in zip(r.start_times, r.arrival_times, strict=True))
    if Path("/proc/stat").exists():  # the host's CPU shares over the run (bench.hostcpu)
        assert r.host_cpu_busy is not None and r.host_cpu_steal is not None
        assert 0.0 <= r.host_cpu_steal <= 1.0 and -0.01 <= r.host_cpu_busy <= 1.0


def test_failures_are_counted_not_raised(base_url: str, tmp_path: Path) -> None:
    prompts = ["ok", "http500", "break", "no-done", "error-event", "hang", "handoff-chunk", "ok"]
    cfg = BenchConfig(
        base_url=base_url,
        trace_path=_trace(tmp_path, prompts),
        request_timeout_s=1.5,
        num_warmups=0,
        disable_tqdm=True,
    )
    r = _run(cfg)
    assert (r.completed, r.failed) == (3, 5)
    errors = dict(zip(prompts, r.errors, strict=True))
    assert errors["ok"] is None and errors["handoff-chunk"] is None
    assert errors["http500"].startswith("HTTP 500") and "fake failure" in errors["http500"]
    assert errors["break"] is not None
    assert errors["no-done"] == "stream ended before [DONE]"
    assert errors["error-event"] == "error event: engine died"
    assert errors["hang"] == "timed out after 1.5 s"
    assert r.output_lens[prompts.index("break")] == 0
    assert r.dataset_name == "trace" and r.input_len is None


def test_handoff_from_final_chunk(base_url: str, tmp_path: Path) -> None:
    cfg = BenchConfig(
        base_url=base_url,
        trace_path=_trace(tmp_path, ["handoff-chunk"] * 2),
        num_warmups=0,
        disable_tqdm=True,
    )
    r = _run(cfg)
    # the chunk's prefill-done is the request's arrival, so handoff >= the server's TTFT sleep
    for handoff in r.handoffs:
        assert handoff is not None and TTFT_S * 0.99 <= handoff < TTFT_S + SLACK_S


def test_unicode_line_separators_do_not_split_events(base_url: str, tmp_path: Path) -> None:
    # Regression: httpx's aiter_lines cut these data lines in two ("DecodeError: Input data
    # was truncated" for about one request in 100-200 of a random-weights model's output).
    cfg = BenchConfig(
        base_url=base_url,
        trace_path=_trace(tmp_path, ["separators"] * 2, output_len=3),
        num_warmups=0,
        disable_tqdm=True,
    )
    r = _run(cfg)
    assert r.errors == [None, None] and (r.completed, r.failed) == (2, 0)
    assert r.output_lens == [3, 3]
    assert r.generated_texts == ["".join(f"t{i}{UNICODE_SEPARATORS} " for i in range(3))] * 2


def test_trace_replays_its_own_schedule(base_url: str, tmp_path: Path) -> None:
    path = tmp_path / "timed.jsonl"
    offsets = [0.0, 0.1, 0.3]
    lines = [json.dumps({"prompt": "ok", "output_len": 2, "arrival_offset_s": t}) for t in offsets]
    path.write_text("\n".join(lines) + "\n")
    cfg = BenchConfig(base_url=base_url, trace_path=path, num_warmups=0, disable_tqdm=True)
    r = _run(cfg)
    assert r.completed == 3
    assert (r.request_rate, r.burstiness) == (pytest.approx(2 / 0.3), None)
    for released, planned in zip(r.arrival_times, offsets, strict=True):
        assert released >= planned - 1e-3  # never released before its recorded time


def test_max_concurrency_bounds_requests_in_flight(base_url: str) -> None:
    cfg = BenchConfig(
        base_url=base_url,
        random=RandomDatasetConfig(input_len=4, output_len=3),
        num_prompts=6,
        max_concurrency=2,
        num_warmups=0,
        disable_tqdm=True,
    )
    r = _run(cfg)
    assert r.completed == 6
    assert r.max_concurrent_requests <= 2
    assert max(r.queue_times) > 0  # with rate inf, later requests waited for a slot


def test_unreachable_endpoint_raises() -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now
    cfg = BenchConfig(base_url=f"http://127.0.0.1:{port}", num_prompts=1, disable_tqdm=True)
    with pytest.raises(EndpointError, match="model list"):
        _run(cfg)


def test_all_warmups_failing_aborts_the_run() -> None:
    with serve(FakeServer(always_500=True)) as url:
        cfg = BenchConfig(base_url=url, num_prompts=2, num_warmups=2, disable_tqdm=True)
        with pytest.raises(EndpointError, match="all 2 warm-up requests failed"):
            _run(cfg)


def test_cli_saves_result(base_url: str, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "res" / "run.json"
    argv = ["bench", "serve", "--base-url", base_url, "--num-prompts", "3", "--input-len", "8",
            "--output-len", "4", "--request-rate", "20", "--burstiness", "2", "--seed", "3",
            "--goodput", "ttft:60000", "tpot:60000", "--metadata", "mode=push",
            "--save-result", str(out), "--disable-tqdm"]  # fmt: skip
    assert cli_main(argv) == 0
    assert "Serving Benchmark Result" in capsys.readouterr().out
    r = load_result(out)
    assert (r.completed, r.request_rate, r.burstiness, r.seed) == (3, 20.0, 2.0, 3)
    assert r.request_goodput == pytest.approx(r.request_throughput)  # every request is good
    assert r.metadata == {"mode": "push"} and r.goodput_config == {"ttft": 60000, "tpot": 60000}


def test_cli_reports_bad_trace(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a", "output_len": 1}\n{"prompt": 3}\n')
    assert cli_main(["bench", "serve", "--trace", str(path), "--disable-tqdm"]) == 1
    assert "bad.jsonl:2:" in capsys.readouterr().err


# --- the stream parser alone -------------------------------------------------------------


def _feed(timer: StreamTimer, chunks: list[tuple[float, str]]) -> None:
    for now, text in chunks:
        timer.feed(text.encode(), now)


def test_stream_timer_exact_timings() -> None:
    clock = RunClock(perf0=0.0, unix0=1000.0)
    timer = StreamTimer(sent_at=1.0)
    pd = json.dumps({"choices": [], "pdserve": {"prefill_done": 1001.1}})
    first = _chunk("a")
    _feed(
        timer,
        [
            (1.1, ": ping\n\n"),
            (1.15, first[:20]),  # a token's time is when its event is complete
            (1.2, first[20:]),
            (1.25, _chunk("", "length")),  # a token with no text yet counts
            (1.3, f"data: {pd}\n\n"),  # no choices: not a token
            (1.3, _chunk(None, usage={"prompt_tokens": 7, "completion_tokens": 2})),
            (1.31, "data: [DONE]\n\n"),
        ],
    )
    rec = timer.record(BenchRequest(prompt="x", prompt_len=None, output_len=2), 0.9, clock)
    assert rec.success and rec.error is None
    assert rec.ttft == pytest.approx(0.2)
    assert rec.itl == pytest.approx([0.05])
    assert rec.latency == pytest.approx(0.25)
    assert (rec.output_len, rec.prompt_len, rec.generated_text) == (2, 7, "a")
    assert rec.handoff == pytest.approx(0.1)  # 1000 + 1.2 - 1001.1
    assert (rec.arrival_time, rec.start_time) == (0.9, 1.0)


def test_stream_timer_counts_chunks_without_usage() -> None:
    timer = StreamTimer(sent_at=0.0)
    _feed(timer, [(0.1, _chunk("a")), (0.2, _chunk("")), (0.3, "data: [DONE]\n\n")])
    rec = timer.record(BenchRequest(prompt=[1, 2], prompt_len=2, output_len=2), 0.0, RunClock(0, 0))
    assert (rec.output_len, rec.prompt_len, rec.generated_text) == (2, 2, "a")


def test_stream_timer_drops_an_event_cut_before_its_end() -> None:
    timer = StreamTimer(sent_at=0.0)
    _feed(timer, [(0.1, _chunk("a")), (0.2, "data: [DONE]")])  # no blank line: cut
    timer.end(0.3)
    with pytest.raises(StreamError, match="before \\[DONE\\]"):
        timer.record(BenchRequest(prompt="x", prompt_len=1, output_len=1), 0.0, RunClock(0, 0))


def test_stream_timer_errors() -> None:
    req = BenchRequest(prompt="x", prompt_len=1, output_len=1)
    with pytest.raises(StreamError, match="without any token"):
        StreamTimer(0.0).record(req, 0.0, RunClock(0, 0))
    with pytest.raises(StreamError, match="engine died"):
        StreamTimer(0.0).feed_data('{"error": "engine died"}', 0.1)
    with pytest.raises(StreamError, match=r"malformed data line .*'\{broken'"):
        StreamTimer(0.0).feed(b"data: {broken\n\n", 0.1)
    cut = _chunk("x" * 300).strip()[:-20]  # a long line cut short: both ends are quoted
    with pytest.raises(StreamError, match=r"truncated.*\.\.\..*\(\d+ chars\)") as info:
        StreamTimer(0.0).feed(f"{cut}\n\n".encode(), 0.1)
    assert "\n" not in str(info.value) and cut[-30:] in str(info.value)


def _chat_chunk(delta: dict | None, finish: str | None = None, **extra: object) -> str:
    body: dict = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": MODEL, **extra}
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    body["choices"] = [] if delta is None else [choice]
    return f"data: {json.dumps(body)}\n\n"


def test_stream_timer_chat_deltas() -> None:
    """The role announcement is not a token; content deltas and empty deltas (a token that
    ends mid-character) are."""
    timer = StreamTimer(sent_at=1.0)
    _feed(
        timer,
        [
            (1.01, _chat_chunk({"role": "assistant", "content": ""})),  # before any token
            (1.2, _chat_chunk({"content": "Hel"})),
            (1.25, _chat_chunk({})),
            (1.3, _chat_chunk({"content": "lo"}, "length")),
            (1.3, _chat_chunk(None, usage={"prompt_tokens": 9, "completion_tokens": 3})),
            (1.31, "data: [DONE]\n\n"),
        ],
    )
    rec = timer.record(BenchRequest(prompt="x", prompt_len=None, output_len=3), 1.0, RunClock(0, 0))
    assert rec.ttft == pytest.approx(0.2)
    assert rec.itl == pytest.approx([0.05, 0.05])
    assert (rec.output_len, rec.prompt_len, rec.generated_text) == (3, 9, "Hello")


def test_stream_timer_chat_role_with_content_is_a_token() -> None:
    timer = StreamTimer(sent_at=0.0)
    _feed(
        timer,
        [(0.1, _chat_chunk({"role": "assistant", "content": "Hi"})), (0.2, "data: [DONE]\n\n")],
    )
    rec = timer.record(BenchRequest(prompt="x", prompt_len=1, output_len=1), 0.0, RunClock(0, 0))
    assert (rec.ttft, rec.generated_text) == (pytest.approx(0.1), "Hi")


def test_stream_timer_chat_role_alone_is_no_token() -> None:
    timer = StreamTimer(sent_at=0.0)
    _feed(
        timer, [(0.1, _chat_chunk({"role": "assistant", "content": ""})), (0.2, "data: [DONE]\n\n")]
    )
    with pytest.raises(StreamError, match="without any token"):
        timer.record(BenchRequest(prompt="x", prompt_len=1, output_len=1), 0.0, RunClock(0, 0))


def test_sharegpt_without_tokenize_estimates_lengths(
    base_url: str, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """The fake server has no /tokenize: lengths are estimated, said once on stderr."""
    reply = "x" * 40  # 10 tokens at 4 characters a token
    turns = [{"from": "human", "value": "ok " * 8}, {"from": "gpt", "value": reply}]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps([{"id": str(i), "conversations": turns} for i in range(3)]))
    cfg = BenchConfig(
        base_url=base_url,
        dataset_name="sharegpt",
        trace_path=path,
        num_warmups=0,
        disable_tqdm=True,
    )
    r = _run(cfg)
    assert (r.completed, r.output_lens) == (3, [10] * 3)  # the fake sends max_tokens tokens
    assert capsys.readouterr().err.count("estimating 4 characters per token") == 1
