"""Push mode: D registers its blocks early; a writer thread on P WRITEs into them.

D (engine thread): `start_receive` reserves the blocks (already allocated at
  admission) and queues the registration; a sender thread handshakes with P on first
  contact and sends PushRegistration over the side channel. A notification poller
  thread waits for the WRITE's notification (PushDone, delivered by the transport only
  after the data) and reports the arrival. PushFailed from P fails the request at once.
  `cancel_receive` (abort or watchdog) fences the blocks in quarantine and sends
  PushAbort; P answers PushAbortAck once no write for that transfer is or will be in
  flight, and only then do the blocks return to the pool.
P (engine thread): `prefill_done` moves the blocks to "hold:<tid>" (no engine-side
  lease: the writer owns the deadline) and hands them to the writer at once, in the
  same step, not in the next step's metadata.
P (writer thread): pairs registrations and finished prompts by transfer id, in either
  order; posts the WRITE with PushDone as its notification; frees the hold when it
  completes; sends PushFailed to D when the prompt failed, the write failed or the
  prompt never came (`registration_ttl_s`); frees prompts nobody registered for after
  `lease_s`. Fencing rule: after PushAbort, a transfer is never posted; one already in
  flight is acknowledged only when the transport reports it finished.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass

import msgspec

from pdserve.engine.request import Request
from pdserve.transfer import messages as m
from pdserve.transfer.connector import (
    Arrived,
    Failed,
    KVConnector,
    ReleaseHold,
    ReleaseQuarantine,
    transfer_id_of,
)
from pdserve.transfer.params import KVTransferParams
from pdserve.transfer.side_channel import Address

log = logging.getLogger(__name__)


@dataclass
class _Finished:
    transfer_id: str
    blocks: list[int]
    num_tokens: int
    first_token_id: int
    done_time: float
    ready_at: float  # tests may delay the hand-off to force an arrival order


@dataclass
class _PrefillFailed:
    transfer_id: str
    reason: str


@dataclass
class _InFlight:
    reg: m.PushRegistration
    handle: object
    started: float
    nbytes: int
    ndesc: int
    aborted: bool = False


@dataclass
class _Register:
    transfer_id: str
    peer: tuple[str, Address, str | None]
    msg: m.PushRegistration


class PushConnector(KVConnector):
    """Push: the prefill side writes into blocks the decode side registered."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._inbox: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._outbox: queue.SimpleQueue[_Register | None] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._p_of: dict[str, Address] = {}  # D: transfer id -> P's side channel
        self.writer_stats = WriterStats()
        self._threads = [
            threading.Thread(target=self._writer_loop, name="pdserve-push-writer", daemon=True),
            threading.Thread(target=self._sender_loop, name="pdserve-push-reg", daemon=True),
            threading.Thread(target=self._notif_loop, name="pdserve-push-notif", daemon=True),
        ]
        for t in self._threads:
            t.start()

    # == D side ===========================================================================
    def start_receive(self, req: Request) -> None:
        super().start_receive(req)
        p = req.kv_transfer
        assert p is not None and p.remote_host and p.remote_port and p.remote_engine_id
        tid = transfer_id_of(req)
        self._p_of[tid] = (p.remote_host, p.remote_port)
        reg = m.PushRegistration(
            transfer_id=tid,
            engine_id=self.cfg.engine_id,
            incarnation=self.cfg.incarnation,
            reply_to=self.side.address,
            block_ids=list(req.block_ids),
            num_tokens=req.num_prompt_tokens,
        )
        peer = (p.remote_engine_id, (p.remote_host, p.remote_port), p.remote_incarnation)
        self._outbox.put(_Register(tid, peer, reg))

    def _sender_loop(self) -> None:
        while (job := self._outbox.get()) is not None:
            if self.cfg.push_register_delay_s:
                time.sleep(self.cfg.push_register_delay_s)
            try:
                peer = self.peer(*job.peer)
                self.side.send(peer.address, job.msg)
            except Exception as exc:
                self.report(Failed(job.transfer_id, f"push registration failed: {exc}"))

    def _notif_loop(self) -> None:
        while not self._stop.is_set():
            for raw in self.transport.wait_notifs(0.05):
                try:
                    msg = m.decode(raw)
                except (msgspec.DecodeError, msgspec.ValidationError):
                    log.warning("push: dropped a malformed notification")
                    continue
                if isinstance(msg, m.PushDone):
                    self._p_of.pop(msg.transfer_id, None)
                    self.report(Arrived(msg.transfer_id, msg.first_token_id, msg.prefill_done_time))

    def _on_cancel(self, tid: str) -> None:
        to = self._p_of.pop(tid, None)
        if to is None:
            self.report(ReleaseQuarantine(tid))
            return
        abort = m.PushAbort(
            transfer_id=tid,
            engine_id=self.cfg.engine_id,
            incarnation=self.cfg.incarnation,
            reply_to=self.side.address,
        )
        self.side.send(to, abort)

    # == both sides: side channel =========================================================
    def on_message(self, msg: m.Message) -> None:
        if isinstance(msg, m.PushFailed):  # D
            to = self._p_of.pop(msg.transfer_id, None)
            if msg.unknown_peer and to is not None:
                self._forget_peer(to)  # P restarted and lost us: handshake again next time
            self.report(Failed(msg.transfer_id, f"prefill instance: {msg.reason}"))
        elif isinstance(msg, m.PushAbortAck):  # D
            self.report(ReleaseQuarantine(msg.transfer_id))
        elif isinstance(msg, (m.PushRegistration, m.PushAbort)):  # P
            self._inbox.put(msg)

    # == P side: engine thread ============================================================
    def prefill_done(self, req: Request, first_token: int) -> KVTransferParams:
        h = self.hold(req, first_token, time.time(), lease=False)
        ready = time.monotonic() + self.cfg.push_finish_delay_s
        self._inbox.put(
            _Finished(h.transfer_id, list(h.blocks), h.num_tokens, first_token, h.done_time, ready)
        )
        return KVTransferParams(
            transfer_mode="push",
            transfer_id=h.transfer_id,
            remote_num_tokens=h.num_tokens,
            prefill_done_time=h.done_time,
        )

    def prefill_failed(self, req: Request, reason: str) -> None:
        self._inbox.put(_PrefillFailed(transfer_id_of(req), reason))

    # == P side: writer thread ============================================================
    def _writer_loop(self) -> None:
        w = _WriterState()
        while not self._stop.is_set():
            timeout = 0.001 if (w.inflight or w.delayed) else 0.05
            try:
                item = self._inbox.get(timeout=timeout)
            except queue.Empty:
                item = None
            try:
                if item is not None:
                    self._writer_take(w, item)
                self._writer_pair(w)
                self._writer_poll(w)
                self._writer_expire(w, time.monotonic())
            except Exception:
                log.exception("push writer step failed")
            self.writer_stats.queue_depth = len(w.regs) + len(w.finished) + len(w.inflight)

    def _writer_take(self, w: _WriterState, item: object) -> None:
        now = time.monotonic()
        if isinstance(item, m.PushRegistration):
            w.regs[item.transfer_id] = (item, now)
        elif isinstance(item, _Finished):
            item.ready_at = max(item.ready_at, now)
            (w.delayed if item.ready_at > now else w.finished)[item.transfer_id] = item
        elif isinstance(item, _PrefillFailed):
            w.failed[item.transfer_id] = (item.reason, now + self.cfg.registration_ttl_s)
        elif isinstance(item, m.PushAbort):
            self._writer_abort(w, item)

    def _writer_pair(self, w: _WriterState) -> None:
        now = time.monotonic()
        for tid in [t for t, f in w.delayed.items() if f.ready_at <= now]:
            w.finished[tid] = w.delayed.pop(tid)
        for tid in list(w.regs):
            reg, t_reg = w.regs[tid]
            if tid in w.failed:
                del w.regs[tid]
                self._fail_remote(reg, w.failed.pop(tid)[0])
            elif tid in w.finished:
                del w.regs[tid]
                fin = w.finished.pop(tid)
                if t_reg <= fin.ready_at:
                    self.writer_stats.registered_first += 1
                else:
                    self.writer_stats.finished_first += 1
                self.writer_stats.match_wait_s += now - t_reg
                self._post(w, reg, fin)

    def _post(self, w: _WriterState, reg: m.PushRegistration, fin: _Finished) -> None:
        peer = self.known_peer(reg.engine_id, reg.incarnation)
        if peer is None:
            msg = f"unknown decode instance {reg.engine_id}/{reg.incarnation}"
            self._fail_remote(reg, msg, unknown_peer=True)
        elif len(reg.block_ids) != len(fin.blocks) or reg.num_tokens != fin.num_tokens:
            self._fail_remote(
                reg,
                f"decode registered {len(reg.block_ids)} blocks for "
                f"{reg.num_tokens} tokens, prefill has {len(fin.blocks)} "
                f"blocks for {fin.num_tokens} tokens",
            )
        else:
            local, remote = self.descriptors(peer, fin.blocks, reg.block_ids)
            done = m.PushDone(
                transfer_id=reg.transfer_id,
                first_token_id=fin.first_token_id,
                prefill_done_time=fin.done_time,
            )
            try:
                handle = self.post_transfer("write", peer, local, remote, m.encode(done))
            except Exception as exc:
                self._fail_remote(reg, f"could not post the KV write: {exc}")
            else:
                nbytes = sum(n for _, n in local)
                w.inflight[reg.transfer_id] = _InFlight(
                    reg, handle, time.monotonic(), nbytes, len(local)
                )
                return
        self.report(ReleaseHold(fin.transfer_id, "write not possible"))

    def _writer_poll(self, w: _WriterState) -> None:
        for tid in list(w.inflight):
            f = w.inflight[tid]
            done, error = self.transfer_state(f.handle)
            if not done:
                continue
            del w.inflight[tid]
            self.report(ReleaseHold(tid, "write finished"))
            if error:
                self._fail_remote(f.reg, f"KV write failed: {error}")
            else:
                self.count_transfer(f.nbytes, f.ndesc, time.monotonic() - f.started)
            if f.aborted:
                self.side.send(tuple(f.reg.reply_to), m.PushAbortAck(transfer_id=tid))

    def _writer_abort(self, w: _WriterState, msg: m.PushAbort) -> None:
        tid = msg.transfer_id
        if tid in w.inflight:
            w.inflight[tid].aborted = True  # acknowledged when the transport is done
            return
        w.regs.pop(tid, None)
        fin = w.finished.pop(tid, None) or w.delayed.pop(tid, None)
        if fin is not None:
            self.report(ReleaseHold(tid, "decode aborted"))
        else:
            w.aborted[tid] = time.monotonic() + self.cfg.registration_ttl_s
        self.side.send(tuple(msg.reply_to), m.PushAbortAck(transfer_id=tid))

    def _writer_expire(self, w: _WriterState, now: float) -> None:
        for tid in [t for t, f in w.finished.items() if t in w.aborted]:
            w.finished.pop(tid)
            self.report(ReleaseHold(tid, "decode aborted"))
        for tid in [t for t, (_, t0) in w.regs.items() if now - t0 > self.cfg.registration_ttl_s]:
            reg, _ = w.regs.pop(tid)
            self.stats.registrations_expired += 1
            self._fail_remote(reg, "the prompt never finished on the prefill instance")
        for tid in [t for t, f in w.finished.items() if now - f.ready_at > self.cfg.lease_s]:
            w.finished.pop(tid)
            self.stats.lease_expired += 1
            self.report(ReleaseHold(tid, "no decode registered"))
        for d in (w.failed, w.aborted):
            for tid in [t for t, v in d.items() if (v[1] if isinstance(v, tuple) else v) < now]:
                del d[tid]

    def _fail_remote(self, reg: m.PushRegistration, reason: str, unknown_peer=False) -> None:
        self.stats.failures += 1
        cause = reason.split(":")[0][:60]
        self.writer_stats.failures_by_cause[cause] = (
            self.writer_stats.failures_by_cause.get(cause, 0) + 1
        )
        notice = m.PushFailed(transfer_id=reg.transfer_id, reason=reason, unknown_peer=unknown_peer)
        self.side.send(tuple(reg.reply_to), notice)

    def close(self) -> None:
        self._stop.set()
        self._outbox.put(None)
        for t in self._threads:
            t.join(2.0)
        super().close()


class _WriterState:
    """Writer-thread-only maps, keyed by transfer id."""

    def __init__(self) -> None:
        self.regs: dict[str, tuple[m.PushRegistration, float]] = {}
        self.finished: dict[str, _Finished] = {}
        self.delayed: dict[str, _Finished] = {}
        self.failed: dict[str, tuple[str, float]] = {}
        self.aborted: dict[str, float] = {}
        self.inflight: dict[str, _InFlight] = {}


class WriterStats(msgspec.Struct):
    """Push metrics (read from any thread)."""

    registered_first: int = 0
    finished_first: int = 0
    match_wait_s: float = 0.0
    queue_depth: int = 0
    failures_by_cause: dict[str, int] = msgspec.field(default_factory=dict)
