"""The KV connector: the transfer core's machinery, shared by pull and push.

A connector moves a prompt's KV blocks from a prefill instance (P) to a decode
instance (D). It knows no engine: an engine calls it through
`pdserve.transfer.adapter.TransferCore`, sees its requests only as `RemoteRequest`
snapshots, and lends it blocks only through the `EngineSide` it was built with
(`self.engine`). It has two sides:

Scheduler side (called only from the engine thread; blocks move only through
`self.engine.take_blocks` / `free_blocks`, under the typed owners `Hold` / `Quarantine`):
  - `start_receive(req)`  D: the request was admitted with its prompt's blocks
    allocated (owner: its request id) and is now WAITING_FOR_REMOTE_KV. The
    connector starts the load (pull: READ from P; push: register with P).
  - `prefill_admitted(req)`  P: a prompt whose KV goes to D entered the engine.
  - `prefill_done(req, first_token)`  P: the prompt is computed. The connector takes
    the request's blocks (owner `Hold(transfer_id)`) and returns the
    `kv_transfer_params` for the router. The request itself then finishes.
  - `prefill_failed(req, reason)`  P: the prompt will never be computed (abort,
    error); push tells D at once.
  - `cancel_receive(req)`  D: the request ended while waiting for KV (abort,
    watchdog). Its blocks go to quarantine (`Quarantine(transfer_id)`) until no
    write or read can still land in them, then back to the engine.
  - `release_transfer(tid)`  P: the router will send no decode leg for this transfer
    (D refused or failed before its stream started, or the client left between the
    legs; `POST /kv/release`, pdserve.transfer.release). Frees a hold nobody uses yet at
    once; never one a reader claimed or a write in flight; idempotent.
  - `poll()`  applies what the worker threads reported (KV arrived, KV failed, P's
    hold released) and the deadlines; returns the events the engine must act on
    (`KVReady`, `KVFailed` with a typed cause).

Worker side (connector threads; never the engine thread, never `self.engine`):
  the side-channel receiver, and the mode's transfer thread(s): pull's lanes on D (one
  per prefill instance, so a dead or slow one delays only its own requests), push's
  registration lanes on D (the same, `lanes.py`) and its writer and completion watcher
  on P. They report to the engine thread through one event queue and
  wake it with `wake()`.

Who owns a block, at every moment (pdserve.transfer.adapter has the contract):
  P: request id (prefilling) -> `Hold(tid)` (lease: pull until D's PullDone or
     `lease_s`, restarted when a reader claims it; push until the WRITE completes,
     fails, or `lease_s` without a registration; both: or the router's release, which
     frees only a hold no reader claimed and no write was posted for, at once or, for a
     prompt still computing, as soon as it finishes) -> free. Push, a prompt that fails
     after a layer hook was made for it: request id -> `Hold(tid)` (no lease) until no
     layer write posted from its blocks is pending -> free.
  D: request id (WAITING_FOR_REMOTE_KV, guarded by `recv_timeout_s`) -> running
     request, or -> `Quarantine(tid)` (until the peer acknowledges that no
     transfer is in flight, the peer is dropped, or `quarantine_s` passes) -> free.
     When the peer is declared down (`_peer_down`), its links are closed first; push's
     blocks are then freed at once by the engine with the failed request (a registration
     not sent yet never will be), pull's are fenced until the lane's job ends (it may
     still be queued or claiming).

Bounded work for transfers nobody finishes (strangers' legs, lost legs):
  D: legs queued or waiting for KV from one prefill instance are capped
     (`max_waiting_per_peer`; more are refused at admission, cause `overloaded`), and the
     blocks reserved for remote KV are capped (`max_waiting_kv_fraction`; a leg over it
     waits in the queue). A peer the heartbeat finds silent, or an address that does not
     answer `handshake_tries` Hellos (within `handshake_timeout_s`), is given up on: its
     requests fail, its side-channel socket is closed and its lane ends. After the
     handshakes, unless the address once answered one (a peer restarting there must work
     at once; the heartbeat's verdict never starts a cooldown, for the same reason), legs
     naming it fail at once, without dialing, for `unreachable_cooldown_s`. A handshake
     nobody waits for any more stops. The side channel closes sockets idle for
     its `idle_s` (pdserve.transfer.side_channel).
  P: new P legs are refused while blocks held for transfers no decode instance has
     claimed (pull) or registered for (push) pass `max_unclaimed_hold_fraction` of the
     pool; push answers a registration for a transfer it never heard of with
     PushFailed(unknown_transfer) after `unknown_transfer_grace_s` (the transfer is known
     from the moment the engine admits its P leg: `prompts_alive`).

What goes back to the router: P's response carries `kv_transfer_params` (see
pdserve.transfer.params); D's stream is the client's answer. The first token is the
one P sampled (carried in the params for pull, in the WRITE's notification for
push), so D emits it as soon as the KV is in place, without a model step; an engine
whose D computes the prompt's last token again (vLLM) passes none (None throughout).

Failures: every request failed by the connector ends with an error made by
`transfer_error(cause, detail)` (pdserve.transfer.errors; causes: TRANSFER_ERROR_CAUSES),
which the HTTP layer answers as a 502 `kv_transfer_error` (400 for `params_rejected`).

Trust (details and a table in docs/transport.md, "Connector security"):
  With a cluster token, the transports and the side channel admit only peers that prove
  the token; side-channel frames are MAC'd and carry a nonce, so a captured frame sent
  again is dropped. Pull params are signed by P over every field D uses, including the
  lease's end (`expires_at`); D refuses unsigned or changed params (`check_params`) and
  expired ones before any message or READ. Whatever the token, D claims a hold (PullClaim)
  before reading it, and P grants it only for exactly the blocks it holds for that
  transfer, to one reader; a PullDone frees only its claimant's hold.
  The router's release of a hold (`POST /kv/release`) is verified by the HTTP front end
  with the token (pdserve.transfer.release) before it reaches the engine thread.
  With a token the HTTP front end also admits a P/D leg only with the router's signature
  over its params (pdserve.transfer.cluster_auth, checked in server/transfers.py), so a
  push D leg's peer coordinates come from the router, and nobody else can make D wait or
  dial, or make P hold blocks.
  Without a token nothing on the side channel is authenticated: anyone who reaches an
  instance's side-channel or HTTP port can send any message or params, and a client that
  knows a live transfer id and its block ids can read that prompt's KV through D; a push
  transfer is then protected only by the secrecy of its random transfer id.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from pdserve.config import ConnectorConfig
from pdserve.logsafe import Throttled, shown
from pdserve.threads import Thread
from pdserve.token_logprob import TokenLogprob
from pdserve.transfer import messages as m
from pdserve.transfer.adapter import (
    EngineSide,
    Event,
    Hold,
    KVFailed,
    KVReady,
    KVRegions,
    Quarantine,
    RemoteRequest,
)
from pdserve.transfer.descriptors import Desc, nbytes
from pdserve.transfer.errors import TransferCause
from pdserve.transfer.params import KVTransferParams
from pdserve.transfer.side_channel import Address, SideChannel, new_nonce
from pdserve.transfer.stats import ConnectorMetrics, ConnectorStats, WriterStats

if TYPE_CHECKING:
    from pdserve.transfer.transport import Transport

log = logging.getLogger(__name__)

# How long one blocking wait on a transfer lasts before it checks again (tcp wakes earlier).
# Only while a transfer is in flight (`run_transfer`): no thread waits on it when idle.
_TRANSFER_WAKE_S = 0.05
_MAX_MET = 1024  # addresses remembered as having answered a handshake once


class Arrived(msgspec.Struct, frozen=True):
    """Worker report: the KV of `transfer_id` landed."""

    transfer_id: str
    first_token_id: int | None
    prefill_done_time: float
    first_token_logprobs: TokenLogprob | None = None


class Failed(msgspec.Struct, frozen=True):
    """Worker report: the transfer `transfer_id` failed for good, for `cause`."""

    transfer_id: str
    error: str
    cause: TransferCause = TransferCause.TRANSFER_FAILED


@dataclass
class Peer:
    engine_id: str
    incarnation: str
    address: Address
    transport_peer: object
    num_blocks: int


@dataclass
class _Hold:
    """P: blocks kept for a transfer after the prompt finished."""

    transfer_id: str
    blocks: list[int]
    num_tokens: int
    first_token_id: int | None
    done_time: float
    deadline: float
    claimant: tuple[str, str] | None = None  # pull: the (engine id, incarnation) reading it


@dataclass
class _Receiving:
    """D: a request whose KV is on its way into its blocks (still the request's)."""

    req: RemoteRequest
    wait_start: float
    deadline: float  # the watchdog: `recv_timeout_s` after `wait_start`


@dataclass
class _Quarantine:
    blocks: list[int]
    deadline: float
    peer: Address | None  # the instance whose transfer might still land; None: unknown


class KVConnector:
    """Shared machinery: side channel, handshakes, peers, events, holds and quarantine."""

    def __init__(
        self,
        cfg: ConnectorConfig,
        kv: KVRegions,
        engine: EngineSide,
        compat: m.Compat,
        transport: Transport,
    ) -> None:
        self.cfg = cfg
        self.kv = kv
        self.engine = engine
        self.compat = compat
        self.transport = transport
        self.transport_kind = transport.kind
        self.wake: Callable[[], None] = lambda: None  # set by the engine driver
        self._events: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._peers: dict[str, Peer] = {}  # engine id -> peer
        self._peers_lock = threading.Lock()
        # P: blocks kept for transfers. The engine thread adds and removes them; the side
        # channel's receiver reads them and updates claimant/deadline (pull claims); both
        # under this lock, so a claimed hold is never expired behind the claimant's back.
        self.holds: dict[str, _Hold] = {}
        self.holds_lock = threading.Lock()
        self.quarantine: dict[str, _Quarantine] = {}  # engine thread only
        self.receiving: dict[str, _Receiving] = {}  # transfer id -> D request (engine thread)
        # P: transfer ids of prompts alive in this engine (engine thread writes, writer reads)
        self.prompts_alive: set[str] = set()
        self.stats = ConnectorStats()
        self._watched: frozenset[Address] = frozenset()  # peers we wait on (engine thread)
        self._pongs: dict[Address, float] = {}
        # D: addresses given up on (unreachable) -> until when legs naming them fail at once,
        # without dialing (under `_peers_lock`: lanes, heartbeat and engine thread use it).
        self._given_up: dict[Address, float] = {}
        # Addresses that once answered a handshake (most recent last, at most _MAX_MET):
        # never put in the cooldown, since a peer that restarts there must work at once.
        self._met: dict[Address, None] = {}
        self._warn = {c: Throttled(log) for c in TransferCause}  # one line per cause per 10 s
        self._closing = threading.Event()
        # Set while the heartbeat has peers to ping (`poll` sets it; the heartbeat clears it
        # and sleeps on it when there are none, so an idle instance's heartbeat never wakes).
        self._watching = threading.Event()
        self.side = SideChannel(
            self._on_message,
            cfg.side_host,
            cfg.side_port,
            cfg.cluster_token,
            advertise_host=cfg.side_advertise_host,
        )
        self._heartbeat = Thread(target=self._heartbeat_loop, name="pdserve-heartbeat", daemon=True)
        self._heartbeat.start()

    # -- scheduler side (pdserve.transfer.adapter.TransferCore) -----------------------------
    @property
    def side_address(self) -> Address:
        return self.side.address

    def start_receive(self, req: RemoteRequest) -> None:
        """D: remember the waiting request and arm its watchdog; the mode starts the load."""
        now = time.monotonic()
        self.receiving[req.transfer_id] = _Receiving(req, now, now + self.cfg.recv_timeout_s)

    def prefill_admitted(self, req: RemoteRequest) -> None:
        """P: the prompt of `req` is queued or computing here (`prompts_alive`)."""
        self.prompts_alive.add(req.transfer_id)

    def prefill_done(self, req: RemoteRequest, first_token: int | None) -> KVTransferParams:
        """P: take the prompt's blocks (`Hold`) and return the params for the router."""
        try:
            return self._prefill_done(req, first_token)
        finally:
            # After the mode heard of the end: push's writer decides that a registration's
            # prompt never came only when the prompt is not alive and nothing is queued to it.
            self.prompts_alive.discard(req.transfer_id)

    def prefill_failed(self, req: RemoteRequest, reason: str) -> None:
        """P: the prompt will never be computed (abort, error)."""
        try:
            self._prefill_failed(req, reason)
        finally:
            self.prompts_alive.discard(req.transfer_id)

    def _prefill_done(self, req: RemoteRequest, first_token: int | None) -> KVTransferParams:
        raise NotImplementedError

    def check_params(self, params: KVTransferParams) -> None:
        """D: raise InvalidKVTransferParams if a decode leg with `params` must not be
        admitted here (mode hook; pull verifies P's signature). Any thread; no side effect."""

    def layer_hook(
        self, reqs: list[RemoteRequest], done_after_last_layer: bool = False
    ) -> Callable[[int], None] | None:
        """P: a per-layer callback for a step that completes these prompts, or None
        (`done_after_last_layer`: see pdserve.transfer.push)."""
        return None

    def _prefill_failed(self, req: RemoteRequest, reason: str) -> None:
        """Mode hook; default: nothing was promised to anyone yet."""

    def decode_waiting(self, tid: str) -> bool:
        """P: whether a decode instance already asked for `tid` while its prompt is not
        finished here (push: its registration came; pull: its claim waits). Any thread;
        for logs: the point of push is that D asks before P is done. Mode hook."""
        return False

    def decline_transfer(self, params: KVTransferParams) -> None:
        """D (engine thread): a decode leg with `params` will not load its KV after all
        (vLLM computes a one-token or fully cached prompt itself, or the request ended
        before it was admitted): tell its P to free what it holds for it now. Mode hook."""

    def release_transfer(self, tid: str) -> None:
        """P (engine thread): the router's release of `tid` (module doc); mode hook."""
        raise NotImplementedError

    def release_unclaimed(self, tid: str) -> bool:
        """Free the hold of `tid` if no reader has claimed it (engine thread; a claim
        comes on the receiver thread, so both decide under `holds_lock`). True if freed."""
        with self.holds_lock:
            h = self.holds.get(tid)
            if h is None or h.claimant is not None:
                return False
            del self.holds[tid]
        self.engine.free_blocks(h.blocks, Hold(tid))
        self.stats.released_by_router += 1
        log.debug("released hold %s (the router's release)", shown(tid))
        return True

    def cancel_receive(self, req: RemoteRequest) -> None:
        """D: fence the request's blocks (`Quarantine`) until no transfer can land in them.

        A transfer the workers already reported as failed is over: nothing is fenced and
        the engine frees the blocks as usual.
        """
        tid = req.transfer_id
        if self.receiving.pop(tid, None) is None:
            return
        self._fence(tid, req.request_id, req.remote_address)
        self._on_cancel(tid)

    def _fence(self, tid: str, request_id: str, peer: Address | None) -> None:
        """D: take the request's blocks into quarantine (engine thread)."""
        blocks = self.engine.take_blocks(request_id, Quarantine(tid))
        if blocks:
            deadline = time.monotonic() + self.cfg.quarantine_s
            self.quarantine[tid] = _Quarantine(blocks, deadline, peer)

    def _on_cancel(self, tid: str) -> None:
        """Mode hook: tell whoever may still touch the blocks."""

    # -- engine thread: events and deadlines --------------------------------------------------
    def has_events(self) -> bool:
        """Whether a worker has reported something `poll` would apply (any thread; cheap)."""
        return not self._events.empty()

    def poll(self) -> list[Event]:
        """Drain worker reports, release holds and quarantines, enforce deadlines."""
        out: list[Event] = []
        while True:
            try:
                item = self._events.get_nowait()
            except queue.Empty:
                break
            out += self._apply(item)
        out += self._expire(time.monotonic())
        self._watched = frozenset(
            {r.req.remote_address for r in self.receiving.values()}
            | {q.peer for q in self.quarantine.values()}
        ) - {None}
        if self._watched and not self._watching.is_set():
            self._watching.set()
        return out

    def _apply(self, item: object) -> list[Event]:
        if isinstance(item, ReleaseHold):
            self.release_hold(item.transfer_id, item.reason)
        elif isinstance(item, ReleaseQuarantine):
            self.release_quarantine(item.transfer_id)
        elif isinstance(item, PeerDown):
            return self._peer_down(item)
        elif isinstance(item, (Arrived, Failed)):
            # An outcome counts only while its request still waits; else it is stale.
            r = self.receiving.pop(item.transfer_id, None)
            if r is None:
                return []
            rid = r.req.request_id
            if isinstance(item, Failed):
                self.stats.failures += 1
                return [KVFailed(rid, item.cause, item.error)]
            self._count_arrival(time.monotonic() - r.wait_start, item.prefill_done_time)
            lp = item.first_token_logprobs
            return [KVReady(rid, item.first_token_id, item.prefill_done_time, lp)]
        return []

    def _expire(self, now: float) -> list[Event]:
        with self.holds_lock:
            expired = [t for t, h in self.holds.items() if h.deadline < now]
        for tid in expired:
            if self.release_hold(tid, "lease expired", only_before=now):
                self.stats.lease_expired += 1
        for tid in [t for t, q in self.quarantine.items() if q.deadline < now]:
            self._warn[TransferCause.TIMEOUT].warning(
                "quarantine of %s ended by its deadline", shown(tid)
            )
            self.release_quarantine(tid)
        late = [(t, r.req) for t, r in self.receiving.items() if r.deadline < now]
        out: list[Event] = []
        for tid, req in late:
            self.stats.recv_timeouts += 1
            what = f"no KV from the prefill instance within {self.cfg.recv_timeout_s:.0f} s"
            out.append(KVFailed(req.request_id, TransferCause.TIMEOUT, f"{what} ({tid})"))
        return out

    def _peer_down(self, down: PeerDown) -> list[Event]:
        """A peer stopped answering: nothing it owed us will come.

        Its transport links are closed first, so no write or read from it can land after
        this (tcp: our receiver owns the socket; nixl: the remote agent is dropped, which
        leaves a wedged-but-alive peer's already-posted RDMA write as the residual risk).
        Then the blocks fenced for it are released and its waiting requests fail.
        """
        self.stats.peers_down += 1
        where = shown(f"{down.address[0]}:{down.address[1]}")
        self._warn[down.cause].warning("peer at %s is down: %s", where, down.reason)
        self._forget_peer(down.address, keep=down.restarted_as)
        lost = [(t, r.req) for t, r in self.receiving.items() if down.ends(r.req)]
        for tid, req in lost:
            del self.receiving[tid]
            self._abandon(tid, req)
        for tid in [t for t, q in self.quarantine.items() if q.peer == down.address]:
            self.release_quarantine(tid)
        self.side.forget(down.address)  # after `_abandon`: no lane job still wants it
        self._on_peer_gone(down.address)
        msg = f"the prefill instance at {where} {down.reason}"
        return [KVFailed(r.request_id, down.cause, msg) for _, r in lost]

    def _abandon(self, tid: str, req: RemoteRequest) -> None:
        """D, engine thread: `req` fails because its peer is gone, and the engine frees its
        blocks next unless this hook fences them (`_fence`). Mode hook: make sure no worker
        starts a transfer into them later (the peer's transport links are already closed,
        so nothing in flight can land)."""

    def _on_peer_gone(self, address: Address) -> None:
        """D, engine thread: mode hook: end the worker (lane) of a peer declared down."""

    def _forget_peer(self, address: Address, keep: str | None = None) -> None:
        """Drop the handshaked peers at `address` (but incarnation `keep`: a restarted peer
        D may have met again since) and their transport links."""
        with self._peers_lock:
            gone = [
                e
                for e, p in self._peers.items()
                if p.address == address and (keep is None or p.incarnation != keep)
            ]
            peers = [self._peers.pop(e) for e in gone]
        for p in peers:
            self.transport.remove_peer(p.transport_peer)

    def _give_up_on(self, address: Address) -> None:
        """D: legs naming `address` fail at once, without dialing, for the cooldown, unless
        it once answered a handshake (then it may be restarting: the next leg dials it)."""
        now = time.monotonic()
        with self._peers_lock:
            if address in self._met:
                return
            for addr in [a for a, until in self._given_up.items() if until <= now]:
                del self._given_up[addr]  # ended: strangers' addresses must not pile up
            if address not in self._given_up:
                self.stats.peers_given_up += 1
            self._given_up[address] = now + self.cfg.unreachable_cooldown_s

    def given_up(self, address: Address) -> bool:
        """D: whether `address` is in its unreachable cooldown (any thread)."""
        with self._peers_lock:
            until = self._given_up.get(address)
            if until is not None and until <= time.monotonic():
                del self._given_up[address]
                until = None
        return until is not None

    def _is_peer_address(self, address: Address) -> bool:
        with self._peers_lock:
            return any(p.address == address for p in self._peers.values())

    # -- heartbeat (its own thread) -------------------------------------------------------
    def _heartbeat_loop(self) -> None:
        last_seen: dict[Address, float] = {}
        last_beat = time.monotonic()
        while not self._closing.is_set():
            if not self._watched and not last_seen:  # nobody to ping: sleep until `poll`
                self._watching.clear()
                if not self._watched:  # checked after the clear: `poll` sets it after
                    self._watching.wait()
                last_beat = time.monotonic()  # that sleep was not a stall
            if self._closing.wait(self.cfg.heartbeat_s):
                break
            now = time.monotonic()
            # Time this thread itself did not run (a starved process on a loaded host) is
            # not the peers' silence: their pongs may sit unread. Credit it to every peer.
            stalled = now - last_beat - 2 * self.cfg.heartbeat_s
            last_beat = now
            if stalled > 0:
                for addr in last_seen:
                    last_seen[addr] += stalled
            watched = self._watched
            for addr in watched:
                if self.given_up(addr):  # its requests are failing already: do not dial it
                    last_seen.pop(addr, None)
                    continue
                seen = self._pongs.get(addr, 0.0)
                last_seen[addr] = max(last_seen.get(addr, now), seen)
                if now - last_seen[addr] > self.cfg.heartbeat_s * self.cfg.heartbeat_misses:
                    self.report(PeerDown(addr, "stopped answering"))
                    last_seen.pop(addr)
                    continue
                self.side.send(addr, m.Ping(reply_to=self.side.address))
            for addr in set(last_seen) - watched:
                del last_seen[addr]
                self._pongs.pop(addr, None)
                if not self._is_peer_address(addr):  # nobody we know: keep no socket to it
                    self.side.forget(addr)

    def _on_pong(self, pong: m.Pong) -> None:
        addr = tuple(pong.address)
        with self._peers_lock:
            known = [p for p in self._peers.values() if p.address == addr]
        if any(p.incarnation != pong.incarnation for p in known):
            self.report(
                PeerDown(addr, "restarted (new incarnation)", restarted_as=pong.incarnation)
            )
        if addr in self._watched:  # only peers we ping: a stranger's Pongs must not pile up
            self._pongs[addr] = time.monotonic()

    def hold(
        self, req: RemoteRequest, first_token: int | None, done_time: float, lease: bool
    ) -> _Hold:
        """P: take the finished request's blocks (`Hold`); with `lease`, `poll` expires them."""
        tid = req.transfer_id
        blocks = self.engine.take_blocks(req.request_id, Hold(tid))
        deadline = time.monotonic() + self.cfg.lease_s if lease else float("inf")
        h = _Hold(tid, blocks, req.num_tokens, first_token, done_time, deadline)
        with self.holds_lock:
            self.holds[tid] = h
        return h

    def hold_failed(self, req: RemoteRequest) -> bool:
        """P: take the blocks of a prompt that failed while transfers may still read them
        (`Hold`, no lease: the mode frees it once none does). False, and no hold, when the
        engine gives none (vLLM lends them only when it delayed their free)."""
        tid = req.transfer_id
        blocks = self.engine.take_blocks(req.request_id, Hold(tid))
        if not blocks:
            return False
        h = _Hold(tid, blocks, req.num_tokens, None, time.time(), float("inf"))
        with self.holds_lock:
            self.holds[tid] = h
        return True

    def release_hold(self, tid: str, reason: str, only_before: float | None = None) -> bool:
        """Free the hold of `tid` (engine thread); with `only_before`, only if its deadline
        is still before that time (a claim may have just extended it). True if freed."""
        with self.holds_lock:
            h = self.holds.get(tid)
            if h is None or (only_before is not None and h.deadline >= only_before):
                return False
            del self.holds[tid]
        self.engine.free_blocks(h.blocks, Hold(tid))
        log.debug("released hold %s (%s)", shown(tid), reason)
        return True

    def release_quarantine(self, tid: str) -> None:
        q = self.quarantine.pop(tid, None)
        if q is not None:
            self.engine.free_blocks(q.blocks, Quarantine(tid))

    def unclaimed_blocks(self) -> int:
        """P: blocks held for transfers no decode instance has claimed (pull: PullClaim;
        push: a registration paired with the prompt) yet. Engine thread; claimants are set
        by the receiver (pull) or the writer (push) under `holds_lock`."""
        with self.holds_lock:
            return sum(len(h.blocks) for h in self.holds.values() if h.claimant is None)

    def num_blocks_held(self) -> int:
        """Blocks the connector owns (holds and quarantine), for integrity checks."""
        # list() copies each dict in one step under the GIL: /metrics calls this from the
        # event loop while the engine thread adds and removes entries.
        held = sum(len(h.blocks) for h in list(self.holds.values()))
        return held + sum(len(q.blocks) for q in list(self.quarantine.values()))

    def metrics(self) -> ConnectorMetrics:
        """The counters now (racy reads of ints and floats; any thread)."""
        return ConnectorMetrics(
            mode=self.cfg.mode,
            stats=msgspec.structs.replace(self.stats),
            blocks_held=self.num_blocks_held(),
            writer=self._writer_stats(),
            stopped=self.stopped(),
        )

    def stopped(self) -> list[str]:
        """What the connector needs running and no longer runs (a dead thread or listener),
        by name; the instance's /health answers 503 while this is not empty. Any thread."""
        if self._closing.is_set():
            return []  # closing: its threads end on purpose
        parts = self.side.stopped() + self.transport.stopped()
        return parts + self._dead_threads([self._heartbeat])

    @staticmethod
    def _dead_threads(threads: list[threading.Thread]) -> list[str]:
        return [f"thread {t.name}" for t in threads if not t.is_alive()]

    def _writer_stats(self) -> WriterStats | None:
        return None

    def transfer_in_use(self, tid: str) -> bool:
        """Whether blocks are still held, fenced or awaited under `tid` (a lock-free read of
        engine-thread dicts: membership tests only, any thread)."""
        return tid in self.holds or tid in self.quarantine or tid in self.receiving

    def transfers_in_use(self) -> list[str]:
        """The transfer ids `transfer_in_use` answers True for (list copies: any thread)."""
        return [*list(self.holds), *list(self.quarantine), *list(self.receiving)]

    def count_refused_leg(self) -> None:
        """The engine refused a P/D leg at admission (its side's caps)."""
        self.stats.legs_refused += 1

    def has_pending(self) -> bool:
        return bool(self.holds or self.quarantine or self.receiving)

    def report(self, item: object) -> None:
        """Worker threads: hand something to the engine thread and wake it."""
        self._events.put(item)
        self.wake()

    # -- peers and handshakes (worker threads) ------------------------------------------------
    def peer(
        self,
        engine_id: str,
        address: Address,
        incarnation: str | None = None,
        wanted: Callable[[], bool] | None = None,
    ) -> Peer:
        """The peer at `address`, handshaking first if it is new or has restarted.

        The handshake stops as soon as `wanted()` is False (nobody waits for it any more).
        An address D gave up on fails at once, without dialing (`unreachable_cooldown_s`).
        """
        with self._peers_lock:
            known = self._peers.get(engine_id)
        if known and known.address == address and incarnation in (None, known.incarnation):
            return known
        self._check_not_given_up(address)
        return self._handshake(engine_id, address, wanted)

    def _check_not_given_up(self, address: Address) -> None:
        if self.given_up(address):
            raise TransferError(
                f"gave up on {shown(address[0])}:{address[1]} (unreachable); "
                f"not dialing it again for {self.cfg.unreachable_cooldown_s:g} s",
                TransferCause.PEER_UNREACHABLE,
            )

    def _handshake(
        self, engine_id: str, address: Address, wanted: Callable[[], bool] | None = None
    ) -> Peer:
        """Hello, up to `handshake_tries` times, each wait twice the previous one, within
        `handshake_timeout_s` in all; after the last, D gives up on the address."""
        reply = self._hello(address, wanted)
        if reply is None:
            if wanted is not None and not wanted():
                raise TransferError("handshake abandoned: no request waits for it any more")
            tries, timeout = max(1, self.cfg.handshake_tries), self.cfg.handshake_timeout_s
            what = f"timed out after {timeout:g} s ({tries} tries)"
            self._unreachable(address, f"did not answer: its handshake {what}")
            raise TransferError(
                f"handshake with {shown(engine_id)} at {shown(address[0])}:{address[1]} {what}",
                TransferCause.PEER_UNREACHABLE,
            )
        if reply.error:
            raise TransferError(
                f"handshake with {shown(engine_id)} refused: {shown(reply.error, 400)}"
            )
        if reply.engine_id != engine_id:
            raise TransferError(
                f"expected engine {shown(engine_id)} at {shown(address[0])}:{address[1]}, "
                f"found {shown(reply.engine_id)}",
                TransferCause.PEER_UNREACHABLE,
            )
        return self._add_peer(
            reply.engine_id,
            reply.incarnation,
            address,
            reply.compat,
            reply.num_blocks,
            reply.transport_metadata,
        )

    def _hello(self, address: Address, wanted: Callable[[], bool] | None) -> m.HelloReply | None:
        """The peer's HelloReply, or None when every try timed out (or nobody wants it)."""
        tries = max(1, self.cfg.handshake_tries)
        wait = self.cfg.handshake_timeout_s / (2**tries - 1)
        for _ in range(tries):
            if (wanted is not None and not wanted()) or self.given_up(address):
                return None
            hello = m.Hello(
                nonce=new_nonce(),
                engine_id=self.cfg.engine_id,
                incarnation=self.cfg.incarnation,
                reply_to=self.side.address,
                compat=self.compat,
                num_blocks=self.kv.num_blocks,
                transport_metadata=self.transport.local_metadata(),
            )
            try:
                reply = self.side.request(address, hello, wait, wanted)
            except TimeoutError:
                wait *= 2
                continue
            assert isinstance(reply, m.HelloReply)
            return reply
        return None

    def _unreachable(self, address: Address, reason: str) -> None:
        """Worker thread: D gives up on `address`: no more dialing it for the cooldown, and
        the engine thread fails every request waiting on it (`_peer_down`)."""
        self._give_up_on(address)
        self.side.forget(address)
        self.report(PeerDown(address, reason, TransferCause.PEER_UNREACHABLE))

    def _add_peer(
        self,
        engine_id: str,
        incarnation: str,
        address: Address,
        compat: m.Compat,
        num_blocks: int,
        metadata: bytes,
    ) -> Peer:
        diff = self.compat.mismatch(compat)
        if diff:
            raise TransferError(f"instance {engine_id} is incompatible: {diff}")
        handle = self.transport.add_peer(metadata)
        peer = Peer(engine_id, incarnation, address, handle, num_blocks)
        with self._peers_lock:
            self._peers[engine_id] = peer
            self._met.pop(address, None)
            self._met[address] = None
            if len(self._met) > _MAX_MET:
                del self._met[next(iter(self._met))]
        return peer

    def _answer_hello(self, msg: m.Hello) -> None:
        reply = m.HelloReply(
            nonce=msg.nonce,
            engine_id=self.cfg.engine_id,
            incarnation=self.cfg.incarnation,
            compat=self.compat,
            num_blocks=self.kv.num_blocks,
            transport_metadata=self.transport.local_metadata(),
        )
        try:
            self._add_peer(
                msg.engine_id,
                msg.incarnation,
                tuple(msg.reply_to),
                msg.compat,
                msg.num_blocks,
                msg.transport_metadata,
            )
        except Exception as exc:
            reply.error = str(exc)
        self.side.send(tuple(msg.reply_to), reply)

    def peer_sizes(self) -> dict[str, tuple[str, int]]:
        """Engine id -> (incarnation, KV blocks) of every peer known from a handshake."""
        with self._peers_lock:
            return {e: (p.incarnation, p.num_blocks) for e, p in self._peers.items()}

    def known_peer(self, engine_id: str, incarnation: str) -> Peer | None:
        with self._peers_lock:
            p = self._peers.get(engine_id)
        return p if p and p.incarnation == incarnation else None

    def remote_num_blocks(self, engine_id: str, incarnation: str) -> int | None:
        """The KV blocks of a peer known from a handshake, or None (any thread)."""
        peer = self.known_peer(engine_id, incarnation)
        return peer.num_blocks if peer is not None else None

    def descriptors(self, peer: Peer, local_blocks: list[int], remote_blocks: list[int]):
        """(local, remote) descriptor lists for whole blocks, adjacent runs coalesced."""
        return self.kv.descriptors(peer.num_blocks, local_blocks, remote_blocks)

    # -- transfers (worker threads) ---------------------------------------------------------
    def post_transfer(
        self, kind: str, peer: Peer, local: list[Desc], remote: list[Desc], notif: bytes | None
    ) -> object:
        """Post a READ or WRITE of the KV region; returns the transport's handle."""
        post = self.transport.write if kind == "write" else self.transport.read
        return post(peer.transport_peer, local, remote, notif)

    def transfer_state(self, handle: object) -> tuple[bool, str | None]:
        """(finished, error message or None); a finished handle is released."""
        return self.transport.poll(handle)

    def run_transfer(
        self, kind: str, peer: Peer, local: list[Desc], remote: list[Desc], notif: bytes | None
    ) -> None:
        """Post and wait until the transport finishes (its own timeout bounds the wait)."""
        t0 = time.monotonic()
        handle = self.post_transfer(kind, peer, local, remote, notif)
        done, error = self.transfer_state(handle)
        while not done:  # blocking, not a sleep loop: this runs on D's core during every READ
            done, error = self.transport.wait(handle, _TRANSFER_WAKE_S)
        if error:
            raise TransferError(f"KV {kind} failed: {error}")
        self.count_transfer(nbytes(local), len(local), time.monotonic() - t0)

    def count_transfer(self, nbytes: int, ndesc: int, seconds: float) -> None:
        self.stats.bytes_moved += nbytes
        self.stats.descriptors += ndesc
        self.stats.transfers += 1
        self.stats.transfer_seconds += seconds
        self.stats.transfer_time.observe(seconds)

    def _count_arrival(self, wait: float, prefill_done_time: float) -> None:
        self.stats.recv_wait_seconds += wait
        self.stats.recv_wait_time.observe(wait)
        self.stats.received += 1
        if prefill_done_time > 0:  # 0: P did not say (pull params from an older P)
            # P's clock against D's: exact on one host, as good as clock sync across hosts.
            self.stats.handoff_time.observe(max(0.0, time.time() - prefill_done_time))

    def _on_message(self, msg: m.Message) -> None:
        if isinstance(msg, m.Hello):
            self._answer_hello(msg)
        elif isinstance(msg, m.Ping):
            pong = m.Pong(
                engine_id=self.cfg.engine_id,
                incarnation=self.cfg.incarnation,
                address=self.side.address,
            )
            self.side.send(tuple(msg.reply_to), pong)
        elif isinstance(msg, m.Pong):
            self._on_pong(msg)
        else:
            self.on_message(msg)

    def on_message(self, msg: m.Message) -> None:
        """Mode hook for the side channel's other messages (receiver thread)."""

    def close(self) -> None:
        self._closing.set()
        self._watching.set()  # wake an idle heartbeat
        self._heartbeat.join(2.0)
        self.side.close()
        self.transport.close()


class TransferError(RuntimeError):
    """A transfer-level failure reported to the client as a clear error, for `cause`."""

    def __init__(self, message: str, cause: TransferCause = TransferCause.TRANSFER_FAILED) -> None:
        super().__init__(message)
        self.cause = cause


class ReleaseHold(msgspec.Struct, frozen=True):
    transfer_id: str
    reason: str


class ReleaseQuarantine(msgspec.Struct, frozen=True):
    transfer_id: str


class PeerDown(msgspec.Struct, frozen=True):
    """Heartbeat or lane report: the peer at `address` is gone (or restarted), or D gave up
    reaching it (`cause` peer_unreachable)."""

    address: Address
    reason: str
    cause: TransferCause = TransferCause.PEER_DOWN
    # Set when the peer answered as a new incarnation: the requests whose params already
    # name that incarnation (legs admitted after the restart) are not lost, only the old
    # incarnation's are.
    restarted_as: str | None = None

    def ends(self, req: RemoteRequest) -> bool:
        """Whether `req`, waiting for KV, fails with this peer."""
        if req.remote_address != self.address:
            return False
        return self.restarted_as is None or req.params.remote_incarnation != self.restarted_as
