"""The soak's traffic: what each request is, when it arrives, and how the client sends it.

Two kinds of request, decided when the request is made:

- kept: sent without streaming, with greedy sampling, `ignore_eos` and
  `return_token_ids`, so the generated token ids come back whole and a monolithic oracle
  can check them exactly;
- aborted: streamed, and closed by the client at a random point: after
  `abort_after_tokens` token chunks or `abort_after_s` seconds, whichever comes first (so
  aborts land during prefill, the KV handoff and decode alike).

`send` never raises for a server or network fault: every request ends as one `SoakOutcome`
(completed, aborted as intended, or failed with a grouped cause, see `soak_report`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import aiohttp
import msgspec
import numpy as np

from pdserve.bench.soak_report import cause_of_exception, cause_of_http, cause_of_stream_error
from pdserve.options import option
from pdserve.sse import SseDecoder

Status = Literal["completed", "aborted", "failed"]


@dataclass(frozen=True)
class TrafficConfig:
    """Request mix: lengths uniform over inclusive ranges, a fraction aborted by the client."""

    input_len: tuple[int, int] = option(
        (64, 1536), nargs=2, metavar=("MIN", "MAX"), help="prompt tokens, uniform in MIN..MAX"
    )
    output_len: tuple[int, int] = option(
        (8, 128), nargs=2, metavar=("MIN", "MAX"), help="tokens to generate, uniform in MIN..MAX"
    )
    abort_fraction: float = option(0.2, help="fraction of the requests the client aborts")
    abort_window_s: float = option(  # a timed abort point is uniform over [0, this]
        8.0,
        flag="--abort-window",
        metavar="S",
        help="a client abort comes at most this long after the send",
    )
    token_ids: tuple[int, int] = (10, 256)  # prompt ids uniform over [lo, hi)

    def __post_init__(self) -> None:
        for name, (lo, hi) in (("input_len", self.input_len), ("output_len", self.output_len)):
            if not 1 <= lo <= hi:
                raise ValueError(f"{name} range must satisfy 1 <= min <= max, got {lo}..{hi}")
        if not 0.0 <= self.abort_fraction <= 1.0:
            raise ValueError(f"abort_fraction must be in [0, 1], got {self.abort_fraction}")
        if not self.abort_window_s > 0:
            raise ValueError("abort_window_s must be > 0")

    @property
    def mean_input_len(self) -> float:
        return sum(self.input_len) / 2


class SoakRequest(msgspec.Struct, frozen=True, kw_only=True):
    """One request of the soak; `abort_after_*` set only for one the client will close."""

    index: int
    prompt: list[int]
    max_tokens: int
    arrival_s: float  # planned release, seconds from the start of the traffic
    abort_after_tokens: int | None = None
    abort_after_s: float | None = None

    @property
    def aborts(self) -> bool:
        return self.abort_after_tokens is not None


class SoakOutcome(msgspec.Struct, kw_only=True):
    """How one request ended, as the client saw it (times in seconds from the start)."""

    index: int
    status: Status
    sent_s: float
    ended_s: float
    prompt_len: int
    max_tokens: int
    num_tokens: int = 0  # generated tokens received
    cause: str | None = None  # failed only: the grouping key
    detail: str | None = None  # failed only: the first 300 characters of what was seen
    token_ids: list[int] | None = None  # kept and completed only


def poisson_arrivals(rate: float, duration_s: float, rng: np.random.Generator) -> Iterator[float]:
    """Arrival times of a Poisson process of `rate` req/s over [0, duration_s)."""
    t = float(rng.exponential(1.0 / rate))
    while t < duration_s:
        yield t
        t += float(rng.exponential(1.0 / rate))


def make_request(
    index: int, arrival_s: float, cfg: TrafficConfig, rng: np.random.Generator
) -> SoakRequest:
    """A random request of the mix (lengths, abort decision and abort point from `rng`)."""
    n_in = int(rng.integers(cfg.input_len[0], cfg.input_len[1] + 1))
    n_out = int(rng.integers(cfg.output_len[0], cfg.output_len[1] + 1))
    prompt = rng.integers(cfg.token_ids[0], cfg.token_ids[1], n_in).tolist()
    aborts = bool(rng.random() < cfg.abort_fraction)
    return SoakRequest(
        index=index,
        prompt=prompt,
        max_tokens=n_out,
        arrival_s=arrival_s,
        abort_after_tokens=int(rng.integers(0, n_out)) if aborts else None,
        abort_after_s=float(rng.uniform(0.0, cfg.abort_window_s)) if aborts else None,
    )


def request_body(model: str, req: SoakRequest, stream: bool) -> dict[str, object]:
    """Greedy, full-length (ignore_eos) completion; token ids back when not streaming."""
    body: dict[str, object] = {
        "model": model,
        "prompt": req.prompt,
        "max_tokens": req.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }
    if not stream:
        body["return_token_ids"] = True
    return body


class _Choice(msgspec.Struct):
    token_ids: list[int] | None = None
    text: str = ""


class _Completion(msgspec.Struct):
    choices: list[_Choice] = msgspec.field(default_factory=list)


class _StreamChunk(msgspec.Struct):
    choices: list[msgspec.Raw] = msgspec.field(default_factory=list)
    # Raw, not `Raw | None`: msgspec refuses an object for that union. Empty: no error.
    error: msgspec.Raw = msgspec.Raw()


_COMPLETION = msgspec.json.Decoder(_Completion)
_CHUNK = msgspec.json.Decoder(_StreamChunk)


class _Failed(Exception):
    """The request failed with this grouping key and detail."""

    def __init__(self, cause: str, detail: str) -> None:
        super().__init__(cause)
        self.cause, self.detail = cause, detail[:300]


class _Clock:
    def __init__(self, t0: float) -> None:
        self.t0 = t0

    def now(self) -> float:
        return time.monotonic() - self.t0


async def _send_kept(
    http: aiohttp.ClientSession, url: str, model: str, req: SoakRequest
) -> list[int]:
    async with http.post(url, json=request_body(model, req, stream=False)) as resp:
        status, body = resp.status, await resp.read()
    text = body.decode(errors="replace")
    if status != 200:
        raise _Failed(cause_of_http(status, body), text)
    try:
        choice = _COMPLETION.decode(body).choices[0]
    except (msgspec.DecodeError, IndexError) as exc:
        raise _Failed("bad response body", f"{exc}: {text}") from None
    ids = choice.token_ids
    if ids is None or len(ids) != req.max_tokens:
        got = "no" if ids is None else str(len(ids))
        raise _Failed("incomplete output", f"{got} token ids of {req.max_tokens}")
    return ids


async def _stream_until_abort(
    http: aiohttp.ClientSession, url: str, model: str, req: SoakRequest, seen: list[int]
) -> bool:
    """Read the stream until the abort point (returns False) or its end (True); `seen[0]`
    counts token chunks. Leaving the `async with` before the stream's end closes the
    connection (aiohttp pools only a connection whose answer was read whole): the abort."""
    async with http.post(url, json=request_body(model, req, stream=True)) as resp:
        if resp.status != 200:
            body = await resp.read()
            raise _Failed(cause_of_http(resp.status, body), body.decode(errors="replace"))
        # pdserve.sse, not a line splitter: those also split at U+2028/U+2029/U+0085 in JSON.
        decoder = SseDecoder()
        async for raw in resp.content.iter_any():
            for data in decoder.feed(raw):
                if data == "[DONE]":
                    return True
                if not _counts_token(data, seen, req):
                    return False
    raise _Failed("stream ended before [DONE]", f"after {seen[0]} token chunks")


def _counts_token(data: str, seen: list[int], req: SoakRequest) -> bool:
    """Count one stream event's token chunk in `seen[0]`; False once the abort point is
    reached. An error event fails the request (`_Failed`)."""
    chunk = _CHUNK.decode(data)
    if len(chunk.error) and bytes(chunk.error) != b"null":
        raise _Failed(cause_of_stream_error(bytes(chunk.error)), data)
    if chunk.choices:
        seen[0] += 1
    return not (chunk.choices and seen[0] >= (req.abort_after_tokens or 0))


async def _send_aborted(
    http: aiohttp.ClientSession, url: str, model: str, req: SoakRequest, seen: list[int]
) -> bool:
    """True if the stream completed before its abort point, False if the client closed it."""
    try:
        return await asyncio.wait_for(
            _stream_until_abort(http, url, model, req, seen), req.abort_after_s
        )
    except aiohttp.ServerTimeoutError:  # a socket read timed out: a failure, not the abort
        raise
    except asyncio.TimeoutError:  # the timed abort point came first (maybe during prefill)
        return False


async def send(
    http: aiohttp.ClientSession,
    url: str,
    model: str,
    req: SoakRequest,
    t0: float,
    timeout_s: float,
) -> SoakOutcome:
    """Send `req` to the completions `url`; never raises except for cancellation.

    `t0` is the traffic's start (time.monotonic); `timeout_s` bounds the whole request."""
    clock = _Clock(t0)
    sent = clock.now()
    seen = [0]
    out = SoakOutcome(
        index=req.index,
        status="completed",
        sent_s=sent,
        ended_s=sent,
        prompt_len=len(req.prompt),
        max_tokens=req.max_tokens,
    )
    try:
        if req.aborts:
            done = await asyncio.wait_for(_send_aborted(http, url, model, req, seen), timeout_s)
            out.status, out.num_tokens = ("completed" if done else "aborted"), seen[0]
        else:
            out.token_ids = await asyncio.wait_for(_send_kept(http, url, model, req), timeout_s)
            out.num_tokens = len(out.token_ids)
    except _Failed as exc:
        out.status, out.cause, out.detail = "failed", exc.cause, exc.detail
    except asyncio.TimeoutError:
        out.status, out.cause = "failed", "client timeout"
        out.detail = f"no complete answer after {timeout_s:g} s"
    except Exception as exc:  # a soak reports every failure and keeps going
        out.status, out.cause, out.detail = "failed", cause_of_exception(exc), repr(exc)[:300]
    out.ended_s = clock.now()
    return out
