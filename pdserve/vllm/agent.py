"""The worker's transfer agent: pairs D's registrations with P's finished blocks and moves them.

Threads (none busy-polls; each blocks on a queue, a socket or a transfer):
  - `pdserve-vllm-loop` owns every piece of state below. It blocks on its event queue, with
    a timeout that is the next deadline (lease, grace, heartbeat, watchdog).
  - `pdserve-vllm-notif` blocks on the transport's notifications and queues them.
  - `pdserve-vllm-wait` blocks on posted transfers, one after the other, and queues the
    outcome (the transport guarantees that none stays pending forever).
  - `pdserve-vllm-dial` (one pool thread) runs what waits on a peer's reply: the handshake,
    and in pull mode the claim.
  - the side channel's receiver thread queues the messages it receives.
The engine thread only queues work (`recv`, `send`, `finished`) and takes the results.

Block ownership. vLLM owns every KV block; the agent borrows them:
  - P: from `send(spec)` (vLLM delayed freeing them) until the request id is in
    `take_results().finished_sending`. That happens once the WRITE to D ended (DONE or
    ERROR), D's PullDone arrived (pull), D aborted, or the lease ran out with no D.
  - D: from `recv(spec)` (vLLM holds the request in WAITING_FOR_REMOTE_KVS) until the id
    is in finished_recving (also in failed_recving when the KV did not arrive). It is
    reported only when no write into those blocks can still land: the data arrived, P said
    it will not write (PushFailed, PushAbortAck), or P was declared dead and removed from
    the transport (which closes its connection, so nothing more from it is accepted).
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import msgspec

from pdserve.config import TransportConfig
from pdserve.transfer import messages as m
from pdserve.transfer.side_channel import SideChannel, new_nonce
from pdserve.transfer.transport import (
    Notification,
    PeerId,
    TransferHandle,
    TransferState,
    TransportError,
    create_transport,
)
from pdserve.vllm.config import VllmConnectorConfig
from pdserve.vllm.layout import KVLayout
from pdserve.vllm.specs import RecvSpec, ReleaseSpec, SendSpec

log = logging.getLogger(__name__)
Address = tuple[str, int]
PeerKey = tuple[str, str]  # (engine id, incarnation) as params name a P
_MAX_WAIT_S = 1.0
# P: how often a registration that overtook its decode instance's transport connection
# checks again whether that connection has arrived (only while one such waits).
_PEER_RECHECK_S = 0.02


@dataclass
class Results:
    """Request ids that vLLM may act on (engine thread takes them every step)."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)


@dataclass
class _Recv:
    """D: one request waiting for its KV."""

    spec: RecvSpec
    deadline: float
    peer: PeerId | None = None  # known once the handshake succeeded
    registered: bool = False  # push: the registration went out, P may write any time now
    handle: TransferHandle | None = None  # pull: the READ in flight
    aborted: bool = False  # vLLM finished the request meanwhile (client gone)


@dataclass
class _Send:
    """P: one finished request whose blocks vLLM keeps for us."""

    spec: SendSpec
    deadline: float  # the lease
    writing: bool = False
    claimed_by: PeerKey | None = None  # pull


@dataclass
class _Reg:
    """P: a registration from D, waiting for its request to finish here (grace)."""

    msg: m.PushRegistration
    deadline: float


@dataclass
class _PeerState:
    address: Address
    last_seen: float
    next_ping: float = 0.0
    pongs: int = 0


@dataclass(frozen=True)
class _Dialed:
    key: PeerKey  # as the specs named P (incarnation "" when they did not know it)
    peer: PeerId | None  # the incarnation that answered, once the handshake succeeded
    error: str | None


@dataclass(frozen=True)
class _Claimed:
    request_id: str
    error: str | None


@dataclass(frozen=True)
class _Ended:
    handle: TransferHandle
    request_id: str  # P's (push) or D's (pull)
    state: TransferState
    error: str | None


@dataclass(frozen=True)
class _Finished:
    request_ids: frozenset[str]


class TransferAgent:
    """One per vLLM worker (tensor parallel size 1). See the module docstring."""

    def __init__(
        self, cfg: VllmConnectorConfig, engine_id: str, layout: KVLayout, compat: m.Compat
    ) -> None:
        self.cfg = cfg
        self.layout = layout
        self.compat = compat
        token = cfg.cluster_token()
        tconf = TransportConfig(
            kind=cfg.transport,
            host=cfg.side_host,
            port=cfg.transport_port,
            advertise_host=cfg.advertise_host,
            cluster_token=token,
            timeout_s=cfg.transfer_timeout_s,
        )
        self.transport = create_transport(tconf, engine_id)
        for i, (name, tensor) in enumerate(zip(layout.names, layout.tensors, strict=True)):
            region = self.transport.register(name, tensor, granule=layout.block_nbytes)
            if region != i:
                raise RuntimeError(f"region of layer {name} is {region}, expected {i}")
        self.me = self.transport.peer_id
        self._events: queue.Queue[object] = queue.Queue()
        self._handles: queue.Queue[tuple[TransferHandle, str] | None] = queue.Queue()
        self.side = SideChannel(
            self._events.put,
            host=cfg.side_host,
            port=cfg.side_port,
            token=token,
            advertise_host=cfg.advertise_host,
        )
        self._dial = concurrent.futures.ThreadPoolExecutor(4, "pdserve-vllm-dial")
        self._lock = threading.Lock()
        self._results = Results()
        self._stop = threading.Event()
        # D state
        self._recvs: dict[str, _Recv] = {}
        self._by_transfer: dict[tuple[str, str], str] = {}  # (P engine, P request) -> D request
        # the incarnation last found at a P's side channel, for specs that do not name one
        self._incarnations: dict[tuple[str, Address], str] = {}
        self._peers: dict[PeerKey, PeerId] = {}
        self._dialing: set[PeerKey] = set()
        self._health: dict[PeerKey, _PeerState] = {}
        self._last_beat = time.monotonic()
        # P state
        self._sends: dict[str, _Send] = {}
        self._regs: dict[str, _Reg] = {}
        # registrations whose D is not a transport peer yet -> when to give up on it
        self._unpeered: dict[str, tuple[m.PushRegistration, float]] = {}
        self._abort_acks: dict[str, Address] = {}  # P request -> D to ack once the write ends
        self._claims: dict[str, tuple[m.PullClaim, float]] = {}  # claims ahead of the request
        # requests D gave up on before vLLM handed them to us: freed as soon as they come
        self._gone: dict[str, float] = {}
        # registrations that came before vLLM handed us their finished request (push with
        # both legs at once: D registers while P still computes); read by tests and logs
        self.early_registrations = 0
        self._threads = [
            threading.Thread(target=self._loop, name="pdserve-vllm-loop", daemon=True),
            threading.Thread(target=self._notif_loop, name="pdserve-vllm-notif", daemon=True),
            threading.Thread(target=self._wait_loop, name="pdserve-vllm-wait", daemon=True),
        ]
        for t in self._threads:
            t.start()

    # -- engine thread API --------------------------------------------------------------------
    def recv(self, spec: RecvSpec) -> None:
        """D: start getting the KV of `spec` (blocks lent until finished_recving)."""
        self._events.put(spec)

    def release(self, spec: ReleaseSpec) -> None:
        """D: tell P to free what it holds for a request we will not load."""
        msg = m.PullDone(
            transfer_id=spec.remote_request_id,
            ok=False,
            engine_id=self.me.engine_id,
            incarnation=self.me.incarnation,
        )
        self.side.send(spec.remote_address, msg)

    def send(self, spec: SendSpec) -> None:
        """P: `spec`'s blocks are ours until finished_sending."""
        self._events.put(spec)

    def finished(self, request_ids: set[str]) -> None:
        """vLLM finished these requests (a D request among them was aborted while waiting)."""
        if request_ids:
            self._events.put(_Finished(frozenset(request_ids)))

    def take_results(self) -> Results:
        with self._lock:
            out, self._results = self._results, Results()
        return out

    def close(self) -> None:
        self._stop.set()
        self._events.put(None)
        self._handles.put(None)
        self._dial.shutdown(wait=False, cancel_futures=True)
        self.side.close()
        self.transport.close()
        for t in self._threads:
            t.join(2.0)

    # -- threads ------------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                event = self._events.get(timeout=self._next_timeout())
            except queue.Empty:
                event = None
            try:
                if event is not None:
                    self._handle(event)
                self._tick(time.monotonic())
            except Exception:  # a bug must not stop every transfer of this instance
                log.exception("pdserve vLLM connector: event %r failed", type(event).__name__)

    def _notif_loop(self) -> None:
        while not self._stop.is_set():
            try:
                notifs = self.transport.wait_notifs(_MAX_WAIT_S)
            except TransportError:
                return
            for n in notifs:
                self._events.put(n)

    def _wait_loop(self) -> None:
        while (item := self._handles.get()) is not None:
            handle, request_id = item
            state = self.transport.wait(handle)
            error = self.transport.error(handle) if state is TransferState.ERROR else None
            self.transport.release(handle)
            self._events.put(_Ended(handle, request_id, state, error))

    def _next_timeout(self) -> float:
        deadlines = [r.deadline for r in self._recvs.values()]
        deadlines += [s.deadline for s in self._sends.values() if not s.writing]
        deadlines += [r.deadline for r in self._regs.values()]
        deadlines += [deadline for _, deadline in self._claims.values()]
        if self._unpeered:
            deadlines.append(time.monotonic() + _PEER_RECHECK_S)
        if self._health:
            deadlines.append(time.monotonic() + self.cfg.heartbeat_s)
        if not deadlines:
            return _MAX_WAIT_S
        return min(max(min(deadlines) - time.monotonic(), 0.01), _MAX_WAIT_S)

    def _handle(self, event: object) -> None:
        match event:
            case RecvSpec():
                self._on_recv(event)
            case SendSpec():
                self._on_send(event)
            case _Finished():
                self._on_finished(event.request_ids)
            case _Dialed():
                self._on_dialed(event)
            case _Claimed():
                self._on_claimed(event)
            case _Ended():
                self._on_ended(event)
            case Notification():
                self._on_notif(event)
            case m.Hello():
                self._on_hello(event)
            case m.PushRegistration():
                self._on_registration(event)
            case m.PushFailed():
                self._on_push_failed(event)
            case m.PushAbort():
                self._on_push_abort(event)
            case m.PushAbortAck():
                self._on_abort_ack(event)
            case m.PullClaim():
                self._on_claim(event)
            case m.PullDone():
                self._on_pull_done(event)
            case m.Ping():
                self.side.send(
                    event.reply_to,
                    m.Pong(
                        engine_id=self.me.engine_id,
                        incarnation=self.me.incarnation,
                        address=self.side.address,
                    ),
                )
            case m.Pong():
                self._on_pong(event)

    # -- results ------------------------------------------------------------------------------
    def _sent(self, key: str) -> None:
        """P: give the blocks of transfer `key` back to vLLM."""
        send = self._sends.pop(key, None)
        if send is not None:
            with self._lock:
                self._results.finished_sending.add(send.spec.request_id)

    def _received(self, request_id: str, ok: bool, why: str = "") -> None:
        """D: give the blocks back to vLLM, with their KV (ok) or without."""
        recv = self._recvs.pop(request_id, None)
        if recv is not None:
            self._by_transfer.pop((recv.spec.remote_engine_id, recv.spec.remote_request_id), None)
        if not ok:
            log.warning("pdserve vLLM connector: KV for %s did not arrive: %s", request_id, why)
        with self._lock:
            self._results.finished_recving.add(request_id)
            if not ok:
                self._results.failed_recving.add(request_id)

    # -- D side -------------------------------------------------------------------------------
    def _key(self, spec: RecvSpec) -> PeerKey:
        return (spec.remote_engine_id, spec.remote_incarnation)

    def _on_recv(self, spec: RecvSpec) -> None:
        now = time.monotonic()
        if not spec.remote_incarnation:  # legs sent at once: the last handshake's, if any
            known = self._incarnations.get((spec.remote_engine_id, spec.remote_address), "")
            spec = msgspec.structs.replace(spec, remote_incarnation=known)
        self._recvs[spec.request_id] = _Recv(spec, now + self.cfg.recv_timeout_s)
        self._by_transfer[(spec.remote_engine_id, spec.remote_request_id)] = spec.request_id
        key = self._key(spec)
        if spec.remote_incarnation:  # pongs name an incarnation: health needs to know it
            health = self._health.setdefault(key, _PeerState(spec.remote_address, now))
            health.address = spec.remote_address
        if key in self._peers:
            self._start_recv(self._recvs[spec.request_id], self._peers[key])
        elif key not in self._dialing:
            self._dialing.add(key)
            fut = self._dial.submit(self._handshake, key, spec.remote_address)
            fut.add_done_callback(lambda f: self._events.put(f.result()))

    def _handshake(self, key: PeerKey, address: Address) -> _Dialed:
        """Dial thread: exchange Hello with P and add its transport as a peer."""
        hello = m.Hello(
            nonce=new_nonce(),
            engine_id=self.me.engine_id,
            incarnation=self.me.incarnation,
            reply_to=self.side.address,
            compat=self.compat,
            num_blocks=self.layout.num_blocks,
            transport_metadata=self.transport.local_metadata(),
        )
        try:
            reply = self.side.request(address, hello, self.cfg.handshake_timeout_s)
        except Exception as exc:  # TimeoutError, or the channel closing under us
            return _Dialed(key, None, f"no handshake reply from {address}: {exc!r}")
        if not isinstance(reply, m.HelloReply) or reply.error:
            return _Dialed(key, None, f"handshake refused: {getattr(reply, 'error', reply)}")
        if reply.engine_id != key[0] or key[1] not in ("", reply.incarnation):
            return _Dialed(key, None, f"{address} is now {reply.engine_id}@{reply.incarnation}")
        try:
            return _Dialed(key, self.transport.add_peer(reply.transport_metadata), None)
        except Exception as exc:  # TransportError, or a stalled socket: the request fails
            return _Dialed(key, None, f"transport handshake failed: {exc!r}")

    def _on_dialed(self, ev: _Dialed) -> None:
        self._dialing.discard(ev.key)
        waiting = [r for r in self._recvs.values() if self._key(r.spec) == ev.key]
        if ev.peer is None:
            self._forget(ev.key)
            for r in waiting:
                self._received(r.spec.request_id, False, ev.error or "handshake failed")
            return
        key = (ev.peer.engine_id, ev.peer.incarnation)
        self._peers[key] = ev.peer
        now = time.monotonic()
        for r in waiting:  # specs that named no incarnation now name the one that answered
            address = r.spec.remote_address
            self._incarnations[(key[0], address)] = key[1]
            r.spec = msgspec.structs.replace(r.spec, remote_incarnation=key[1])
            self._health.setdefault(key, _PeerState(address, now)).address = address
        for r in waiting:
            if r.aborted:
                self._received(r.spec.request_id, False, "aborted")
            else:
                self._start_recv(r, ev.peer)

    def _start_recv(self, recv: _Recv, peer: PeerId) -> None:
        recv.peer = peer
        spec = recv.spec
        if spec.mode == "push":
            reg = m.PushRegistration(
                transfer_id=spec.remote_request_id,
                engine_id=self.me.engine_id,
                incarnation=self.me.incarnation,
                reply_to=self.side.address,
                block_ids=spec.block_ids,
                num_tokens=spec.num_tokens,
                skip_blocks=spec.first_block,
            )
            recv.registered = True
            self.side.send(spec.remote_address, reg)
            return
        src = spec.remote_block_ids[spec.first_block : spec.first_block + len(spec.block_ids)]
        fut = self._dial.submit(self._claim, spec, src)
        fut.add_done_callback(lambda f: self._events.put(f.result()))

    def _claim(self, spec: RecvSpec, src: list[int]) -> _Claimed:
        """Dial thread (pull): ask P to keep `src` for us while we read."""
        claim = m.PullClaim(
            nonce=new_nonce(),
            transfer_id=spec.remote_request_id,
            block_ids=src,
            engine_id=self.me.engine_id,
            incarnation=self.me.incarnation,
            reply_to=self.side.address,
        )
        try:
            reply = self.side.request(spec.remote_address, claim, self.cfg.handshake_timeout_s)
        except Exception as exc:  # TimeoutError, or the channel closing under us
            return _Claimed(spec.request_id, f"no claim reply: {exc!r}")
        error = getattr(reply, "error", "unexpected reply")
        return _Claimed(spec.request_id, error)

    def _on_claimed(self, ev: _Claimed) -> None:
        recv = self._recvs.get(ev.request_id)
        if recv is None:
            return
        spec = recv.spec
        if ev.error or recv.aborted or recv.peer is None:
            self._pull_done(spec, ok=False)
            self._received(spec.request_id, False, ev.error or "aborted")
            return
        src = spec.remote_block_ids[spec.first_block : spec.first_block + len(spec.block_ids)]
        if len(src) != len(spec.block_ids):
            self._pull_done(spec, ok=False)
            self._received(spec.request_id, False, "P holds fewer blocks than D needs")
            return
        layers = range(len(self.layout.tensors))
        local, remote = self.layout.descriptors(spec.block_ids, src, layers)
        done = m.PullDone(
            transfer_id=spec.remote_request_id,
            ok=True,
            engine_id=self.me.engine_id,
            incarnation=self.me.incarnation,
            block_ids=src,
        )
        try:
            recv.handle = self.transport.read(recv.peer, local, remote, notif=m.encode(done))
        except TransportError as exc:
            self._pull_done(spec, ok=False)
            self._received(spec.request_id, False, f"read failed: {exc}")
            return
        self._handles.put((recv.handle, spec.request_id))

    def _pull_done(self, spec: RecvSpec, ok: bool) -> None:
        """Tell P it may free its blocks (a READ that succeeded told it in its notification)."""
        msg = m.PullDone(
            transfer_id=spec.remote_request_id,
            ok=ok,
            engine_id=self.me.engine_id,
            incarnation=self.me.incarnation,
            block_ids=spec.remote_block_ids[spec.first_block :][: len(spec.block_ids)],
        )
        self.side.send(spec.remote_address, msg)

    def _on_finished(self, request_ids: frozenset[str]) -> None:
        for rid in request_ids & self._recvs.keys():
            recv = self._recvs[rid]
            recv.aborted = True
            spec = recv.spec
            if spec.mode == "push" and recv.registered:
                # P may be writing: the blocks go back to vLLM only after P's ack
                abort = m.PushAbort(
                    transfer_id=spec.remote_request_id,
                    engine_id=self.me.engine_id,
                    incarnation=self.me.incarnation,
                    reply_to=self.side.address,
                )
                self.side.send(spec.remote_address, abort)
            elif spec.mode == "pull" and recv.handle is None and recv.peer is not None:
                pass  # the claim is in flight: _on_claimed ends it without reading
            elif recv.handle is None and self._key(spec) not in self._dialing:
                self._received(rid, False, "aborted before the transfer started")

    def _on_notif(self, n: Notification) -> None:
        try:
            msg = m.decode(n.payload)
        except Exception:
            log.warning("pdserve vLLM connector: undecodable notification from %s", n.peer)
            return
        if isinstance(msg, m.PushDone):
            rid = self._by_transfer.get((n.peer.engine_id, msg.transfer_id))
            if rid is not None:
                self._received(rid, True)
        elif isinstance(msg, m.PullDone):
            self._on_pull_done(msg)

    def _on_push_failed(self, msg: m.PushFailed) -> None:
        rid = next((r for (_, t), r in self._by_transfer.items() if t == msg.transfer_id), None)
        if rid is None:
            return
        why = f"P will not write: {msg.cause.value}: {msg.reason}"
        if msg.cause is m.PushFailCause.UNKNOWN_PEER:
            # P does not know our connection (it restarted, and specs naming no incarnation
            # reached it through the old one): drop it, the next receive handshakes again.
            self._fence(self._key(self._recvs[rid].spec), why)
        if rid in self._recvs:
            self._received(rid, False, why)

    def _on_abort_ack(self, msg: m.PushAbortAck) -> None:
        rid = next((r for (_, t), r in self._by_transfer.items() if t == msg.transfer_id), None)
        if rid is not None:
            self._received(rid, False, "aborted")

    def _on_pong(self, msg: m.Pong) -> None:
        health = self._health.get((msg.engine_id, msg.incarnation))
        if health is not None:
            health.last_seen = time.monotonic()
            health.pongs += 1
        for key, h in self._health.items():
            if h.address == msg.address and key != (msg.engine_id, msg.incarnation):
                h.last_seen = -1e9  # a new incarnation answers at that address: the old is gone

    # -- P side -------------------------------------------------------------------------------
    def _on_send(self, spec: SendSpec) -> None:
        self._sends[spec.key] = _Send(spec, time.monotonic() + self.cfg.lease_s)
        if self._gone.pop(spec.key, None) is not None:
            self._sent(spec.key)
            return
        reg = self._regs.pop(spec.key, None)
        if reg is not None:
            self._start_write(reg.msg)
        claim = self._claims.get(spec.key)
        if claim is not None:
            self._on_claim(claim[0])

    def _on_hello(self, msg: m.Hello) -> None:
        error = self.compat.mismatch(msg.compat)
        reply = m.HelloReply(
            nonce=msg.nonce,
            engine_id=self.me.engine_id,
            incarnation=self.me.incarnation,
            compat=self.compat,
            num_blocks=self.layout.num_blocks,
            transport_metadata=self.transport.local_metadata(),
            error=f"incompatible KV layout: {error}" if error else None,
        )
        self.side.send(msg.reply_to, reply)

    def _on_registration(self, msg: m.PushRegistration) -> None:
        send = self._sends.get(msg.transfer_id)
        if send is not None and send.writing:
            return  # a duplicate: the blocks are already on their way
        if send is not None:
            self._start_write(msg)
        else:  # P's scheduler has not handed us the request yet (or never will)
            deadline = time.monotonic() + self.cfg.registration_grace_s
            self._regs[msg.transfer_id] = _Reg(msg, deadline)
            self.early_registrations += 1
            log.info(
                "pdserve vLLM connector: registration for %s arrived before its prefill ended",
                msg.transfer_id,
            )

    def _fail_push(self, msg: m.PushRegistration, cause: m.PushFailCause, why: str) -> None:
        fail = m.PushFailed(transfer_id=msg.transfer_id, reason=why, cause=cause)
        self.side.send(msg.reply_to, fail)

    def _start_write(self, msg: m.PushRegistration) -> None:
        send = self._sends[msg.transfer_id]
        peer = PeerId(msg.engine_id, msg.incarnation)
        src = send.spec.block_ids[msg.skip_blocks : msg.skip_blocks + len(msg.block_ids)]
        if peer not in self.transport.peers():
            self._await_peer(msg)
            return
        self._unpeered.pop(msg.transfer_id, None)
        if len(src) != len(msg.block_ids):
            self._fail_push(msg, m.PushFailCause.SIZE_MISMATCH, "D registered more blocks")
            self._sent(msg.transfer_id)
            return
        layers = range(len(self.layout.tensors))
        local, remote = self.layout.descriptors(src, msg.block_ids, layers)
        done = m.PushDone(transfer_id=msg.transfer_id, first_token_id=-1, prefill_done_time=0.0)
        try:
            handle = self.transport.write(peer, local, remote, notif=m.encode(done))
        except TransportError as exc:
            self._fail_push(msg, m.PushFailCause.WRITE_FAILED, str(exc))
            self._sent(msg.transfer_id)
            return
        send.writing = True
        self._regs[msg.transfer_id] = _Reg(msg, float("inf"))  # for the outcome's reply_to
        self._handles.put((handle, msg.transfer_id))

    def _await_peer(self, msg: m.PushRegistration) -> None:
        """P: D's registration came over the side channel before D's transport connection
        (another socket, dialed at the same handshake) reached us: wait for it up to
        `handshake_timeout_s`, then answer unknown_peer (D restarted, or never dialed)."""
        now = time.monotonic()
        _, deadline = self._unpeered.get(msg.transfer_id, (msg, now + self.cfg.handshake_timeout_s))
        if now < deadline:
            self._unpeered[msg.transfer_id] = (msg, deadline)
            return
        del self._unpeered[msg.transfer_id]
        self._fail_push(msg, m.PushFailCause.UNKNOWN_PEER, "unknown decode incarnation")

    def _retry_unpeered(self) -> None:
        for tid, (msg, _) in list(self._unpeered.items()):
            send = self._sends.get(tid)
            if send is None or send.writing:  # freed (lease, abort) or already written
                del self._unpeered[tid]
            else:
                self._start_write(msg)

    def _on_ended(self, ev: _Ended) -> None:
        if ev.request_id in self._recvs:  # D: a READ (pull)
            recv = self._recvs[ev.request_id]
            ok = ev.state is TransferState.DONE
            if not ok:
                self._pull_done(recv.spec, ok=False)
            self._received(ev.request_id, ok and not recv.aborted, ev.error or "aborted")
            return
        reg = self._regs.pop(ev.request_id, None)  # P: a WRITE (push)
        if ev.state is TransferState.ERROR and reg is not None:
            self._fail_push(reg.msg, m.PushFailCause.WRITE_FAILED, ev.error or "write failed")
        ack_to = self._abort_acks.pop(ev.request_id, None)
        if ack_to is not None:
            self.side.send(ack_to, m.PushAbortAck(transfer_id=ev.request_id))
        self._sent(ev.request_id)

    def _on_push_abort(self, msg: m.PushAbort) -> None:
        send = self._sends.get(msg.transfer_id)
        if send is not None and send.writing:
            self._abort_acks[msg.transfer_id] = msg.reply_to  # ack once the write ended
            return
        self._regs.pop(msg.transfer_id, None)
        self._unpeered.pop(msg.transfer_id, None)
        if send is not None:
            self._sent(msg.transfer_id)
        else:
            self._gone[msg.transfer_id] = time.monotonic() + self.cfg.registration_grace_s
        self.side.send(msg.reply_to, m.PushAbortAck(transfer_id=msg.transfer_id))

    def _on_claim(self, msg: m.PullClaim) -> None:
        send = self._sends.get(msg.transfer_id)
        if send is None and msg.transfer_id not in self._claims:
            # D may claim before vLLM handed us the finished request (one step later)
            deadline = time.monotonic() + self.cfg.registration_grace_s
            self._claims[msg.transfer_id] = (msg, deadline)
            return
        self._claims.pop(msg.transfer_id, None)
        error = None
        if send is None:
            error = "P no longer holds this request's blocks (lease over or never held)"
        elif send.claimed_by is not None:
            error = "already claimed"
        elif not set(msg.block_ids) <= set(send.spec.block_ids):
            error = "claimed blocks are not this request's"
        else:
            send.claimed_by = (msg.engine_id, msg.incarnation)
            send.deadline = time.monotonic() + self.cfg.lease_s
        self.side.send(msg.reply_to, m.PullClaimReply(nonce=msg.nonce, error=error))

    def _on_pull_done(self, msg: m.PullDone) -> None:
        send = self._sends.get(msg.transfer_id)
        if send is None:
            self._claims.pop(msg.transfer_id, None)
            self._gone[msg.transfer_id] = time.monotonic() + self.cfg.registration_grace_s
        elif send.claimed_by in (None, (msg.engine_id, msg.incarnation)):
            self._sent(msg.transfer_id)

    # -- deadlines ----------------------------------------------------------------------------
    def _tick(self, now: float) -> None:
        for rid, send in list(self._sends.items()):
            if not send.writing and send.deadline <= now:
                log.warning("pdserve vLLM connector: lease of %s ran out, freeing", rid)
                self._sent(rid)
        for tid in [t for t, deadline in self._gone.items() if deadline <= now]:
            del self._gone[tid]
        for claim, deadline in list(self._claims.values()):
            if deadline <= now:
                self._on_claim(claim)  # answered as unknown: P never had the request
        self._retry_unpeered()
        for tid, reg in list(self._regs.items()):
            if reg.deadline <= now:
                del self._regs[tid]
                self._fail_push(reg.msg, m.PushFailCause.UNKNOWN_TRANSFER, "no such request")
        self._heartbeat(now)
        for recv in list(self._recvs.values()):
            if recv.deadline <= now and recv.handle is None:
                self._fence(self._key(recv.spec), f"no KV after {self.cfg.recv_timeout_s} s")

    def _heartbeat(self, now: float) -> None:
        # Time this thread itself did not run (a starved process on a loaded host) is not
        # P's silence: its pongs may sit in our queue. Credit it to every P.
        stalled = now - self._last_beat - 2 * self.cfg.heartbeat_s
        self._last_beat = now
        if stalled > 0:
            for h in self._health.values():
                h.last_seen += stalled
        waited = {self._key(r.spec) for r in self._recvs.values()}
        for key in list(self._health):
            if key not in waited:
                del self._health[key]
                continue
            h = self._health[key]
            if now - h.last_seen > self.cfg.heartbeat_s * self.cfg.heartbeat_misses:
                silent = f"silent for {now - h.last_seen:.1f} s, {h.pongs} pongs before"
                self._fence(key, f"prefill {key[0]}@{key[1][:8]} stopped answering ({silent})")
            elif now >= h.next_ping:
                h.next_ping = now + self.cfg.heartbeat_s
                self.side.send(h.address, m.Ping(reply_to=self.side.address))

    def _forget(self, key: PeerKey) -> None:
        """Specs that name no incarnation no longer default to `key`'s."""
        for k, incarnation in list(self._incarnations.items()):
            if k[0] == key[0] and incarnation == key[1]:
                del self._incarnations[k]

    def _fence(self, key: PeerKey, why: str) -> None:
        """Declare P `key` gone: drop its connection (nothing more it writes lands) and fail
        every receive from it that is not a READ in flight (those end in ERROR by themselves)."""
        self._forget(key)
        peer = self._peers.pop(key, None)
        self._health.pop(key, None)
        if peer is not None:
            self.transport.remove_peer(peer)
        for rid, recv in list(self._recvs.items()):
            if self._key(recv.spec) == key and recv.handle is None:
                self._received(rid, False, why)
