"""Push mode: D registers its blocks early; a writer thread on P WRITEs into them.

D (engine thread): `start_receive` reserves the blocks (already allocated at
  admission) and hands the registration to the lane of its prefill instance.
D (registration lanes, pdserve.transfer.lanes): one thread per prefill instance
  (side-channel address), created on demand and gone after `LANE_IDLE_S` without work,
  handshakes with P on first contact (or after P restarted) and sends that instance's
  PushRegistrations in order, so an unreachable P (a handshake that times out) delays
  only its own requests. A registration is sent at most once, and only while its request
  still waits; one cancelled before it was sent is never sent, and its quarantine ends at
  once, since P cannot know D's blocks without it. A notification poller
  thread waits for the WRITE's notification (PushDone, delivered by the transport only
  after the data) and reports the arrival. PushFailed from P fails the request at once.
  `cancel_receive` (abort or watchdog) fences the blocks in quarantine and sends
  PushAbort; P answers PushAbortAck once no write for that transfer is or will be in
  flight, and only then do the blocks return to the engine.
P (engine thread): `prefill_done` moves the blocks to `Hold(tid)` (no engine-side
  lease: the writer owns the deadline) and hands them to the writer at once, in the
  same step, not in the next step's metadata.
P (writer thread): pairs registrations and finished prompts by transfer id, in either
  order; posts the WRITE with PushDone as its notification; frees the hold when it
  completes; sends PushFailed to D when the prompt failed, the write failed, the
  prompt never finished (`registration_ttl_s`, counted once it is not queued or computing
  here) or never came at all (`unknown_transfer_grace_s`: no P leg announced that
  transfer id; D's registration may come before P's own leg, so not at once); frees
  prompts nobody registered for after `lease_s`. PushFailed carries its cause
  (messages.PushFailCause). A registration paired with its finished prompt claims the
  hold (`_claim_hold`): it no longer counts against P's cap on unclaimed holds.
  Fencing rule: after PushAbort, a transfer is never posted; one already in
  flight is acknowledged only when the transport reports it finished.
  Layer-wise (`push_layerwise`): the step that completes a prompt hands the writer each
  layer as its forward pass ends; the writer posts it at once if D's registration is
  there, else keeps it until the registration comes (D's registration and P's step race
  when the router sends both legs at once), and sends PushDone as a notification once the
  prompt is done and every layer's write is DONE. "Done" is `prefill_done`, or, for an
  engine that passes no first token (vLLM), the hook's last layer
  (`done_after_last_layer`): its `prefill_done` comes a step or two later and then only
  frees the hold (`_WriterState.early_done`). A prompt that ends before its registration
  comes goes as one write, as above.
P (writer thread), the router's release (`release_transfer`, queued to the writer, which
  alone knows what is posted): a finished prompt not posted yet is freed at once; one
  still computing is marked and freed when it finishes; a transfer with a write in flight
  or streaming is left alone (it completes, or D aborts it); a registration with nothing
  posted is dropped and D told (PushFailed), so D fails at once instead of at its
  watchdog. A registration that comes after the release gets the same PushFailed.
P (engine thread), a prompt that fails after a layer hook was made for it (the engine
  aborted it; vLLM lends its blocks then, see pdserve.vllm.transfers): layer writes posted
  from its blocks may still be reading them, so `prefill_failed` takes them (`Hold`, no
  lease) and the writer frees them once no layer write of it is pending (at once when none
  was posted); D gets PushFailed as for any failed prompt.
P (completion watcher thread): blocks on each posted write until the transport finishes it
  and then wakes the writer, so the writer sleeps on its inbox instead of polling every
  millisecond while writes are in flight (that poll took P's core and GIL from prefill).
  The tcp transport's wait is a condition variable; nixl needs polling to make progress, so
  there the watcher polls (every `_NIXL_POLL_S`), on its own thread.
Idle, no thread of this module wakes: the writer waits on its inbox until its next deadline
  (`_writer_next_deadline`; none: until an item comes), the watcher until a write is posted,
  D's notification poller until a registration is queued or out (only then can a
  notification matter, and only then must nixl be polled); `close` wakes each of them.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from pdserve.logsafe import shown
from pdserve.threads import Thread
from pdserve.token_logprob import TokenLogprob
from pdserve.tracelog import hop
from pdserve.transfer import messages as m
from pdserve.transfer.adapter import RemoteRequest, remote_address_of
from pdserve.transfer.connector import (
    Arrived,
    Failed,
    KVConnector,
    ReleaseHold,
    ReleaseQuarantine,
    TransferError,
    WriterStats,
)
from pdserve.transfer.descriptors import nbytes
from pdserve.transfer.errors import TransferCause
from pdserve.transfer.lanes import Lanes
from pdserve.transfer.messages import PushFailCause as Why
from pdserve.transfer.params import KVTransferParams
from pdserve.transfer.side_channel import Address
from pdserve.transfer.transport import TransferState

log = logging.getLogger(__name__)

# How long one wait on a posted write lasts before the watcher checks `_stop` again (tcp
# wakes at once when the write finishes; only while a write is pending, never idle).
_WRITE_WAKE_S = 0.05
# D's notification poller, while registrations are out: how long one wait lasts (tcp wakes
# at once on a notification; nixl must be polled to make progress, so it polls meanwhile).
_NOTIF_WAKE_S = 0.05
_DEADLINE_SLACK_S = 0.001  # past a deadline, so its strict comparison holds when swept
_RETRY_S = 0.05  # after a writer step that failed (a bug): sweep again this soon
_NIXL_POLL_S = 0.001
MAX_LANES = 64  # prefill instances D registers with at once; more fail at once
LANE_IDLE_S = 30.0  # a registration lane's thread ends after this long without a job


class _WriteDone:
    """Watcher -> writer: a posted write finished (the writer polls and releases it)."""


@dataclass
class _Finished:
    transfer_id: str
    blocks: list[int]
    num_tokens: int
    first_token_id: int | None
    done_time: float
    ready_at: float  # when the writer took it (monotonic)
    first_token_logprobs: TokenLogprob | None = None


@dataclass
class _PrefillFailed:
    transfer_id: str
    reason: str
    held: bool = False  # its blocks are under `Hold` until no layer write reads them


@dataclass
class _RouterRelease:
    """P engine thread -> writer: the router will send no decode leg for this transfer."""

    transfer_id: str


RELEASED_REASON = "the router released this transfer (its request ended before decoding)"


@dataclass
class _InFlight:
    reg: m.PushRegistration
    handle: object
    started: float
    nbytes: int
    ndesc: int
    aborted: bool = False


@dataclass
class _LayerReady:
    """P engine thread -> writer: `layer` of these prompt blocks is final."""

    transfer_id: str
    layer: int
    blocks: list[int]
    num_tokens: int


@dataclass
class _LayersDone:
    """P engine thread -> writer: every layer of a prompt whose engine passes no first
    token (`layer_hook(..., done_after_last_layer=True)`) was handed over."""

    transfer_id: str
    blocks: list[int]
    num_tokens: int
    done_time: float  # unix time


@dataclass
class _Stream:
    """Writer: a prompt whose layers are being written as they are computed."""

    reg: m.PushRegistration
    handles: list[object]
    started: float
    nbytes: int = 0
    ndesc: int = 0
    error: str | None = None
    why: Why = Why.WRITE_FAILED  # the cause of `error`
    fin: _Finished | None = None
    aborted: bool = False
    held: bool = False  # its prompt failed and its blocks are held until this stream ends
    # `fin` came from the last layer (`_LayersDone`), not from `prefill_done`: no hold is
    # behind it yet; the one `prefill_done` makes later is freed at once (`early_done`).
    early: bool = False
    owes_hold: bool = False  # `prefill_done`'s hold was paired with it: freed at its end

    def fail(self, error: str, why: Why) -> None:
        """Record the first failure (D is told once the layer writes in flight are done)."""
        if self.error is None:
            self.error, self.why = error, why


@dataclass
class _Waiting:
    """P writer: a registration waiting for its prompt."""

    reg: m.PushRegistration
    since: float  # when it came (monotonic)
    seen: bool = False  # its prompt was seen queued or computing here since then


@dataclass
class _Register:
    transfer_id: str
    peer: tuple[str, Address, str | None]  # P's engine id, side channel, incarnation
    msg: m.PushRegistration

    @property
    def address(self) -> Address:
        return self.peer[1]


class PushConnector(KVConnector):
    """Push: the prefill side writes into blocks the decode side registered."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._inbox: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._posted: queue.SimpleQueue[object] = queue.SimpleQueue()  # writer -> watcher
        self._stop = threading.Event()
        # D: registrations queued on a lane, not sent yet (transfer id -> P's side channel),
        # and those sent (so P may write; an abort must be fenced). Moving a transfer id
        # from one to the other (lane) and taking it out of either (cancel) happen under
        # `_reg_lock`, so a registration is never sent after its request was cancelled.
        self._unsent: dict[str, Address] = {}
        self._p_of: dict[str, Address] = {}
        self._reg_lock = threading.Lock()
        # D's notification poller waits on this while no registration is queued or out.
        self._expecting = threading.Condition(self._reg_lock)
        self._lanes: Lanes[_Register] = Lanes(
            self._register, "pdserve-push-reg", MAX_LANES, LANE_IDLE_S
        )
        # P (engine thread): prompts a layer hook was made for, until they end: their layer
        # writes may be in flight, so a failed one's blocks are held (`_prefill_failed`).
        self._layered: set[str] = set()
        # P: transfer ids whose registration arrived and the writer has not taken yet (what
        # tests wait on to know that D's registration reached P).
        self._registered: set[str] = set()
        self.writer_stats = WriterStats()
        # Only the role's threads. Idle, none of them wakes: the writer sleeps until its next
        # deadline (none: until an item comes), the watcher until a write is posted, D's
        # notification poller until a registration is queued; `close` wakes them all.
        loops = []
        if self.cfg.role != "decode":  # P writes and watches its writes
            loops += [(self._writer_loop, "writer"), (self._watch_loop, "watch")]
        if self.cfg.role != "prefill":  # D receives P's completion notifications
            loops.append((self._notif_loop, "notif"))
        self._threads = [
            Thread(target=loop, name=f"pdserve-push-{name}", daemon=True) for loop, name in loops
        ]
        for t in self._threads:
            t.start()

    # == D side ===========================================================================
    def start_receive(self, req: RemoteRequest) -> None:
        super().start_receive(req)
        p = req.params
        assert p.remote_host and p.remote_port and p.remote_engine_id
        tid = req.transfer_id
        reg = m.PushRegistration(
            transfer_id=tid,
            engine_id=self.cfg.engine_id,
            incarnation=self.cfg.incarnation,
            reply_to=self.side.address,
            block_ids=list(req.block_ids[req.num_cached_blocks :]),
            num_tokens=req.num_tokens,
            skip_blocks=req.num_cached_blocks,
        )
        peer = (p.remote_engine_id, (p.remote_host, p.remote_port), p.remote_incarnation)
        job = _Register(tid, peer, reg)
        with self._expecting:  # `_reg_lock`: wakes the notification poller
            self._unsent[tid] = job.address
            self._expecting.notify_all()
        if not self._lanes.submit(job.address, job):
            with self._reg_lock:
                self._unsent.pop(tid, None)
            what = f"already registering with {len(self._lanes)} prefill instances (the most)"
            self.report(Failed(tid, f"push registration refused: {what}", TransferCause.OVERLOADED))

    def _register(self, job: _Register) -> None:
        """Handshake if needed, then send one registration (its lane's thread); never raises."""
        tid = job.transfer_id

        def wanted() -> bool:
            return tid in self._unsent

        try:
            if self.cfg.faults.register_delay_s:  # fault injection (tests): arrival order
                time.sleep(self.cfg.faults.register_delay_s)
            if not wanted():
                return  # cancelled while queued: no handshake for a request that is gone
            peer = self.peer(*job.peer, wanted=wanted)
        except Exception as exc:
            with self._reg_lock:
                waiting = self._unsent.pop(tid, None) is not None
            if waiting:  # else cancelled meanwhile: its request has already ended
                cause = (
                    exc.cause if isinstance(exc, TransferError) else TransferCause.TRANSFER_FAILED
                )
                self._warn[cause].warning("push registration %s failed: %s", shown(tid), exc)
                where = f"{job.address[0]}:{job.address[1]}"
                self.report(Failed(tid, f"push registration with {where} failed: {exc}", cause))
            return
        try:
            with self._reg_lock:
                if self._unsent.pop(tid, None) is None:
                    return  # cancelled while queued or handshaking: never tell P
                self._p_of[tid] = peer.address
                self.side.send(peer.address, job.msg)
        except Exception:  # the registration may be out: the watchdog and abort fence it
            log.exception("push registration %s: could not send it", shown(tid))

    def _notif_loop(self) -> None:
        """D: report P's PushDone notifications. Only while a registration is queued or out
        (`_unsent`, `_p_of`) can one matter, and only then does nixl need polling for the
        data to land; otherwise this blocks until `start_receive` or `close` wakes it (a
        notification for a request already ended waits in the transport meanwhile, and is
        stale when taken: its request no longer waits)."""
        while not self._stop.is_set():
            with self._expecting:
                self._expecting.wait_for(
                    lambda: self._stop.is_set() or bool(self._unsent or self._p_of)
                )
            if self._stop.is_set():
                break
            for raw in self.transport.wait_notifs(_NOTIF_WAKE_S):
                try:
                    msg = m.decode(raw)
                except (msgspec.DecodeError, msgspec.ValidationError):
                    log.warning("push: dropped a malformed notification")
                    continue
                if isinstance(msg, m.PushDone):
                    hop(msg.transfer_id, "d.notif_thread")
                    self._p_of.pop(msg.transfer_id, None)
                    lp = msg.first_token_logprobs
                    self.report(
                        Arrived(msg.transfer_id, msg.first_token_id, msg.prefill_done_time, lp)
                    )

    def _abandon(self, tid: str, req: RemoteRequest) -> None:
        """D: its peer is gone: a registration not sent yet never will be (module doc)."""
        with self._reg_lock:
            self._unsent.pop(tid, None)
            self._p_of.pop(tid, None)

    def _on_peer_gone(self, address: Address) -> None:
        self._lanes.drop(address)

    def _on_cancel(self, tid: str) -> None:
        with self._reg_lock:
            self._unsent.pop(tid, None)
            to = self._p_of.pop(tid, None)
        if to is None:  # P never got our blocks (or is done with them): nothing can land
            self.report(ReleaseQuarantine(tid))
            return
        abort = m.PushAbort(
            transfer_id=tid,
            engine_id=self.cfg.engine_id,
            incarnation=self.cfg.incarnation,
            reply_to=self.side.address,
        )
        self.side.send(to, abort)

    def decode_waiting(self, tid: str) -> bool:
        return tid in self._registered

    def decline_transfer(self, params: KVTransferParams) -> None:
        """D: this leg will not load its KV after all: P frees the prompt's blocks (or drops
        them as soon as they are made) and answers PushAbortAck, which finds no quarantine."""
        address = remote_address_of(params)
        if address is None or not params.transfer_id:
            return
        abort = m.PushAbort(
            transfer_id=params.transfer_id,
            engine_id=self.cfg.engine_id,
            incarnation=self.cfg.incarnation,
            reply_to=self.side.address,
        )
        self.side.send(address, abort)

    # == both sides: side channel =========================================================
    def on_message(self, msg: m.Message) -> None:
        if isinstance(msg, m.PushFailed):  # D
            to = self._p_of.pop(msg.transfer_id, None)
            if msg.unknown_peer and to is not None:
                self._forget_peer(to)  # P restarted and lost us: handshake again next time
            reason = f"prefill instance: {shown(msg.reason, 400)}"
            self.report(Failed(msg.transfer_id, reason, msg.cause.client_cause()))
        elif isinstance(msg, m.PushAbortAck):  # D
            self.report(ReleaseQuarantine(msg.transfer_id))
        elif isinstance(msg, (m.PushRegistration, m.PushAbort)):  # P
            if isinstance(msg, m.PushRegistration):
                # Before the put: the writer discards it once it took the registration.
                self._registered.add(msg.transfer_id)
            self._inbox.put(msg)

    # == P side: engine thread ============================================================
    def prefill_admitted(self, req: RemoteRequest) -> None:
        """P: also wake the writer if D's registration for it waits already: the writer
        sweeps only at deadlines, and must see the prompt alive before the registration's
        `unknown_transfer_grace_s` ends (`_writer_next_deadline`)."""
        super().prefill_admitted(req)
        if req.transfer_id in self._registered:
            self._inbox.put(_WriteDone())

    def _prefill_done(self, req: RemoteRequest, first_token: int | None) -> KVTransferParams:
        self._layered.discard(req.transfer_id)
        h = self.hold(req, first_token, time.time(), lease=False)
        hop(h.transfer_id, "p.prefill_done", h.done_time)
        fin = _Finished(
            h.transfer_id,
            list(h.blocks),
            h.num_tokens,
            first_token,
            h.done_time,
            time.monotonic(),
            req.last_logprob,
        )
        if self.cfg.faults.finish_delay_s:  # fault injection (tests): D registers first
            late = threading.Timer(self.cfg.faults.finish_delay_s, self._inbox.put, (fin,))
            late.daemon = True
            late.start()
        else:
            self._inbox.put(fin)
        return KVTransferParams(
            transfer_mode="push",
            transfer_id=h.transfer_id,
            remote_num_tokens=h.num_tokens,
            prefill_done_time=h.done_time,
        )

    def _prefill_failed(self, req: RemoteRequest, reason: str) -> None:
        """Tell the writer (D is told at once). A prompt whose layers may have been handed
        to the writer (`layer_hook`) may have writes in flight that read its blocks: the
        core takes them (`Hold`, no lease) and the writer frees them once no posted layer
        write is pending (at once if none was posted)."""
        tid = req.transfer_id
        held = False
        if tid in self._layered:
            self._layered.discard(tid)
            held = self.hold_failed(req)
        self._inbox.put(_PrefillFailed(tid, reason, held))

    def release_transfer(self, tid: str) -> None:
        """P: hand the router's release to the writer (module doc); D has no writer."""
        if self.cfg.role != "decode":
            self._inbox.put(_RouterRelease(tid))

    def layer_hook(
        self, reqs: list[RemoteRequest], done_after_last_layer: bool = False
    ) -> Callable[[int], None] | None:
        """Stream these prompts one layer at a time (engine thread).

        Whether D's registration is already here does not matter: the router sends both legs
        at once, so for a prompt of one chunk D's registration usually reaches P a few ms
        after P has scheduled the whole prompt. The writer keeps the layers finished before
        the registration and posts them when it comes (`_WriterState.early`).

        `done_after_last_layer`: the engine passes no first token to `prefill_done` (vLLM,
        whose D computes the prompt's last token again). Then once the hook has seen every
        layer, PushDone follows the layer writes at once, instead of waiting for
        `prefill_done`, which such an engine may call a step or two later (vLLM: after the
        next prompt's forward pass); that call then only hands the blocks back. Only when
        D's registration came before the last layer; else the prompt goes whole after
        `prefill_done`, as without layers.
        """
        if not self.cfg.push_layerwise or self.cfg.faults.finish_delay_s or not reqs:
            return None
        jobs = [(r.transfer_id, list(r.block_ids), r.num_tokens) for r in reqs]
        self._layered.update(tid for tid, _, _ in jobs)
        seen: set[int] = set()
        num_layers = self.kv.num_layers

        def on_layer_done(layer: int) -> None:
            for tid, blocks, n in jobs:
                self._inbox.put(_LayerReady(tid, layer, blocks, n))
            seen.add(layer)
            if done_after_last_layer and len(seen) == num_layers:
                done = time.time()
                for tid, blocks, n in jobs:
                    self._inbox.put(_LayersDone(tid, blocks, n, done))

        return on_layer_done

    # == P side: writer thread ============================================================
    def _writer_loop(self) -> None:
        w = _WriterState()
        wake_at: float | None = None  # the next deadline the writer sweeps; None: none
        while not self._stop.is_set():
            # Blocks until an item comes (the watcher's `_WriteDone`, a message, `close`'s
            # sentinel) or the next deadline passes; with no deadline, until an item comes.
            timeout = None if wake_at is None else max(0.0, wake_at - time.monotonic())
            try:
                item = self._inbox.get(timeout=timeout)
            except queue.Empty:
                item = None
            try:
                if item is not None and not isinstance(item, _WriteDone):
                    self._writer_take(w, item)
                self._writer_pair(w)
                self._writer_poll(w)
                now = time.monotonic()
                self._writer_expire(w, now)
                wake_at = self._writer_next_deadline(w, now)
            except Exception:
                log.exception("push writer step failed")
                wake_at = time.monotonic() + _RETRY_S
            self.writer_stats.queue_depth = (
                len(w.regs) + len(w.finished) + len(w.inflight) + len(w.streams)
            )

    def _writer_take(self, w: _WriterState, item: object) -> None:
        now = time.monotonic()
        if self._writer_take_released(w, item):
            return
        if isinstance(item, m.PushRegistration):
            w.regs[item.transfer_id] = _Waiting(item, now)
            for layer in w.early.pop(item.transfer_id, []):
                self._post_layer(w, layer)
        elif isinstance(item, _Finished):
            hop(item.transfer_id, "p.writer_fin")
            if w.early_done.pop(item.transfer_id, None) is not None:
                # D was told after the last layer: nothing reads these blocks any more.
                self.report(ReleaseHold(item.transfer_id, "layer-wise write finished"))
                return
            # Layers nobody registered for while the prompt ran: the whole prompt goes in
            # one write when the registration comes.
            w.early.pop(item.transfer_id, None)
            item.ready_at = now
            w.finished[item.transfer_id] = item
        elif isinstance(item, _PrefillFailed):
            w.early.pop(item.transfer_id, None)
            w.early_done.pop(item.transfer_id, None)
            stream = w.streams.get(item.transfer_id)
            if stream is not None:  # D is told once the layer writes in flight are done
                stream.fail(item.reason, Why.PREFILL_FAILED)
                stream.held = item.held  # and the blocks freed then (`_end_stream`)
            else:
                ttl = now + self.cfg.registration_ttl_s
                w.failed[item.transfer_id] = (item.reason, ttl)
                if item.held:  # no layer write of it is pending: nothing reads its blocks
                    self.report(ReleaseHold(item.transfer_id, "prefill failed"))
        elif isinstance(item, m.PushAbort):
            self._writer_abort(w, item)
        elif isinstance(item, _LayerReady):
            self._post_layer(w, item)
        elif isinstance(item, _LayersDone):
            self._writer_layers_done(w, item, now)

    def _writer_layers_done(self, w: _WriterState, item: _LayersDone, now: float) -> None:
        """Every layer of a prompt is posted (`layer_hook`'s `done_after_last_layer`): its
        stream ends, with PushDone, once those writes are DONE."""
        hop(item.transfer_id, "p.layers_done")
        st = w.streams.get(item.transfer_id)
        if st is None or st.fin is not None:
            return  # no registration yet: the prompt goes whole after `prefill_done`
        st.fin = _Finished(
            item.transfer_id, item.blocks, item.num_tokens, None, item.done_time, now
        )
        st.early = True

    def _writer_take_released(self, w: _WriterState, item: object) -> bool:
        """Handle `item` if it is the router's release or concerns a released transfer."""
        if isinstance(item, _RouterRelease):
            self._writer_release(w, item.transfer_id)
            return True
        tid = getattr(item, "transfer_id", None)
        if tid not in w.released:
            return False
        if isinstance(item, m.PushRegistration):  # D registered after the release
            self._registered.discard(tid)
            self._fail_remote(item, RELEASED_REASON, Why.RELEASED)
        elif isinstance(item, _Finished):
            self._release_for_router(tid)
        elif not isinstance(item, _LayerReady):  # layers of a released prompt are dropped
            return False
        return True

    def _writer_release(self, w: _WriterState, tid: str) -> None:
        """The router's release of `tid`, by the writer's state of it (module doc)."""
        if tid in w.inflight or tid in w.streams:
            return  # a write is on its way: it completes, or D aborts it
        w.released[tid] = time.monotonic() + self.cfg.registration_ttl_s
        w.early.pop(tid, None)
        entry = w.regs.pop(tid, None)
        if entry is not None:  # D waits for a write that will never come: tell it now
            self._registered.discard(tid)
            self._fail_remote(entry.reg, RELEASED_REASON, Why.RELEASED)
        if w.finished.pop(tid, None) is not None:
            self._release_for_router(tid)

    def _release_for_router(self, tid: str) -> None:
        self.stats.released_by_router += 1
        self.report(ReleaseHold(tid, "released by the router"))

    def _writer_pair(self, w: _WriterState) -> None:
        now = time.monotonic()
        for tid in [t for t in w.finished if t in w.streams]:
            st = w.streams[tid]
            st.fin, st.owes_hold = w.finished.pop(tid), True
            self._claim_hold(tid, st.reg)
        for tid in list(w.regs):
            reg, t_reg = w.regs[tid].reg, w.regs[tid].since
            if tid in w.failed:
                del w.regs[tid]
                self._registered.discard(tid)
                self._fail_remote(reg, w.failed.pop(tid)[0], Why.PREFILL_FAILED)
            elif tid in w.finished:
                del w.regs[tid]
                self._registered.discard(tid)
                fin = w.finished.pop(tid)
                if t_reg <= fin.ready_at:
                    self.writer_stats.registered_first += 1
                else:
                    self.writer_stats.finished_first += 1
                self.writer_stats.match_wait_s += now - t_reg
                self._claim_hold(tid, reg)
                self._post(w, reg, fin)

    def _post(self, w: _WriterState, reg: m.PushRegistration, fin: _Finished) -> None:
        peer = self.known_peer(reg.engine_id, reg.incarnation)
        if peer is None:
            msg = f"unknown decode instance {shown(reg.engine_id)}/{shown(reg.incarnation)}"
            self._fail_remote(reg, msg, Why.UNKNOWN_PEER, unknown_peer=True)
        elif not _fits(reg, fin.blocks, fin.num_tokens):
            self._fail_remote(
                reg,
                f"decode registered {len(reg.block_ids)} blocks after {reg.skip_blocks} for "
                f"{reg.num_tokens} tokens, prefill has {len(fin.blocks)} "
                f"blocks for {fin.num_tokens} tokens",
                Why.SIZE_MISMATCH,
            )
        else:
            local, remote = self.descriptors(peer, fin.blocks[reg.skip_blocks :], reg.block_ids)
            done = m.PushDone(
                transfer_id=reg.transfer_id,
                first_token_id=fin.first_token_id,
                first_token_logprobs=fin.first_token_logprobs,
                prefill_done_time=fin.done_time,
            )
            try:
                handle = self.post_transfer("write", peer, local, remote, m.encode(done))
            except Exception as exc:
                self._fail_remote(reg, f"could not post the KV write: {exc}", Why.WRITE_FAILED)
            else:
                size = nbytes(local)
                w.inflight[reg.transfer_id] = _InFlight(
                    reg, handle, time.monotonic(), size, len(local)
                )
                self._posted.put(handle)
                hop(reg.transfer_id, "p.write_posted")
                return
        self.report(ReleaseHold(fin.transfer_id, "write not possible"))

    def _post_layer(self, w: _WriterState, item: _LayerReady) -> None:
        """Write one finished layer of a prompt (no notification yet); a layer finished before
        D's registration came waits for it in `w.early`."""
        stream = w.streams.get(item.transfer_id) or self._open_stream(w, item.transfer_id)
        if stream is None:
            w.early.setdefault(item.transfer_id, []).append(item)
            return
        reg = stream.reg
        peer = self.known_peer(reg.engine_id, reg.incarnation)
        if stream.error or stream.aborted or peer is None:
            stream.fail("unknown decode instance", Why.UNKNOWN_PEER)
            return
        if not _fits(reg, item.blocks, item.num_tokens):
            stream.fail("decode registered a different prompt size", Why.SIZE_MISMATCH)
            return
        mine = item.blocks[reg.skip_blocks :]
        local, remote = self.kv.descriptors(peer.num_blocks, mine, reg.block_ids, [item.layer])
        try:
            handle = self.post_transfer("write", peer, local, remote, None)
        except Exception as exc:
            stream.fail(
                f"could not post the KV write of layer {item.layer}: {exc}", Why.WRITE_FAILED
            )
            return
        stream.handles.append(handle)
        self._posted.put(handle)
        hop(item.transfer_id, "p.layer_posted", layer=item.layer)
        stream.nbytes += nbytes(local)
        stream.ndesc += len(local)

    def _open_stream(self, w: _WriterState, tid: str) -> _Stream | None:
        """Start streaming `tid` to its registration, or None if none has come yet."""
        entry = w.regs.pop(tid, None)
        if entry is None:
            return None
        self._registered.discard(tid)
        self.writer_stats.registered_first += 1
        self.writer_stats.match_wait_s += time.monotonic() - entry.since
        stream = w.streams[tid] = _Stream(entry.reg, [], time.monotonic())
        return stream

    def _watch_loop(self) -> None:
        """Wait for each posted write in posting order, then wake the writer.

        Posting order is completion order on one link; with several peers a write that
        finished early is reported when the older one ahead of it is.
        """
        raw = self.transport.transport
        blocking = self.transport.kind != "nixl"
        while not self._stop.is_set():
            handle = self._posted.get()  # blocks: idle, nothing wakes it but a post or close
            if handle is None:  # `close`'s sentinel
                break
            while not self._stop.is_set():
                try:
                    if blocking:
                        pending = raw.wait(handle, _WRITE_WAKE_S) is TransferState.PENDING
                    else:
                        pending = raw.state(handle) is TransferState.PENDING
                except Exception:  # released by the writer already: it saw it finish
                    break
                if not pending:
                    break
                if not blocking:
                    time.sleep(_NIXL_POLL_S)
            hop(str(getattr(handle, "id", "?")), "p.watch_done")
            self._inbox.put(_WriteDone())

    def _writer_poll_streams(self, w: _WriterState) -> None:
        """A stream ends once its prompt finished and every layer write did."""
        for tid in list(w.streams):
            st = w.streams[tid]
            pending = []
            for h in st.handles:
                done, error = self.transfer_state(h)
                if not done:
                    pending.append(h)
                elif error:
                    st.fail(f"KV write failed: {error}", Why.WRITE_FAILED)
            st.handles = pending
            if pending or (st.fin is None and not st.aborted and not st.error):
                continue
            del w.streams[tid]
            if st.fin is None:  # a prompt still to come is released as soon as it arrives
                w.aborted[tid] = time.monotonic() + self.cfg.registration_ttl_s
            elif st.early and not st.owes_hold:  # its hold comes later: freed at once
                w.early_done[tid] = time.monotonic() + self.cfg.lease_s
            self._end_stream(st)

    def _end_stream(self, st: _Stream) -> None:
        tid = st.reg.transfer_id
        try:
            if st.aborted:
                self.side.send(tuple(st.reg.reply_to), m.PushAbortAck(transfer_id=tid))
            elif st.error:
                self._fail_remote(st.reg, st.error, st.why)
            else:
                self._notify_done(st)
        finally:
            # After PushDone, which D waits for: the report wakes P's engine thread, which
            # would take the GIL from this thread before the notification is out.
            if st.owes_hold or st.held:
                self.report(ReleaseHold(tid, "layer-wise write finished"))

    def _notify_done(self, st: _Stream) -> None:
        """Every layer's write is DONE: PushDone now follows all the data."""
        assert st.fin is not None
        tid = st.reg.transfer_id
        done = m.PushDone(
            transfer_id=tid,
            first_token_id=st.fin.first_token_id,
            first_token_logprobs=st.fin.first_token_logprobs,
            prefill_done_time=st.fin.done_time,
        )
        peer = self.known_peer(st.reg.engine_id, st.reg.incarnation)
        try:
            if peer is None:
                raise RuntimeError(f"unknown decode instance {st.reg.engine_id}")
            self.transport.send_notif(peer.transport_peer, m.encode(done))
        except Exception as exc:
            self._fail_remote(
                st.reg, f"could not notify the decode instance: {exc}", Why.WRITE_FAILED
            )
            return
        hop(tid, "p.notif_posted")
        self.writer_stats.layerwise += 1
        self.count_transfer(st.nbytes, st.ndesc, time.monotonic() - st.started)

    def _writer_poll(self, w: _WriterState) -> None:
        self._writer_poll_streams(w)
        for tid in list(w.inflight):
            f = w.inflight[tid]
            done, error = self.transfer_state(f.handle)
            if not done:
                continue
            del w.inflight[tid]
            self.report(ReleaseHold(tid, "write finished"))
            if error:
                self._fail_remote(f.reg, f"KV write failed: {error}", Why.WRITE_FAILED)
            else:
                self.count_transfer(f.nbytes, f.ndesc, time.monotonic() - f.started)
            if f.aborted:
                self.side.send(tuple(f.reg.reply_to), m.PushAbortAck(transfer_id=tid))

    def _writer_abort(self, w: _WriterState, msg: m.PushAbort) -> None:
        tid = msg.transfer_id
        self._registered.discard(tid)
        if tid in w.inflight:
            w.inflight[tid].aborted = True  # acknowledged when the transport is done
            return
        if tid in w.streams:
            w.streams[tid].aborted = True  # acknowledged when its layer writes are done
            fin = w.finished.pop(tid, None)
            if fin is not None:
                w.streams[tid].fin, w.streams[tid].owes_hold = fin, True
            return
        w.regs.pop(tid, None)
        w.early.pop(tid, None)
        fin = w.finished.pop(tid, None)
        if fin is not None:
            self.report(ReleaseHold(tid, "decode aborted"))
        else:
            w.aborted[tid] = time.monotonic() + self.cfg.registration_ttl_s
        self.side.send(tuple(msg.reply_to), m.PushAbortAck(transfer_id=tid))

    def _writer_expire(self, w: _WriterState, now: float) -> None:
        for tid in [t for t, f in w.finished.items() if t in w.aborted]:
            w.finished.pop(tid)
            self.report(ReleaseHold(tid, "decode aborted"))
        self._writer_expire_regs(w, now)
        for tid in [t for t, f in w.finished.items() if now - f.ready_at > self.cfg.lease_s]:
            w.finished.pop(tid)
            self.stats.lease_expired += 1
            self.report(ReleaseHold(tid, "no decode registered"))
        # A released transfer's mark outlives its prompt: a registration may still come.
        for tid in [t for t, dl in w.released.items() if dl < now and t not in self.prompts_alive]:
            del w.released[tid]
        for tid in [t for t, dl in w.early_done.items() if dl < now]:
            del w.early_done[tid]  # its prompt never reached `prefill_done` (vLLM freed it)
        for d in (w.failed, w.aborted):
            for tid in [t for t, v in d.items() if (v[1] if isinstance(v, tuple) else v) < now]:
                del d[tid]

    def _writer_next_deadline(self, w: _WriterState, now: float) -> float | None:
        """When `_writer_expire` next has something to do, or None (nothing until an item
        comes). Each deadline below is the one `_writer_expire` checks, plus a slack so its
        strict comparison holds when the writer wakes.

        A registration whose prompt is alive here has no deadline: the prompt's end queues
        a `_Finished`/`_PrefillFailed` to the writer, and a prompt admitted after its
        registration wakes the writer (`prefill_admitted`) so the sweep sees it alive.
        """
        grace, ttl = self.cfg.unknown_transfer_grace_s, self.cfg.registration_ttl_s
        due: list[float] = [f.ready_at + self.cfg.lease_s for f in w.finished.values()]
        if w.inflight or any(st.handles for st in w.streams.values()):
            # Writes in flight: the watcher wakes the writer when each finishes; this poll
            # (only while some write is pending, never idle) covers a wake it could not
            # give, e.g. a handle the raw transport does not know (a wrapped transport).
            due.append(now + _WRITE_WAKE_S)
        if any(t in w.aborted for t in w.finished):
            due.append(now)
        for tid, waiting in w.regs.items():
            if tid in self.prompts_alive:
                continue
            due.append(waiting.since + (ttl if waiting.seen else min(grace, ttl)))
        due += [dl for t, dl in w.released.items() if t not in self.prompts_alive]
        due += [v[1] for v in w.failed.values()]
        due += list(w.aborted.values())
        due += list(w.early_done.values())
        if not due:
            return None
        return max(min(due), now) + _DEADLINE_SLACK_S

    def _writer_expire_regs(self, w: _WriterState, now: float) -> None:
        """Registrations nobody will write for: their prompt never came (unknown transfer,
        after `unknown_transfer_grace_s`) or came and never finished (`registration_ttl_s`).

        A registration whose prompt is still queued or computing here is not orphaned: under
        load P's queue can be longer than any fixed TTL. "Never came" is decided only with
        the inbox empty, checked after the prompt: the engine thread queues a finished or
        failed prompt before it drops it from `prompts_alive`, so an empty inbox then means
        the writer has already taken what the prompt's end sent.
        """
        grace, ttl = self.cfg.unknown_transfer_grace_s, self.cfg.registration_ttl_s
        unknown, expired = [], []
        for tid, waiting in w.regs.items():
            if tid in self.prompts_alive:
                waiting.seen = True
            elif not waiting.seen and now - waiting.since > min(grace, ttl):
                unknown.append(tid)
            elif now - waiting.since > ttl:
                expired.append(tid)
        if unknown and not self._inbox.empty():
            unknown = []  # decided at a later sweep, once the inbox is drained
        for tid in unknown + expired:
            reg = w.regs.pop(tid).reg
            self._registered.discard(tid)
            self.stats.registrations_expired += 1
            if tid in unknown:
                what = f"none came within {min(grace, ttl):g} s of the registration"
                reason = (
                    f"unknown transfer: the prompt never finished on the prefill instance ({what})"
                )
                self._fail_remote(reg, reason, Why.UNKNOWN_TRANSFER)
            else:
                reason = "the prompt never finished on the prefill instance"
                self._fail_remote(reg, reason, Why.EXPIRED)

    def _claim_hold(self, tid: str, reg: m.PushRegistration) -> None:
        """Writer: a registration is paired with the finished prompt of `tid`: its hold is
        claimed (no longer counted against `max_unclaimed_hold_fraction`)."""
        with self.holds_lock:
            h = self.holds.get(tid)
            if h is not None and h.claimant is None:
                h.claimant = (reg.engine_id, reg.incarnation)

    def _fail_remote(
        self, reg: m.PushRegistration, reason: str, why: Why, unknown_peer: bool = False
    ) -> None:
        self.stats.failures += 1
        counts = self.writer_stats.failures_by_cause
        counts[why.value] = counts.get(why.value, 0) + 1
        notice = m.PushFailed(
            transfer_id=reg.transfer_id, reason=reason, unknown_peer=unknown_peer, cause=why
        )
        self.side.send(tuple(reg.reply_to), notice)

    def stopped(self) -> list[str]:
        if self._stop.is_set():
            return []
        return super().stopped() + self._dead_threads(self._threads)

    def _writer_stats(self) -> WriterStats:
        ws = self.writer_stats
        return msgspec.structs.replace(ws, failures_by_cause=dict(ws.failures_by_cause))

    def close(self) -> None:
        self._stop.set()
        self._lanes.close()
        # Wake the threads that block without a timeout when idle (writer, watcher, D's
        # notification poller), so they see `_stop` at once.
        self._inbox.put(_WriteDone())
        self._posted.put(None)
        with self._expecting:
            self._expecting.notify_all()
        for t in self._threads:
            t.join(2.0)
        super().close()


class _WriterState:
    """Writer-thread-only maps, keyed by transfer id."""

    def __init__(self) -> None:
        self.regs: dict[str, _Waiting] = {}
        self.finished: dict[str, _Finished] = {}
        self.failed: dict[str, tuple[str, float]] = {}
        self.aborted: dict[str, float] = {}
        self.inflight: dict[str, _InFlight] = {}
        self.streams: dict[str, _Stream] = {}
        # Layers of prompts still computing whose registration has not come yet (posted when
        # it comes; dropped when the prompt ends first, fails or D aborts).
        self.early: dict[str, list[_LayerReady]] = {}
        # Transfers the router released -> when the mark may go (once its prompt is gone).
        self.released: dict[str, float] = {}
        # Streams that ended after their last layer, before `prefill_done` made their hold
        # (`layer_hook`'s `done_after_last_layer`) -> when to forget them; the hold is freed
        # as soon as it comes.
        self.early_done: dict[str, float] = {}


def _fits(reg: m.PushRegistration, blocks: list[int], num_tokens: int) -> bool:
    """D's registration names P's prompt: same tokens, and blocks for all of P's blocks past
    the `skip_blocks` D holds already (at least one is always sent)."""
    skip = reg.skip_blocks
    return (
        reg.num_tokens == num_tokens
        and 0 <= skip < len(blocks)
        and len(reg.block_ids) == len(blocks) - skip
    )
