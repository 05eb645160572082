"""One streamed `/v1/completions` or `/v1/chat/completions` request, timed at the client.

`send_request` posts a `BenchRequest` with `stream: true` (a completion body, or for the chat
API a chat body with the prompt as one user message), reads the server-sent events as
they arrive and returns a `RequestRecord`; it never raises for a server or network fault
(HTTP errors, broken or truncated streams, error events, timeouts): those come back as a
failed record with a one-line message. `StreamTimer` is the I/O-free part, fed the stream's
bytes and their arrival time a chunk at a time, so it can be tested without a server.

The client is aiohttp (`open_session`), pdserve's one HTTP client library: on 2 cores the
load generator shares a core with the system it measures, and aiohttp costs about half the
CPU per streamed token of the library it replaced (docs/results.md, "the bench client is
aiohttp"). A token's arrival time is when the chunk that completes its event was read.

Chat streams: every chunk with a choice is a token (as for completions) except the one that
only announces the assistant's role (`{"role": "assistant", "content": ""}`): pdserve sends
it before the prompt is even scheduled, so counting it would make TTFT meaningless. A chunk
whose delta is empty (a token that ends mid-character) is a token.

`TokenCounter` counts prompt tokens with the server's `POST /tokenize` (pdserve's instances
and vLLM both answer `{"count": N}` for a completion body, the model optional), for datasets
that need lengths.

Handoff: a P/D router may report when the prefill instance finished, as a unix time in
seconds, either in the response header `x-pdserve-prefill-done` or inside any chunk as
`{"pdserve": {"prefill_done": T}}` (a chunk wins over the header). The handoff is the first
token's arrival at the client minus that time; it is only meaningful when the client's and
the prefill instance's clocks agree (same host, or synchronised).
"""

from __future__ import annotations

import asyncio
import itertools
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp
import msgspec

from pdserve.bench.dataset import CHARS_PER_TOKEN, BenchRequest, estimate_tokens
from pdserve.bench.metrics import RequestRecord
from pdserve.keepalive import CLIENT_KEEPALIVE_S
from pdserve.sse import SseDecoder

PREFILL_DONE_HEADER = "x-pdserve-prefill-done"
_MAX_ERROR_BODY = 500
_MAX_LINE_EXCERPT = 80  # each end of a malformed data line quoted in its error


class EndpointError(RuntimeError):
    """The endpoint cannot be benchmarked at all (unreachable, no model listed)."""


class StreamError(RuntimeError):
    """The stream carried an error event or ended early."""


@dataclass(frozen=True)
class RunClock:
    """The run's time origin: offsets from `perf0` (monotonic) and the unix time it maps to."""

    perf0: float
    unix0: float

    @classmethod
    def start(cls) -> RunClock:
        return cls(perf0=time.perf_counter(), unix0=time.time())

    def now(self) -> float:
        """Seconds since the run started."""
        return time.perf_counter() - self.perf0


@dataclass(frozen=True)
class ClientConfig:
    """What every request of a run shares."""

    url: str  # full completions (or chat completions) URL
    model: str
    ignore_eos: bool = True
    temperature: float | None = None  # None: the server's default
    timeout_s: float = 300.0  # bound on one whole request, first byte to [DONE]
    chat: bool = False  # send chat bodies (messages) instead of completion bodies


class StreamOptions(msgspec.Struct, frozen=True):
    include_usage: bool = True


class CompletionRequest(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """The request body (OpenAI completions plus vLLM's `ignore_eos`)."""

    model: str
    prompt: str | list[int]
    max_tokens: int
    stream: bool
    stream_options: StreamOptions
    ignore_eos: bool = False
    temperature: float | None = None


class ChatMessage(msgspec.Struct, frozen=True):
    role: str
    content: str


class ChatCompletionRequest(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """The chat request body (as vLLM's `openai-chat` backend sends it)."""

    model: str
    messages: list[ChatMessage]
    max_completion_tokens: int
    stream: bool
    stream_options: StreamOptions
    ignore_eos: bool = False
    temperature: float | None = None


class _Delta(msgspec.Struct):
    role: str | None = None
    content: str | None = None


class _Choice(msgspec.Struct):
    text: str = ""  # completions
    delta: _Delta | None = None  # chat
    finish_reason: str | None = None

    def token_text(self) -> str:
        return (self.delta.content or "") if self.delta is not None else self.text


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None
    completion_tokens: int | None = None


class _ErrorBody(msgspec.Struct):
    message: str = ""


class _PdserveInfo(msgspec.Struct):
    prefill_done: float | None = None


class _Chunk(msgspec.Struct):
    choices: list[_Choice] = msgspec.field(default_factory=list)
    usage: _Usage | None = None
    error: _ErrorBody | str | None = None
    pdserve: _PdserveInfo | None = None


_CHUNK_DECODER = msgspec.json.Decoder(_Chunk)


def _is_token_chunk(chunk: _Chunk) -> bool:
    """Any chunk with a choice counts as a token chunk, even with empty text (vLLM's rule),
    except a chat chunk that only announces the role.

    Empty text is common: a token that does not complete a UTF-8 character yet, or a final
    chunk that only carries finish_reason after a run of such tokens; skipping those would
    fail requests that did generate tokens. The usage chunk has no choices.
    """
    if not chunk.choices:
        return False
    delta = chunk.choices[0].delta
    return delta is None or delta.role is None or bool(delta.content)


class StreamTimer:
    """Timings of one stream, from SSE lines and their arrival times (run-clock seconds).

    Owned by one request for the duration of its stream.
    """

    def __init__(self, sent_at: float) -> None:
        self.sent_at = sent_at
        self.token_times: list[float] = []
        self.text: list[str] = []
        self.usage = _Usage()
        self.prefill_done: float | None = None
        self.done = False
        self._events = SseDecoder()

    def feed(self, chunk: bytes, now: float) -> None:
        """Take the stream's next bytes, read at `now` (see `feed_data`)."""
        for data in self._events.feed(chunk):
            self.feed_data(data, now)

    def end(self, now: float) -> None:
        """The stream ended at `now`."""
        for data in self._events.end():
            self.feed_data(data, now)

    def feed_data(self, data: str, now: float) -> None:
        """Take one event's data; raises StreamError on an error event or data that is not
        a whole chunk (a stream cut mid-event)."""
        data = data.strip()
        if data == "[DONE]":
            self.done = True
            return
        try:
            chunk = _CHUNK_DECODER.decode(data)
        except msgspec.DecodeError as exc:
            raise StreamError(f"malformed data line ({exc}): {_excerpt(data)}") from None
        if chunk.error is not None:
            message = chunk.error if isinstance(chunk.error, str) else chunk.error.message
            raise StreamError(f"error event: {message}")
        if chunk.pdserve is not None and chunk.pdserve.prefill_done is not None:
            self.prefill_done = chunk.pdserve.prefill_done
        if chunk.usage is not None:
            self.usage = chunk.usage
        if _is_token_chunk(chunk):
            self.token_times.append(now)
            self.text.append(chunk.choices[0].token_text())

    def record(self, req: BenchRequest, arrival: float, clock: RunClock) -> RequestRecord:
        """The finished request's record; raises StreamError if the stream was incomplete."""
        if not self.token_times:
            raise StreamError("stream ended without any token")
        if not self.done:
            raise StreamError("stream ended before [DONE]")
        first, last = self.token_times[0], self.token_times[-1]
        handoff = None
        if self.prefill_done is not None:
            handoff = clock.unix0 + first - self.prefill_done
        return RequestRecord(
            success=True,
            prompt_len=self.usage.prompt_tokens or req.prompt_len,
            output_len=self.usage.completion_tokens or len(self.token_times),
            arrival_time=arrival,
            start_time=self.sent_at,
            ttft=first - self.sent_at,
            itl=[b - a for a, b in itertools.pairwise(self.token_times)],
            latency=last - self.sent_at,
            handoff=handoff,
            generated_text="".join(self.text),
        )


def _excerpt(data: str) -> str:
    """`data` quoted, or its two ends if long (the end shows where a line was cut)."""
    if len(data) <= 2 * _MAX_LINE_EXCERPT:
        return repr(data)
    return f"{data[:_MAX_LINE_EXCERPT]!r}...{data[-_MAX_LINE_EXCERPT:]!r} ({len(data)} chars)"


def _header_time(response: aiohttp.ClientResponse) -> float | None:
    value = response.headers.get(PREFILL_DONE_HEADER)
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


def _body(cfg: ClientConfig, req: BenchRequest) -> bytes:
    if cfg.chat:
        return _chat_body(cfg, req)
    return msgspec.json.encode(
        CompletionRequest(
            model=cfg.model,
            prompt=req.prompt,
            max_tokens=req.output_len,
            stream=True,
            stream_options=StreamOptions(include_usage=True),
            ignore_eos=cfg.ignore_eos,
            temperature=cfg.temperature,
        )
    )


def _chat_body(cfg: ClientConfig, req: BenchRequest) -> bytes:
    if not isinstance(req.prompt, str):
        raise StreamError("the chat API takes text prompts, not token ids")
    return msgspec.json.encode(
        ChatCompletionRequest(
            model=cfg.model,
            messages=[ChatMessage(role="user", content=req.prompt)],
            max_completion_tokens=req.output_len,
            stream=True,
            stream_options=StreamOptions(include_usage=True),
            ignore_eos=cfg.ignore_eos,
            temperature=cfg.temperature,
        )
    )


def open_session(
    timeout_s: float, max_connections: int | None = None, headers: dict[str, str] | None = None
) -> aiohttp.ClientSession:
    """The client session of one bench run; the caller closes it (`async with`).

    `timeout_s` bounds connecting (at most 10 s) and every wait for the next bytes; the
    whole request is bounded by `ClientConfig.timeout_s`. No pool cap unless given: a wait
    for a pooled connection would be counted as TTFT. HTTP(S)_PROXY is ignored: a proxy
    would be measured along with the server."""
    connector = aiohttp.TCPConnector(
        limit=max_connections or 0, keepalive_timeout=CLIENT_KEEPALIVE_S
    )
    timeout = aiohttp.ClientTimeout(sock_connect=min(10.0, timeout_s), sock_read=timeout_s)
    return aiohttp.ClientSession(connector=connector, timeout=timeout, headers=headers)


async def _stream(
    http: aiohttp.ClientSession,
    cfg: ClientConfig,
    req: BenchRequest,
    timer: StreamTimer,
    clock: RunClock,
) -> None:
    headers = {"content-type": "application/json"}
    async with http.post(cfg.url, data=_body(cfg, req), headers=headers) as resp:
        if resp.status != 200:
            body = (await resp.read()).decode(errors="replace").strip()
            raise StreamError(f"HTTP {resp.status}: {body[:_MAX_ERROR_BODY]}")
        timer.prefill_done = _header_time(resp)
        async for chunk in resp.content.iter_any():
            timer.feed(chunk, clock.now())
        timer.end(clock.now())


async def send_request(
    http: aiohttp.ClientSession,
    cfg: ClientConfig,
    req: BenchRequest,
    clock: RunClock,
    arrival: float | None = None,
) -> RequestRecord:
    """Send one request and time it; `arrival` is when the arrival process released it.

    Never raises except for cancellation: any failure is a record with success=False.
    """
    sent_at = clock.now()
    arrival = sent_at if arrival is None else arrival
    timer = StreamTimer(sent_at)
    try:
        await asyncio.wait_for(_stream(http, cfg, req, timer, clock), cfg.timeout_s)
        return timer.record(req, arrival, clock)
    except asyncio.TimeoutError:
        error = f"timed out after {cfg.timeout_s:g} s"
    except StreamError as exc:
        error = str(exc)
    except Exception as exc:  # a benchmark reports every failure and keeps going
        error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return RequestRecord(
        success=False,
        error=error,
        prompt_len=req.prompt_len,
        arrival_time=arrival,
        start_time=sent_at,
    )


async def first_model(http: aiohttp.ClientSession, base_url: str) -> str:
    """The id of the first model listed by `GET /v1/models`; EndpointError if none."""
    url = f"{base_url.rstrip('/')}/v1/models"
    try:
        async with http.get(url, raise_for_status=True) as resp:
            models = msgspec.json.decode(await resp.read()).get("data") or []
        return str(models[0]["id"])
    except (
        aiohttp.ClientError,
        asyncio.TimeoutError,
        msgspec.DecodeError,
        KeyError,
        IndexError,
        TypeError,
        AttributeError,
    ) as exc:
        raise EndpointError(f"cannot read the model list at {url}: {exc!r}") from None


class _TokenCount(msgspec.Struct):
    count: int


_COUNT_DECODER = msgspec.json.Decoder(_TokenCount)
_TOKENIZE_CONCURRENCY = 8
_NO_TOKENIZE_STATUS = (401, 403, 404, 405, 501)  # other failures are the text's own


class TokenCounter:
    """Prompt token counts from `POST {base_url}/tokenize`, or estimates without one.

    The first answer that says there is no such route or no access (401, 403, 404, 405, 501,
    a connection error) switches to `estimate_tokens` for good, with one line on stderr; any
    other failure estimates that text only. Owned by one run (uses its session)."""

    def __init__(self, http: aiohttp.ClientSession, base_url: str, model: str | None) -> None:
        self._http = http
        self._url = base_url.rstrip("/") + "/tokenize"
        self._model = model
        self._usable = True
        self._slots = asyncio.Semaphore(_TOKENIZE_CONCURRENCY)

    @property
    def exact(self) -> bool:
        """Whether the counts so far came from the server."""
        return self._usable

    async def count(self, texts: Sequence[str]) -> list[int]:
        return list(await asyncio.gather(*(self._one(t) for t in texts)))

    async def _one(self, text: str) -> int:
        if text and self._usable:
            async with self._slots:
                if self._usable:
                    counted = await self._ask(text)
                    if counted is not None:
                        return counted
        return estimate_tokens([text])[0]

    async def _ask(self, text: str) -> int | None:
        fields = {"prompt": text} if self._model is None else {"model": self._model, "prompt": text}
        body = msgspec.json.encode(fields)
        headers = {"content-type": "application/json"}
        try:
            async with self._http.post(self._url, data=body, headers=headers) as resp:
                if resp.status in _NO_TOKENIZE_STATUS:
                    self._give_up(f"HTTP {resp.status}")
                    return None
                return (
                    _COUNT_DECODER.decode(await resp.read()).count if resp.status == 200 else None
                )
        except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as exc:
            self._give_up(type(exc).__name__)
        except msgspec.DecodeError:
            pass
        return None

    def _give_up(self, why: str) -> None:
        if self._usable:
            self._usable = False
            print(
                f"pdserve bench serve: no token counts from {self._url} ({why}); "
                f"estimating {CHARS_PER_TOKEN:g} characters per token",
                file=sys.stderr,
            )
