"""`n` > 1 through P/D: one pair of legs per choice, merged into the answer one instance
gives (pdserve.server.fanout).

Choice i is sent as a request with `n` 1, seed `seed + i` when the client gave a seed, and
`X-Request-Id` `<id>-<i>`: exactly the engine request a monolithic instance makes for it
(`child_requests`), so choice i through P/D equals choice i of one instance (same token
ids; the first token is sampled on P with the choice's seed). The router then merges the
answers: choice i gets `index` i, the response id is the client's (`cmpl-<id>`, the
`-<i>` cut), usage counts the prompt once and the completion tokens of every choice.

Order and placement: choice 0 goes first; choices 1..n-1 start once P has answered choice
0's prefill leg (or D has started it), and go to that same prefill instance when it is
still admitted, which then finds the prompt in its prefix cache and computes only its
last partial block (the policy picks the decode instances: the same one, under
`cache_aware`, registers only the blocks it does not hold). The client waits for every
choice's start (D's first token), so a choice failing before its start is a clean JSON
error: every other choice is cancelled or closed (closing a D stream aborts it there;
P's holds are released as for any failed request). A stream merges the choices' events
as they come: one `[DONE]` after the last, the choices' usage events summed into one,
and the first error event ends the whole stream (the other choices are closed).

Each choice counts as one request in the router's metrics (it is one P/D request).
Owned by the dispatcher's event loop; nothing here outlives one client request.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import anyio
import msgspec
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from pdserve.router.health import Instance
from pdserve.server.protocol import MAX_N, SEED_MAX
from pdserve.sse import data_event_bytes, events_data

T = TypeVar("T")

DONE_EVENT = b"data: [DONE]\n\n"
MAX_REQUEST_ID = 128  # characters of an X-Request-Id (pdserve.server.request_ids)


def choice_count(body: dict[str, Any]) -> int:
    """The `n` to fan out through P/D: 1 unless `n` is an int in [2, MAX_N] (anything else
    goes whole to an instance, which answers it or refuses it with a 400)."""
    n = body.get("n")
    return n if type(n) is int and 2 <= n <= MAX_N else 1


def choices_fit(body: dict[str, Any], request_id: str, n: int) -> bool:
    """Whether every choice can be sent as its own request: its seed `seed + i` is one an
    instance takes and its id `<id>-<i>` one it accepts (one instance makes its choices
    without either limit; a choice alone would be refused)."""
    seed = body.get("seed")
    seeds = type(seed) is not int or seed + n - 1 <= SEED_MAX
    return seeds and len(choice_request_id(request_id, n - 1)) <= MAX_REQUEST_ID


def choice_body(body: dict[str, Any], index: int) -> dict[str, Any]:
    """The client's body as choice `index`'s request: `n` 1, its own seed."""
    out = {k: v for k, v in body.items() if k != "n"}
    seed = body.get("seed")
    if type(seed) is int:
        out["seed"] = seed + index
    return out


def choice_request_id(request_id: str, index: int) -> str:
    """Choice `index`'s `X-Request-Id` (the monolithic instance's engine request id)."""
    return f"{request_id}-{index}"


@dataclass(frozen=True)
class ChoiceLeg:
    """Which choice a P/D request is, for the dispatcher: the prefill instance to prefer
    (choice 0's), and, for choice 0, the future told which instance prefilled it."""

    index: int
    prefill: Instance | None = None
    prefilled: asyncio.Future[Instance] | None = None

    def prefilled_on(self, p: Instance) -> None:
        """The prompt is prefilled on `p` (the first call counts)."""
        if self.prefilled is not None and not self.prefilled.done():
            self.prefilled.set_result(p)


async def run_choices(
    n: int,
    start: Callable[[ChoiceLeg], Awaitable[T]],
    discard: Callable[[T], None],
) -> list[T]:
    """The started answers of `n` choices (`start`: one choice's legs up to D's first token):
    choice 0 first, the others once it is prefilled, on its prefill instance. On the first
    failure (or a cancellation) every other choice is cancelled, or `discard`ed when it had
    started, and the error raised."""
    prefilled: asyncio.Future[Instance] = asyncio.get_running_loop().create_future()
    tasks = [asyncio.ensure_future(start(ChoiceLeg(0, None, prefilled)))]
    try:
        await asyncio.wait([tasks[0], prefilled], return_when=asyncio.FIRST_COMPLETED)
        if tasks[0].done() and tasks[0].exception() is not None:
            raise tasks[0].exception()  # type: ignore[misc]
        pin = prefilled.result() if prefilled.done() else None
        tasks += [asyncio.ensure_future(start(ChoiceLeg(i, pin))) for i in range(1, n)]
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for t in tasks:
            if t.done() and t.exception() is not None:
                raise t.exception()  # type: ignore[misc]
        return [t.result() for t in tasks]
    except BaseException:
        await _cancel_all(tasks)
        for t in tasks:
            if not t.cancelled() and t.exception() is None:
                discard(t.result())
        raise
    finally:
        prefilled.cancel()


async def _cancel_all(tasks: Sequence[asyncio.Task[Any]]) -> None:
    pending = [t for t in tasks if not t.done()]
    for t in pending:
        t.cancel()
    if pending:
        await asyncio.wait(pending)


def merge_whole(bodies: Sequence[bytes], request_id: str) -> bytes:
    """One response body from the choices' whole (non-streamed) bodies, in choice order."""
    answers = [msgspec.json.decode(b) for b in bodies]
    out = dict(answers[0])
    out["id"] = _client_id(out.get("id"), request_id)
    choices = []
    for i, answer in enumerate(answers):
        for choice in answer.get("choices") or []:
            choices.append({**choice, "index": i})
    out["choices"] = choices
    usage = _summed_usage([a.get("usage") for a in answers])
    if usage is not None:
        out["usage"] = usage
    return msgspec.json.encode(out)


def _client_id(leg_id: Any, request_id: str) -> Any:
    """`cmpl-<id>-0` -> `cmpl-<id>`: the id one instance gives the whole request."""
    suffix = f"{request_id}-0"
    if isinstance(leg_id, str) and leg_id.endswith(suffix):
        return leg_id[: -len(suffix)] + request_id
    return leg_id


def _summed_usage(usages: Sequence[Any]) -> dict[str, int] | None:
    """The prompt once, every choice's completion tokens (as one instance counts)."""
    if not usages or not all(isinstance(u, dict) for u in usages):
        return None
    prompt = usages[0].get("prompt_tokens", 0)
    completion = sum(u.get("completion_tokens", 0) for u in usages)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


class StreamMerge:
    """Rewrites the SSE events of n choice streams into one stream (see the module doc).
    Fed whole events; owned by one merged response."""

    def __init__(self, n: int, request_id: str) -> None:
        self._request_id = request_id
        self._usages: list[Any] = [None] * n
        self._usage_event: dict[str, Any] | None = None  # the last one, id merged
        self.failed = False  # an error event went out: the stream ends

    def feed(self, index: int, events: bytes) -> bytes:
        """The merged bytes for whole `events` of choice `index`."""
        out = []
        for event in events.replace(b"\r\n", b"\n").split(b"\n\n"):
            if event.strip():
                out.append(self._event(index, event))
            if self.failed:
                break
        return b"".join(out)

    def _event(self, index: int, event: bytes) -> bytes:
        found = events_data(event + b"\n\n")
        data = found[0].encode() if found else b""
        if data == b"[DONE]":
            return b""  # one [DONE] goes out after the last choice
        payload = _json_object(data) if data else None
        if payload is None:
            return event + b"\n\n"  # a comment, keep-alive or foreign data: as it came
        if payload.get("error") is not None:
            self.failed = True
            return event + b"\n\n"
        payload["id"] = self._merged_id(payload.get("id"), index)
        choices = payload.get("choices")
        if payload.get("usage") is not None and not choices:
            self._usages[index] = payload["usage"]
            self._usage_event = payload
            return b""
        if isinstance(choices, list):
            payload["choices"] = [
                {**c, "index": index} if isinstance(c, dict) else c for c in choices
            ]
        return data_event_bytes(msgspec.json.encode(payload))

    def _merged_id(self, leg_id: Any, index: int) -> Any:
        """Choice `index`'s `<prefix><id>-<index>` as `<prefix><id>`."""
        suffix = f"{self._request_id}-{index}"
        if isinstance(leg_id, str) and leg_id.endswith(suffix):
            return leg_id[: -len(suffix)] + self._request_id
        return leg_id

    def finish(self) -> bytes:
        """The tail after every choice ended cleanly: the summed usage event when the
        choices sent theirs (`stream_options.include_usage`), and `[DONE]`."""
        usage = _summed_usage(self._usages)
        if usage is None or self._usage_event is None:
            return DONE_EVENT
        event = {**self._usage_event, "usage": usage}
        return data_event_bytes(msgspec.json.encode(event)) + DONE_EVENT


def _json_object(data: bytes) -> dict[str, Any] | None:
    try:
        value = msgspec.json.decode(data)
    except msgspec.DecodeError:
        return None
    return value if isinstance(value, dict) else None


class ChoiceStream(Protocol):
    """One started choice stream (the dispatcher's `DecodeRelay`)."""

    def head(self) -> bytes: ...

    def chunks(self) -> AsyncGenerator[bytes, None]: ...

    def close(self, outcome: str) -> None: ...


async def merged_events(
    streams: Sequence[ChoiceStream], merge: StreamMerge
) -> AsyncGenerator[bytes, None]:
    """The merged stream of started choices; closes every choice's stream at its end
    (also on an error event, or when the client leaves)."""
    queue: asyncio.Queue[tuple[int, bytes | None]] = asyncio.Queue()

    async def pump(i: int, stream: ChoiceStream) -> None:
        try:
            await queue.put((i, stream.head()))
            async with _closing(stream.chunks()) as chunks:
                async for chunk in chunks:
                    await queue.put((i, chunk))
        finally:
            queue.put_nowait((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            i, chunk = await queue.get()
            if chunk is None:
                left -= 1
                continue
            if out := merge.feed(i, chunk):
                yield out
            if merge.failed:
                yield DONE_EVENT
                return
        yield merge.finish()
    finally:
        with anyio.CancelScope(shield=True):
            await _cancel_all(tasks)
        for s in streams:
            s.close("choice_ended")


class _closing:
    """`aclosing` for an async generator (closed even when the pump is cancelled)."""

    def __init__(self, gen: AsyncGenerator[bytes, None]) -> None:
        self._gen = gen

    async def __aenter__(self) -> AsyncIterator[bytes]:
        return self._gen

    async def __aexit__(self, *exc: object) -> None:
        await self._gen.aclose()


class ChoicesStreamingResponse(StreamingResponse):
    """The merged stream of n started choices; closes every choice's stream however the
    response ends (also when it never started)."""

    def __init__(
        self, streams: Sequence[ChoiceStream], merge: StreamMerge, headers: dict[str, str]
    ) -> None:
        self._streams = streams
        self._events = merged_events(streams, merge)
        super().__init__(self._events, 200, headers, "text/event-stream")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._events.aclose()
            for s in self._streams:
                s.close("client_disconnect")
