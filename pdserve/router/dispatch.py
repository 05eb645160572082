"""P/D dispatch: the prefill and decode legs of one client request, in pull or push mode.

Pull (sequential): P gets the prompt with `max_tokens=1` and `{do_remote_decode,
transfer_mode="pull", transfer_id}` (a fresh id); the `kv_transfer_params` of P's answer,
plus `do_remote_prefill`, go to D with the client's original request; D's answer goes to
the client unchanged.

Push (concurrent): P and D are picked up front and a `transfer_id` made; both legs start
at once as tasks. D's leg carries P's engine id and side channel (from P's `/kv/info`).
Until D's first token, a failing P leg cancels D's (closing D's stream aborts the request
there) and the client gets P's error; a failing D leg cancels P's. After D's first token
the client is committed to D's stream and P's answer only feeds metrics.

Local prefill (conditional disaggregation): a prompt shorter than `local_prefill_below`
tokens goes straight to a decode instance as a plain request (no `kv_transfer_params`),
which prefills it itself: no P leg, no transfer. Its length must be known exactly (token
ids, or the instance's `/tokenize`, not asked for a text far above the threshold); when it
is not, the request is disaggregated. On by default below 64 tokens (`RouterConfig`).
Requests one instance serves better (`pdserve.router.local_only`: prompt logprobs,
`max_tokens` 0) go the same way whatever their length.

`n` > 1 (`pdserve.router.choices`): one P/D request per choice, the answers merged; on
vLLM's instances such a request goes whole to a decode instance.

No prefill left: while no prefill instance can take this mode's P leg but a decode
instance is admitted, every request is served as a local prefill on a decode instance
(mode "local_fallback" in the metrics; logged once per change; `/health` stays 200 and
says it is degraded): a cluster that lost its prefill instances degrades to monolithic
decode instances instead of failing every request.

Releasing P's hold: P keeps a finished prompt's blocks for the decode leg (owner `Hold(tid)`).
When that leg will never use them - D refused or failed before its stream started, no D
was left to pick, or the client left between the legs (pull: while P ran or after P
answered; push: before D's first token) - the dispatcher tells P at once (`POST
/kv/release`, signed with the cluster token; pdserve.transfer.release) in a background
task, so the client's answer never waits for it. P frees only what no decode instance
uses; the call is idempotent, and a failed one leaves the blocks to P's lease. A push
request whose P leg itself failed sends none (P holds nothing for it).

Choice: every leg's instance is picked by the policy with the request's `Demand` (prompt
and decode tokens). In push mode the D leg's demand carries the predicted time until P
has prefilled the prompt (`InstancePool.predict_prefill_s`), for `load_aware`.

"D's first token" is its first substantive SSE event (`pdserve.router.sse`): events with
no token (a chat stream's role head) are held back until then, because D may send them
before it has the KV. The client gets nothing, not even the status line, before it.

Ejection: every leg is raced against its instance's ejection by the health monitor
(`pdserve.router.ejection`): P's answer, D's first token and each chunk of D's stream. An
ejected instance's leg ends with a 502 naming it (an SSE `error` event once D's stream has
started; a stream only after `ejected_stream_grace_s` of silence) and the other leg is
cancelled as on any leg failure, so a frozen instance costs its requests one ejection
delay, not `request_timeout_s`.

Signed legs: with a cluster token, every P and D leg carries `X-PDServe-Leg-Signature`, the
token's MAC over every field of the leg's `kv_transfer_params` and a timestamp
(`pdserve.transfer.cluster_auth`); instances with a token refuse legs without it. A pull D
leg's params come from P: if they cannot even be parsed, P's answer is the 502.

vLLM instances (`RouterConfig.engine == "vllm"`): the legs carry vLLM's params instead,
and P's answer goes to D untouched (`pdserve.router.vllm_legs`); no signatures, no releases
(vLLM has no /kv/release), and P's prefill-done time is when P's answer reached the router.
A push request's two legs go out at once (`RouterConfig.concurrent_legs`) under a fresh
`X-Request-Id`: NixlPushConnector pairs them by that id, pdserve's connector by the
`transfer_id` both legs' params carry.

Both legs carry the client's `X-Request-Id` (or a new one) unchanged: P and D are separate
engines and pair the transfer by `transfer_id`, so the shared id only joins their logs.

Ownership: a leg on an instance is opened by `InstancePool.acquire` and closed
exactly once: P's when its leg task ends (a done callback, so a task cancelled
before it ran still releases), D's by the dispatcher on failure before a response exists,
afterwards by `DecodeRelay.finish`. An open upstream response is closed by whoever holds
it when the request ends: `_open_decode` on its own failure or cancellation, then the
relay (end of stream, upstream error, or client disconnect).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import anyio
import msgspec
from fastapi.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from pdserve.router import vllm_legs
from pdserve.router.choices import (
    ChoiceLeg,
    ChoicesStreamingResponse,
    StreamMerge,
    choice_body,
    choice_count,
    choice_request_id,
    choices_fit,
    merge_whole,
    run_choices,
)
from pdserve.router.config import RouterConfig
from pdserve.router.ejection import InstanceEjected, StreamWatch, until_ejected
from pdserve.router.health import (
    EJECTED_REASON,
    NO_PREFILL_DEGRADED,
    Instance,
    InstancePool,
    Leg,
    Role,
)
from pdserve.router.load_model import Demand
from pdserve.router.local_only import local_only_reason
from pdserve.router.metrics import RouterMetrics
from pdserve.router.prefix_index import prefix_chain
from pdserve.router.prompt_size import (
    certainly_not_below,
    decode_tokens,
    estimated_prompt_tokens,
    token_id_count,
    tokenized_count,
)
from pdserve.router.sse import CompleteEvents, EventAnnotator, StreamStartDetector
from pdserve.router.upstream import (
    StreamAnswer,
    Upstream,
    UpstreamConnectError,
    UpstreamError,
    UpstreamTimeout,
)
from pdserve.server.errors import APIError
from pdserve.sse import data_event_bytes
from pdserve.tracelog import hop
from pdserve.transfer.cluster_auth import LEG_SIGNATURE_HEADER, sign_leg
from pdserve.transfer.params import InvalidKVTransferParams
from pdserve.transfer.release import RELEASE_PATH, SIGNATURE_HEADER, release_signature

log = logging.getLogger(__name__)

Params = dict[str, Any]
T = TypeVar("T")

# P's prefill-done time (unix seconds) for clients measuring the handoff (docs/router.md).
PREFILL_DONE_HEADER = "X-PDServe-Prefill-Done"


@dataclass(frozen=True)
class Call:
    """One client request as the dispatcher sees it (the body is never mutated)."""

    path: str  # "/v1/completions" or "/v1/chat/completions"
    body: dict[str, Any]
    stream: bool
    request_id: str
    arrival: float = field(default_factory=time.monotonic)
    choice: ChoiceLeg | None = None  # one choice of a request with n > 1 (`choices`)


@dataclass(frozen=True)
class PrefillResult:
    """What the P leg returned."""

    params: Params | None  # P's kv_transfer_params
    prefill_done_time: float | None  # unix time


@dataclass
class DecodeStart:
    """D's answer up to its first token. Owns `response` until handed to a relay."""

    response: StreamAnswer
    sent: float  # monotonic time the D leg was sent
    first_chunk: bytes  # D's bytes up to its first token; the whole body when not streaming
    first_token_unix: float
    chunks: AsyncIterator[bytes] | None  # the rest of the stream; None when complete


def prefill_body(body: dict[str, Any], params: Params) -> dict[str, Any]:
    """The client's request turned into a P leg: one token, no stream, router's params.
    The sampling fields stay (P samples the first token as the client asked, logprobs
    included); `min_tokens` is cut to the one token P makes."""
    out = {k: v for k, v in body.items() if k != "stream_options"}
    out.update(max_tokens=1, stream=False, kv_transfer_params=params)
    min_tokens = out.get("min_tokens")
    if type(min_tokens) is int and min_tokens > 1:
        out["min_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    return out


def decode_body(body: dict[str, Any], params: Params | None) -> dict[str, Any]:
    """The client's request with the D leg's params (any the client sent are replaced);
    without params (local prefill) a plain request."""
    if params is None:
        return {k: v for k, v in body.items() if k != "kv_transfer_params"}
    return {**body, "kv_transfer_params": params}


def pull_decode_params(prefill_params: Params) -> Params:
    """P's answer as D's params: everything P said, marked as a remote prefill."""
    out = {k: v for k, v in prefill_params.items() if k != "do_remote_decode"}
    out.update(do_remote_prefill=True, transfer_mode="pull")
    return out


def push_params(p: Instance, transfer_id: str) -> tuple[Params, Params]:
    """The (P, D) params of a push pair; P must have `can_receive_push`."""
    assert p.info is not None
    p_params = {"do_remote_decode": True, "transfer_mode": "push", "transfer_id": transfer_id}
    d_params = {
        "do_remote_prefill": True,
        "transfer_mode": "push",
        "transfer_id": transfer_id,
        "remote_engine_id": p.info.engine_id,
        "remote_incarnation": p.info.incarnation,  # a restarted P forces a re-handshake
        "remote_host": p.info.side_channel_host,
        "remote_port": p.info.side_channel_port,
    }
    return p_params, d_params


class Dispatcher:
    """Runs the legs of client requests; one per app, used only on its event loop."""

    def __init__(
        self,
        config: RouterConfig,
        upstream: Upstream,
        pool: InstancePool,
        metrics: RouterMetrics,
    ) -> None:
        self._config = config
        self._upstream = upstream
        self._pool = pool
        self._metrics = metrics
        # P legs outliving their response, and releases of P's holds in flight.
        self._background: set[asyncio.Task[Any]] = set()
        self._prefilling_locally = False  # no prefill instance left (logged on each change)
        self._vllm = config.engine == "vllm"  # vLLM's instances: vllm_legs' params

    async def dispatch(self, call: Call) -> Response:
        """The response for the client: D's stream or body, or an OpenAI-style JSON error."""
        mode: str = self._config.kv_transfer
        hop(call.request_id, "r.received")
        try:
            demand, exact = await self._demand(call)
            n = choice_count(call.body)
            if local_only_reason(call.body, call.path) is not None or not self._fans_out(call, n):
                mode = "local"
                return await self._local(call, demand, mode)
            if exact and demand.prompt_tokens < self._config.local_prefill_below:
                mode = "local"
                return await self._local(call, demand, mode)
            if self._no_prefill_left():
                mode = "local_fallback"
                return await self._local(call, demand, mode)
            if n > 1:
                return await self._choices(call, demand, n)
            return await self._disaggregated(call, demand)
        except APIError as err:
            self._metrics.requests.labels(mode, str(err.status)).inc()
            return err.response(headers={"X-Request-Id": call.request_id})
        except asyncio.CancelledError:
            self._metrics.requests.labels(mode, "client_disconnect").inc()
            raise

    async def _disaggregated(self, call: Call, demand: Demand) -> Response:
        if not self._config.concurrent_legs:
            return await self._pull(call, demand)
        return await self._push(call, demand)

    def _fans_out(self, call: Call, n: int) -> bool:
        """Whether `n` choices can go through P/D as n requests (else whole to D)."""
        return n == 1 or (not self._vllm and choices_fit(call.body, call.request_id, n))

    async def _choices(self, call: Call, demand: Demand, n: int) -> Response:
        """`n` > 1: one P/D request per choice, merged (`pdserve.router.choices`)."""

        def start(choice: ChoiceLeg) -> Awaitable[Response]:
            i = choice.index
            one = Call(
                call.path,
                choice_body(call.body, i),
                call.stream,
                choice_request_id(call.request_id, i),
                call.arrival,
                choice,
            )
            return self._disaggregated(one, demand)

        answers = await run_choices(n, start, _discard)
        headers = {"X-Request-Id": call.request_id}
        if done := answers[0].headers.get(PREFILL_DONE_HEADER):
            headers[PREFILL_DONE_HEADER] = done
        if not call.stream:
            body = merge_whole([bytes(a.body) for a in answers], call.request_id)
            return Response(body, 200, headers, answers[0].media_type)
        relays = [a.relay for a in answers if isinstance(a, RelayStreamingResponse)]
        return ChoicesStreamingResponse(relays, StreamMerge(n, call.request_id), headers)

    async def aclose(self) -> None:
        """Cancel P legs still running in the background (router shutdown)."""
        await cancel_and_wait(*self._background)

    # -- demand and local prefill ---------------------------------------------------------

    async def _demand(self, call: Call) -> tuple[Demand, bool]:
        """The request's tokens, and whether its prompt length is exact (`prompt_size`)."""
        cfg = self._config
        decode = decode_tokens(call.body, call.path, cfg.default_max_tokens)
        prompt = token_id_count(call.body)
        below = cfg.local_prefill_below
        if prompt is None and below > 0 and not certainly_not_below(call.body, below):
            prompt = await self._tokenize(call)
        chain = prefix_chain(call.body) if cfg.policy == "cache_aware" else ()
        if prompt is None:
            return Demand(estimated_prompt_tokens(call.body), decode, prefix=chain), False
        return Demand(prompt, decode, prefix=chain), True

    async def _tokenize(self, call: Call) -> int | None:
        """The prompt length from a decode instance (the one that would prefill locally)."""
        candidates = self._pool.admitted("decode")
        if not candidates:
            return None
        d = min(candidates, key=lambda i: i.outstanding)
        return await tokenized_count(
            self._upstream, d.url, call.body, self._headers(call), self._config.health_timeout_s
        )

    def _no_prefill_left(self) -> bool:
        """Whether requests must prefill on decode instances: none of prefill can take a P
        leg of this mode, but a decode instance is admitted. Logs each change."""
        pool = self._pool
        push = self._config.concurrent_legs
        gone = not pool.prefill_usable(push) and bool(pool.admitted("decode"))
        if gone != self._prefilling_locally:
            self._prefilling_locally = gone
            if gone:
                log.warning("%s", NO_PREFILL_DEGRADED)
            else:
                log.info("a prefill instance is back: disaggregating again")
        return gone

    async def _local(self, call: Call, demand: Demand, mode: str) -> Response:
        """One plain request to a decode instance, which prefills it (a short prompt, or no
        prefill instance left)."""
        d, leg = self._acquire("decode", replace(demand, local_prefill=True))
        try:
            opening = self._open_decode(d, call, None, self._headers(call))
            start = await self._on_instance("decode", d, leg, opening)
        except BaseException:
            self._pool.release(d, leg)
            raise
        return self._respond(call, mode, d, leg, start, None)

    # -- pull -----------------------------------------------------------------------------

    async def _pull(self, call: Call, demand: Demand) -> Response:
        if not self._pool.admitted("decode"):  # don't spend a prefill nobody can decode
            raise _no_instance(self._pool, "decode")
        p, p_leg = self._acquire("prefill", demand, prefer=_preferred_prefill(call))
        # A fresh transfer id: without one P would use the request id, and a client reusing
        # its X-Request-Id would collide with the previous request's hold on P.
        tid = _new_tid()
        params = {"do_remote_decode": True, "transfer_mode": "pull", "transfer_id": tid}
        if self._vllm:
            params = vllm_legs.prefill_params()
        try:
            prefill = self._prefill(p, call, params, tid)
            result = await self._on_instance("prefill", p, p_leg, prefill)
        except asyncio.CancelledError:
            self._release_later(p, tid)  # P may have finished just before the cancel reached it
            raise
        finally:
            self._pool.release(p, p_leg)
        if result.params is None:
            raise self._leg_error(
                "prefill", p, "missing_params", 502, "returned no kv_transfer_params"
            )
        try:
            return await self._pull_decode(call, demand, result, tid, p)
        except BaseException:  # no D stream: nobody will read P's hold
            self._release_later(p, tid)
            raise

    async def _pull_decode(
        self, call: Call, demand: Demand, result: PrefillResult, tid: str, p: Instance
    ) -> Response:
        """The D leg of a pull request, once P answered with `result`."""
        assert result.params is not None
        # vLLM's connectors get exactly what P returned.
        params = result.params if self._vllm else pull_decode_params(result.params)
        try:
            headers = self._leg_headers(call, params)
        except InvalidKVTransferParams as exc:
            raise self._leg_error(
                "prefill", p, "invalid_params", 502, f"returned unusable kv_transfer_params: {exc}"
            ) from None
        d, d_leg = self._acquire("decode", demand)
        try:
            opening = self._open_decode(d, call, params, headers)
            start = await self._on_instance("decode", d, d_leg, opening)
        except BaseException:
            self._pool.release(d, d_leg)
            raise
        self._observe_handoff(result, start.first_token_unix)
        hop(tid, "r.first_token", start.first_token_unix, rid=call.request_id)
        mode = self._config.kv_transfer
        return self._respond(call, mode, d, d_leg, start, None, result.prefill_done_time)

    # -- push -----------------------------------------------------------------------------

    async def _push(self, call: Call, demand: Demand) -> Response:
        prefer = _preferred_prefill(call)
        p, p_leg = self._acquire("prefill", demand, need_push_info=True, prefer=prefer)
        ready_in = self._pool.predict_prefill_s(p)
        acquired = self._pool.acquire("decode", replace(demand, ready_in_s=ready_in))
        if acquired is None:
            self._pool.release(p, p_leg)
            raise _no_instance(self._pool, "decode")
        d, d_leg = acquired
        tid = _new_tid()
        if self._vllm:  # one X-Request-Id for both legs: vLLM pairs them by it
            assert p.peer is not None  # need_push_info
            if self._config.connector == "pdserve":  # paired by the params' transfer id
                p_params, d_params = vllm_legs.pdserve_push_params(p.peer, tid)
            else:
                p_params = vllm_legs.prefill_params()
                d_params = vllm_legs.push_decode_params(p.peer, tid, call.path)
            call = replace(call, request_id=tid)
        else:
            p_params, d_params = push_params(p, tid)
        p_task = asyncio.create_task(
            self._on_instance("prefill", p, p_leg, self._prefill(p, call, p_params, tid))
        )
        p_task.add_done_callback(lambda _: self._pool.release(p, p_leg))
        d_headers = self._leg_headers(call, d_params)
        d_task = asyncio.create_task(
            self._on_instance("decode", d, d_leg, self._open_decode(d, call, d_params, d_headers))
        )
        try:
            start = await self._first_token_or_prefill_error(p_task, d_task)
        except BaseException:
            self._pool.release(d, d_leg)
            if not _failed(p_task):  # P answered, or may finish the prompt before the cancel
                self._release_later(p, tid)
            await cancel_and_wait(p_task, d_task)
            raise
        self._after_prefill(p_task, start.first_token_unix)
        if call.choice is not None:  # D has the prompt's KV: P has prefilled it
            call.choice.prefilled_on(p)
        hop(tid, "r.first_token", start.first_token_unix, rid=call.request_id)
        return self._respond(call, "push", d, d_leg, start, p_task)

    @staticmethod
    async def _first_token_or_prefill_error(
        p_task: asyncio.Task[PrefillResult], d_task: asyncio.Task[DecodeStart]
    ) -> DecodeStart:
        """D's start, unless P fails first (then P's error is raised and D is cancelled by
        the caller). D's own error is raised as is."""
        await asyncio.wait({p_task, d_task}, return_when=asyncio.FIRST_COMPLETED)
        if not d_task.done() and p_task.exception() is not None:
            raise p_task.exception()  # type: ignore[misc]
        return await d_task

    def _after_prefill(self, p_task: asyncio.Task[PrefillResult], first_token: float) -> None:
        """Record the handoff once P answers; log a P failure that came after D's first token."""

        def done(task: asyncio.Task[PrefillResult]) -> None:
            self._background.discard(task)
            if task.cancelled():
                return
            if task.exception() is not None:
                log.warning("prefill leg failed after decode started: %s", task.exception())
                return
            self._observe_handoff(task.result(), first_token)

        if p_task.done():
            done(p_task)
        else:
            self._background.add(p_task)
            p_task.add_done_callback(done)

    # -- releasing P's hold -----------------------------------------------------------------

    def _release_later(self, p: Instance, tid: str) -> None:
        """Release P's hold of `tid` in the background (module doc); vLLM's instances have
        no release (their lease frees the blocks)."""
        if self._vllm:
            return
        task = asyncio.create_task(self._release(p, tid))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _release(self, p: Instance, tid: str) -> None:
        headers = {"Content-Type": "application/json"}
        if self._config.api_key:
            headers["Authorization"] = f"Bearer {self._config.api_key}"
        if self._config.cluster_token:
            headers[SIGNATURE_HEADER] = release_signature(self._config.cluster_token, tid)
        body = msgspec.json.encode({"transfer_id": tid})
        url = f"{p.url}{RELEASE_PATH}"
        try:
            r = await self._upstream.post(
                url, body, headers, timeout_s=self._config.release_timeout_s
            )
        except UpstreamError as exc:
            log.warning("release of transfer %s on %s failed: %s", tid, p.url, exc)
            self._metrics.releases.labels("failed").inc()
            return
        if r.is_success:
            log.debug("released transfer %s on %s", tid, p.url)
            self._metrics.releases.labels("sent").inc()
            return
        snippet = r.content[:200].decode(errors="replace")
        log.warning("%s refused the release of %s: HTTP %d %s", p.url, tid, r.status, snippet)
        self._metrics.releases.labels("refused").inc()

    # -- legs -----------------------------------------------------------------------------

    def _acquire(
        self,
        role: Role,
        demand: Demand,
        *,
        need_push_info: bool = False,
        prefer: Instance | None = None,
    ) -> tuple[Instance, Leg]:
        acquired = self._pool.acquire(role, demand, need_push_info=need_push_info, prefer=prefer)
        if acquired is None:
            raise _no_instance(self._pool, role, need_push_info)
        return acquired

    async def _on_instance(self, role: Role, inst: Instance, leg: Leg, work: Awaitable[T]) -> T:
        """`work` (a step of `leg` on `inst`), ended with a leg error if `inst` is ejected
        first; `work` is then cancelled, which closes its upstream request."""
        try:
            return await until_ejected(work, leg.ejected)
        except InstanceEjected as exc:
            raise self._leg_failure(role, inst, exc) from None

    def _headers(self, call: Call) -> dict[str, str]:
        headers = {"X-Request-Id": call.request_id, "Content-Type": "application/json"}
        if self._config.api_key:
            headers["Authorization"] = f"Bearer {self._config.api_key}"
        return headers

    def _leg_headers(self, call: Call, params: Params) -> dict[str, str]:
        """A leg's headers: with a cluster token, its signature over `params` (made just
        before sending: instances refuse one older than a minute). InvalidKVTransferParams
        if `params` are not params at all (only P's answer can be that). vLLM's instances
        check no signature."""
        headers = self._headers(call)
        if self._config.cluster_token and not self._vllm:
            headers[LEG_SIGNATURE_HEADER] = sign_leg(self._config.cluster_token, params)
        return headers

    async def _prefill(self, p: Instance, call: Call, params: Params, tid: str) -> PrefillResult:
        """Send the P leg of transfer `tid` and wait for P's answer; raises APIError on any
        failure."""
        sent = time.monotonic()
        body = msgspec.json.encode(prefill_body(call.body, params))
        headers = self._leg_headers(call, params)
        try:
            r = await self._upstream.post(f"{p.url}{call.path}", body, headers)
        except UpstreamError as exc:
            raise self._transport_error("prefill", p, exc) from None
        if not r.is_success:
            raise self._status_error("prefill", p, r.status, r.content)
        self._metrics.prefill_leg.observe(time.monotonic() - sent)
        hop(tid, "r.p_answer")
        params_back = _json_object(r.content).get("kv_transfer_params")
        if not isinstance(params_back, dict):
            return PrefillResult(None, None)
        if call.choice is not None:
            call.choice.prefilled_on(p)
        done = params_back.get("prefill_done_time")
        if not isinstance(done, int | float):
            done = time.time() if self._vllm else None  # vLLM's P does not say when
        return PrefillResult(params_back, done)

    async def _open_decode(
        self, d: Instance, call: Call, params: Params | None, headers: dict[str, str]
    ) -> DecodeStart:
        """Send the D leg (`headers`: signed for `params`) and read up to its first token
        (all of it when not streaming). Closes D's response itself if it fails or is
        cancelled on the way."""
        sent = time.monotonic()
        hop(call.request_id, "r.d_leg_sent")
        body = msgspec.json.encode(decode_body(call.body, params))
        try:
            response = await self._upstream.open_stream(f"{d.url}{call.path}", body, headers)
        except UpstreamError as exc:
            raise self._transport_error("decode", d, exc) from None
        try:
            return await self._read_start(d, response, sent, call.stream)
        except BaseException:
            response.close()
            raise

    async def _read_start(
        self, d: Instance, response: StreamAnswer, sent: float, stream: bool
    ) -> DecodeStart:
        try:
            if not response.is_success:
                raise self._status_error("decode", d, response.status, await response.read())
            if not stream:
                body = await response.read()
                self._metrics.decode_first_token.observe(time.monotonic() - sent)
                return DecodeStart(response, sent, body, time.time(), None)
            chunks = response.chunks()
            first = await _read_until_started(chunks)
        except UpstreamError as exc:
            raise self._transport_error("decode", d, exc) from None
        self._metrics.decode_first_token.observe(time.monotonic() - sent)
        return DecodeStart(response, sent, first, time.time(), chunks)

    # -- responses ------------------------------------------------------------------------

    def _respond(
        self,
        call: Call,
        mode: str,
        d: Instance,
        leg: Leg,
        start: DecodeStart,
        p_task: asyncio.Task[PrefillResult] | None,
        prefill_done: float | None = None,
    ) -> Response:
        """D's answer for the client. P's prefill-done time goes out as a header when known
        now (pull, or push when P already answered), else in the stream (`DecodeRelay`)."""
        self._metrics.time_to_first_token.observe(time.monotonic() - call.arrival)
        hop(call.request_id, "r.respond")
        relay = DecodeRelay(
            self._pool,
            self._metrics,
            mode,
            lambda exc: self._leg_failure("decode", d, exc),
            self._config.ejected_stream_grace_s,
            d,
            leg,
            start,
            p_task,
        )
        status = start.response.status
        headers = {"X-Request-Id": call.request_id}
        done_time = _prefill_done_time(p_task) if p_task is not None else prefill_done
        if done_time is not None:
            headers[PREFILL_DONE_HEADER] = f"{done_time:.6f}"
            relay.prefill_done_reported = True
        media_type = start.response.content_type
        if start.chunks is None:
            relay.finish(str(status))
            return Response(start.first_chunk, status, headers, media_type)
        return RelayStreamingResponse(relay, status, headers, media_type)

    def _observe_handoff(self, result: PrefillResult, first_token_unix: float) -> None:
        if result.prefill_done_time is not None:
            self._metrics.handoff.observe(max(0.0, first_token_unix - result.prefill_done_time))

    def _leg_error(self, leg: str, inst: Instance, reason: str, status: int, what: str) -> APIError:
        self._metrics.leg_errors.labels(leg, reason).inc()
        return APIError(status, f"{leg} instance {inst.url} {what}")

    def _leg_failure(
        self, leg: str, inst: Instance, exc: UpstreamError | InstanceEjected
    ) -> APIError:
        """The error for a leg that failed on the wire or whose instance was ejected."""
        if isinstance(exc, InstanceEjected):
            return self._leg_error(leg, inst, "ejected", 502, EJECTED_REASON)
        return self._transport_error(leg, inst, exc)

    def _transport_error(self, leg: str, inst: Instance, exc: UpstreamError) -> APIError:
        if isinstance(exc, UpstreamTimeout):
            what = f"timed out ({type(exc).__name__}, limit {self._config.request_timeout_s:g} s)"
            return self._leg_error(leg, inst, "timeout", 504, what)
        reason = "connect" if isinstance(exc, UpstreamConnectError) else "protocol"
        return self._leg_error(leg, inst, reason, 502, f"failed: {type(exc).__name__}: {exc}")

    def _status_error(self, leg: str, inst: Instance, status: int, content: bytes) -> APIError:
        """An upstream 4xx (the client's mistake) is relayed with its status and error body;
        an upstream 5xx or a body that is not an OpenAI-style error becomes a 502 that names
        the leg, the instance and its status."""
        self._metrics.leg_errors.labels(leg, "http_status").inc()
        err = _json_object(content).get("error")
        if not (isinstance(err, dict) and isinstance(err.get("message"), str)):
            snippet = content[:200].decode(errors="replace")
            return APIError(502, f"{leg} instance {inst.url} answered HTTP {status}: {snippet}")
        if status < 500:
            return APIError(
                status,
                err["message"],
                type=err.get("type"),
                param=err.get("param"),
                code=err.get("code"),
            )
        message = f"{leg} instance {inst.url} answered HTTP {status}: {err['message']}"
        return APIError(502, message, type=err.get("type"), code=err.get("code"))


class DecodeRelay:
    """Streams D's body to the client. Owns D's response and D's leg from
    `Dispatcher._respond` until `close`/`finish`; in push mode also decides the P leg's fate
    (cancelled unless the request succeeded)."""

    def __init__(
        self,
        pool: InstancePool,
        metrics: RouterMetrics,
        mode: str,
        on_error: Callable[[UpstreamError | InstanceEjected], APIError],
        ejected_grace_s: float,
        d: Instance,
        leg: Leg,
        start: DecodeStart,
        p_task: asyncio.Task[PrefillResult] | None,
    ) -> None:
        self._pool = pool
        self._leg = leg
        self._metrics = metrics
        self._mode = mode
        self._on_error = on_error
        self._ejected_grace_s = ejected_grace_s
        self._d = d
        self._start = start
        self._p_task = p_task
        self._finished = False
        self._annotator: EventAnnotator | None = None
        self._whole = CompleteEvents()
        self.prefill_done_reported = False  # set by the dispatcher when it sent the header

    def head(self) -> bytes:
        """The whole events of D's start (up to its first token), to send with the status
        line; call once, before `chunks`."""
        return self._whole.feed(self._annotated(self._start.first_chunk))

    async def chunks(self) -> AsyncGenerator[bytes, None]:
        """D's chunks after `head`, as they come; an upstream failure, or D's ejection
        followed by `ejected_grace_s` of silence, ends the stream with an SSE `error` event
        (the status line has already gone out)."""
        outcome = "client_disconnect"  # what a cancellation or early close means
        hop("relay", "r.chunks_start")
        ejected = asyncio.ensure_future(self._leg.ejected.wait())
        assert self._start.chunks is not None
        watch = StreamWatch(self._start.chunks, ejected, self._ejected_grace_s)
        whole = self._whole
        try:
            while (chunk := await watch.next()) is not None:
                if out := whole.feed(self._annotated(chunk)):
                    yield out
            tail = self._annotator.flush() if self._annotator is not None else b""
            if out := whole.feed(tail) + whole.flush():
                yield out
            outcome = str(self._start.response.status)
        except (UpstreamError, InstanceEjected) as exc:
            # Half an event may be held in `whole`: dropped, so the error event stands alone.
            outcome = "ejected" if isinstance(exc, InstanceEjected) else "stream_error"
            yield data_event_bytes(msgspec.json.encode(self._on_error(exc).body()))
        finally:
            watch.close()
            ejected.cancel()
            self.close(outcome)

    def _annotated(self, chunk: bytes) -> bytes:
        """`chunk`, with P's prefill-done time added to the next event once P has answered
        (push mode, when it was not known in time for the header)."""
        if self._annotator is None and not self.prefill_done_reported and self._p_task is not None:
            done = _prefill_done_time(self._p_task)
            if done is not None:
                self._annotator = EventAnnotator({"prefill_done": done})
                self.prefill_done_reported = True
        return self._annotator.feed(chunk) if self._annotator is not None else chunk

    def close(self, outcome: str) -> None:
        """Close D's response (aborting it on D if unfinished), then `finish`; idempotent."""
        self._start.response.close()
        self.finish(outcome)

    def finish(self, outcome: str) -> None:
        """Give back D and record the request, once."""
        if self._finished:
            return
        self._finished = True
        self._pool.release(self._d, self._leg)
        self._metrics.decode_leg.observe(time.monotonic() - self._start.sent)
        self._metrics.requests.labels(self._mode, outcome).inc()
        p = self._p_task
        if p is not None and not p.done() and not outcome.startswith("2"):
            p.cancel()


class RelayStreamingResponse(StreamingResponse):
    """A StreamingResponse that sends the status line and D's first token at once, then the
    rest of D's stream; and that always closes its relay: also when the client vanished
    while a send was blocked (Starlette then leaves the iterator suspended) or before the
    iterator ever started (then its `finally` would never run).

    The first token is already in hand when the response starts, so it goes out from the
    calling task: Starlette would first start a task group and a task for the body, which
    on the router's shared core cost the first token a loop iteration and ~0.4 ms of CPU."""

    def __init__(
        self, relay: DecodeRelay, status: int, headers: dict[str, str], media_type: str | None
    ) -> None:
        self.relay = relay
        self._chunks: AsyncGenerator[bytes, None] = relay.chunks()
        self._started = False
        super().__init__(self._chunks, status, headers, media_type or "text/event-stream")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        hop("relay", "r.asgi_call")
        try:
            await self._send_head(send)
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._chunks.aclose()
            self.relay.close("client_disconnect")

    async def _send_head(self, send: Send) -> None:
        start = {"type": "http.response.start", "status": self.status_code}
        await send({**start, "headers": self.raw_headers})
        self._started = True
        if head := self.relay.head():
            hop("relay", "r.relay_first")
            await send({"type": "http.response.body", "body": head, "more_body": True})

    async def stream_response(self, send: Send) -> None:
        """Starlette's, without the status line when `_send_head` sent it."""
        if not self._started:
            start = {"type": "http.response.start", "status": self.status_code}
            await send({**start, "headers": self.raw_headers})
            self._started = True
        async for chunk in self.body_iterator:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _read_until_started(chunks: AsyncIterator[bytes]) -> bytes:
    """D's bytes up to and including its first substantive SSE event (see `sse`); the
    iterator is left open for the relay."""
    detector = StreamStartDetector()
    held = []
    async for chunk in chunks:
        held.append(chunk)
        if detector.feed(chunk):
            break
    return b"".join(held)


def _preferred_prefill(call: Call) -> Instance | None:
    """The prefill instance a choice after the first goes to (the first choice's)."""
    return call.choice.prefill if call.choice is not None else None


def _discard(answer: Response) -> None:
    """Close a started choice whose siblings failed (aborting its stream on D)."""
    if isinstance(answer, RelayStreamingResponse):
        answer.relay.close("choice_failed")


def _prefill_done_time(p_task: asyncio.Task[PrefillResult]) -> float | None:
    """P's prefill-done time if its leg has answered successfully, else None."""
    if not p_task.done() or p_task.cancelled() or p_task.exception() is not None:
        return None
    return p_task.result().prefill_done_time


def _failed(p_task: asyncio.Task[PrefillResult]) -> bool:
    """Whether the P leg ended with its own error (then P holds nothing for it)."""
    return p_task.done() and not p_task.cancelled() and p_task.exception() is not None


def _new_tid() -> str:
    return uuid.uuid4().hex


def _no_instance(pool: InstancePool, role: Role, need_push_info: bool = False) -> APIError:
    """A 503 naming the problem, including instances refused for not fitting the cluster
    (an operator's mistake must not look like the client's)."""
    detail = " with a known side channel (/kv/info)" if need_push_info else ""
    message = f"no healthy {role} instance{detail} is available"
    refused = "; ".join(f"{i.url}: {r.detail}" for i, r in pool.refusals(role))
    if refused:
        message += f" (refused as not fitting the cluster: {refused})"
    return APIError(503, message)


def _json_object(content: bytes) -> dict[str, Any]:
    try:
        value = msgspec.json.decode(content)
    except msgspec.DecodeError:
        return {}
    return value if isinstance(value, dict) else {}


async def cancel_and_wait(*tasks: asyncio.Task[Any]) -> None:
    """Cancel tasks and wait until they have ended, consuming their outcomes."""
    pending = [t for t in tasks if not t.done()]
    for t in pending:
        t.cancel()
    if pending:
        await asyncio.wait(pending)
    for t in tasks:
        if not t.cancelled():
            t.exception()  # mark as retrieved: the error was already reported or is moot
