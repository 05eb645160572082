"""The nixl backend: NIXL (UCX by default, LIBFABRIC for EFA) moves the bytes.

Set-up per peer (in `add_peer`, never in a transfer): the authenticated handshake of
`handshake` runs on a side TCP connection; only then are the NIXL agent metadata exchanged
(both ways), loaded, the peer's prepped descriptor lists built, and one tiny WRITE with a
notification done in each direction, which pays UCX's connection set-up (tens to hundreds
of ms) up front. The side connection then stays open: its EOF tells us at once that the
peer process is gone.

Progress: the agent runs without NIXL's progress thread (which busy-polls a whole core per
agent in the Python API). Progress happens inside our calls: `state()`/`wait()` on the
initiator, `get_notifs()`/`wait_notifs()` on the target. With UCX, a WRITE completes only
once the target made progress too, so a target should poll notifications while it expects
data (the connectors do). As a safety net a background thread pumps every
`BACKGROUND_PROGRESS_S`, so a target that does not poll delays transfers by at most that
instead of stalling them until the timeout; idle, it costs about 1% of a core.

Notifications carry a one-byte prefix on the wire (b"U" user, b"H" warm-up) so internal
traffic never reaches `get_notifs()`.

What the cluster token protects here: nobody gets our NIXL metadata (the key to RDMA into
our memory) or has theirs loaded by us without passing the challenge-response. It does not
authenticate or encrypt the UCX/libfabric traffic itself: whoever obtains the metadata
(e.g. by sniffing the side connection, which is not encrypted) can write into registered
memory. NIXL checks every remote descriptor against the peer's registrations when a
transfer is created; on RDMA the NIC enforces the registration (rkey) too.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import socket
import threading
import time
from typing import Any

import msgspec
import numpy as np

from pdserve.config import TransportConfig
from pdserve.threads import Thread
from pdserve.transfer.transport.base import (
    BackendUnavailableError,
    DescriptorError,
    Descs,
    Notification,
    Op,
    PeerCard,
    PeerError,
    PeerId,
    TransferHandle,
    TransferState,
    decode_card,
)
from pdserve.transfer.transport.handshake import (
    Listener,
    Me,
    advertised_host,
    answer,
    dial,
    tcp_server,
)
from pdserve.transfer.transport.memory import Region, RegionTable, span_of
from pdserve.transfer.transport.nixl_peer import (
    NixlInfo,
    NixlPeer,
    address_rows,
    agent_name,
    expand_granules,
    granule_rows,
    load_nixl,
    single_mem,
)
from pdserve.transfer.transport.peers import PeerTable
from pdserve.transfer.transport.registry import Inbox, Transfers, Xfer, check_notif, prepare
from pdserve.transfer.transport.wire import Deadline, Ready, recv_frame, send_frame

log = logging.getLogger(__name__)

USER, HELLO = b"U", b"H"
BACKGROUND_PROGRESS_S = 0.01
SPIN_S = 0.2  # wait() spins (yielding the GIL) this long: polling is what moves data
POLL_S = 0.0002  # ...then polls this often; also the pace of the warm-up
NOTIF_POLL_S = 0.001  # wait_notifs() polls this often
_DIAL_HELLO, _ACCEPT_HELLO = HELLO + b"dial", HELLO + b"accept"


def _one_row(addr: int) -> np.ndarray:
    return np.array([(addr, 8, 0)], dtype=np.uint64)


class NixlTransport:
    """Transport over a NIXL agent (see `base.Transport` for the contract)."""

    def __init__(self, config: TransportConfig, engine_id: str) -> None:
        if not engine_id:
            raise ValueError("engine_id must not be empty")
        self._api = load_nixl()
        self.timeout_s = config.timeout_s
        self.regions = RegionTable()
        self.transfers = Transfers()
        self.inbox = Inbox()
        self._token = config.cluster_token
        self._id = PeerId(engine_id, secrets.token_hex(8))
        self._started_ns = time.time_ns()
        self._lock = threading.RLock()  # serialises every agent call and peer bookkeeping
        self._agent = self._make_agent(config.nixl_backend)
        self._local_lists: dict[int, Any] = {}
        self._names: dict[str, PeerId] = {}  # NIXL agent name -> peer
        self._hellos: set[tuple[str, bytes]] = set()
        self._zombies: list[Any] = []  # transfer handles NIXL could not release yet
        self._scratch = np.zeros(8, dtype=np.uint8)
        self._agent.register_memory([(self._scratch.ctypes.data, 8, 0, "")], "DRAM")
        self._peers: PeerTable[NixlPeer] = PeerTable(self._id)
        self._closed = False
        self._host = advertised_host(config.host, config.advertise_host)
        self._listener = Listener(
            tcp_server(config.host, config.port), self._on_accept, f"nixl-{engine_id}"
        )
        self._stop = threading.Event()
        self._progress = Thread(
            target=self._background, name=f"nixl-progress-{engine_id}", daemon=True
        )
        self._progress.start()

    def _background(self) -> None:
        while not self._stop.wait(BACKGROUND_PROGRESS_S):
            try:
                self._pump()
            except Exception as exc:  # never let the safety net die silently
                log.warning("nixl background progress: %s", exc)

    def _make_agent(self, backend: str) -> Any:
        api = self._api
        conf = api.nixl_agent_config(
            enable_prog_thread=False,
            enable_listen_thread=False,
            backends=[],
            sync_mode=api.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
        )
        agent = api.nixl_agent(f"{self._id.engine_id}#{self._id.incarnation}", conf)
        plugins = agent.get_plugin_list()
        if backend not in plugins:
            raise BackendUnavailableError(f"NIXL has no {backend} plugin here (found: {plugins})")
        agent.create_backend(backend, {})
        return agent

    @property
    def peer_id(self) -> PeerId:
        return self._id

    # -- regions and metadata ---------------------------------------------------------------
    def register(self, name: str, memory: Any, *, granule: int | None = None) -> int:
        span = span_of(memory)
        with self._lock:
            region = self.regions.add(name, span, granule)
            region.backend_handle = self._agent.register_memory(
                [(span.ptr, span.size, span.device, "")], span.mem
            )
            if granule:
                rows = granule_rows(span.ptr, span.size, span.device, granule)
                self._local_lists[region.id] = self._agent.prep_xfer_dlist(
                    "NIXL_INIT_AGENT", rows, span.mem
                )
        return region.id

    def _card(self) -> PeerCard:
        return PeerCard(
            kind="nixl",
            engine_id=self._id.engine_id,
            incarnation=self._id.incarnation,
            started_ns=self._started_ns,
            host=self._host,
            port=self._listener.port,
            regions=self.regions.infos(),
        )

    def local_metadata(self) -> bytes:
        return msgspec.msgpack.encode(self._card())

    def _me(self) -> Me:
        with self._lock:
            md = self._agent.get_agent_metadata()
        bases = {r.id: r.span.ptr for r in self.regions.all()}
        info = NixlInfo(md, self._scratch.ctypes.data, bases)
        return Me(self._card(), self._token, msgspec.msgpack.encode(info))

    # -- peers ------------------------------------------------------------------------------
    def add_peer(self, metadata: bytes) -> PeerId:
        card = decode_card(metadata, "nixl")
        slot = self._peers.check(card)
        if slot is not None and any(p.alive for p in slot.links):
            return card.peer_id
        sock, welcome = dial(card, self._me(), self.timeout_s)
        peer = None
        try:
            peer = self._attach(welcome.card, welcome.extra, sock)
            self._warm_up(peer, send_first=True)
            if not isinstance(recv_frame(sock, Deadline(self.timeout_s, "warm-up")), Ready):
                raise PeerError(f"peer {card.peer_id} did not finish the warm-up")
        except Exception as exc:
            self._abandon(peer, sock, exc)
            raise
        self._watch(peer)
        return card.peer_id

    def _on_accept(self, sock: socket.socket) -> None:
        attached: list[NixlPeer] = []

        def admit(card: PeerCard, extra: bytes) -> bytes:
            self._peers.check(card)
            attached.append(self._attach(card, extra, sock))
            return self._me().extra

        try:
            answer(sock, Me(self._card(), self._token), admit, self.timeout_s)
            self._warm_up(attached[0], send_first=False)
            send_frame(sock, Ready(), Deadline(self.timeout_s, "warm-up"))
        except Exception as exc:
            self._abandon(attached[0] if attached else None, sock, exc)
            raise
        self._watch(attached[0])

    def _attach(self, card: PeerCard, extra: bytes, sock: socket.socket) -> NixlPeer:
        """Load the peer's NIXL metadata, prepare its descriptor lists, admit it."""
        try:
            info = msgspec.msgpack.decode(extra, type=NixlInfo)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise PeerError(f"invalid nixl handshake data from {card.peer_id}: {exc}") from None
        with self._lock:
            if self._closed:
                raise PeerError("transport is closed")
            name = self._agent.add_remote_agent(info.agent_md)
            name = name.decode() if isinstance(name, bytes) else name
            if name != agent_name(card):
                raise PeerError(f"NIXL metadata of {card.peer_id} names agent {name!r}")
            peer = NixlPeer(card, info, name, sock, self._prep_remote(card, info, name))
            replaced = self._peers.admit(card, peer, alive=lambda x: x.alive)
            self._names[name] = card.peer_id
        for old in replaced:
            self._retire(old, f"peer restarted as incarnation {card.incarnation[:8]}")
        return peer

    def _prep_remote(self, card: PeerCard, info: NixlInfo, name: str) -> dict[int, Any]:
        lists = {}
        for r in card.regions:
            if r.granule:
                rows = granule_rows(info.bases[r.id], r.size, r.device, r.granule)
                lists[r.id] = self._agent.prep_xfer_dlist(name, rows, r.mem)
        return lists

    def _abandon(self, peer: NixlPeer | None, sock: socket.socket, exc: BaseException) -> None:
        if peer is not None:
            self._retire(peer, f"handshake failed: {exc}")
        sock.close()

    def _watch(self, peer: NixlPeer) -> None:
        """Notice the peer's death: the side connection reaches EOF when its process exits."""
        Thread(
            target=self._monitor, args=(peer,), name=f"nixl-watch-{peer.card.peer_id}", daemon=True
        ).start()

    def _monitor(self, peer: NixlPeer) -> None:
        sock = peer.sock
        assert sock is not None
        sock.settimeout(None)  # blocks without waking up; close() shuts it down
        with contextlib.suppress(OSError):
            while sock.recv(4096):
                pass
        self._peer_lost(peer, "connection to the peer lost (process gone or network down)")

    def _peer_lost(self, peer: NixlPeer, reason: str) -> None:
        with self._lock:
            if peer.dead is not None:
                return
            peer.dead = reason
            if not self._others(peer):
                self._fail_pending(peer.card.peer_id, reason)

    def _others(self, peer: NixlPeer) -> list[NixlPeer]:
        """Other live links to the same incarnation (both sides dialled at once)."""
        try:
            links = self._peers.lookup(peer.card.peer_id).links
        except PeerError:
            return []
        return [p for p in links if p is not peer and p.alive]

    def _retire(self, peer: NixlPeer, reason: str) -> None:
        """Forget a peer link: fail its transfers and free its NIXL state unless shared."""
        with self._lock:
            peer.dead = peer.dead or reason
            for dl in peer.remote_lists.values():
                with contextlib.suppress(Exception):
                    dl.release()
            peer.remote_lists.clear()
            if not self._others(peer):
                self._fail_pending(peer.card.peer_id, reason)
                if self._names.pop(peer.name, None) is not None:
                    with contextlib.suppress(Exception):
                        self._agent.remove_remote_agent(peer.name)
        if peer.sock is not None:
            with contextlib.suppress(OSError):
                peer.sock.shutdown(socket.SHUT_RDWR)
            peer.sock.close()

    def remove_peer(self, peer: PeerId) -> None:
        for p in self._peers.remove(peer):
            self._retire(p, f"peer {peer} removed")

    def peers(self) -> list[PeerId]:
        return self._peers.ids()

    # -- warm-up ----------------------------------------------------------------------------
    def _warm_up(self, peer: NixlPeer, send_first: bool) -> None:
        """One tiny WRITE + notification each way, so UCX connects now, not in a request."""
        deadline = time.monotonic() + self.timeout_s
        mine, theirs = (_DIAL_HELLO, _ACCEPT_HELLO) if send_first else (_ACCEPT_HELLO, _DIAL_HELLO)
        if send_first:
            self._hello_write(peer, mine, deadline)
            self._await_hello(peer, theirs, deadline)
        else:
            self._await_hello(peer, theirs, deadline)
            self._hello_write(peer, mine, deadline)

    def _hello_write(self, peer: NixlPeer, tag: bytes, deadline: float) -> None:
        with self._lock:
            local = self._agent.get_xfer_descs(_one_row(self._scratch.ctypes.data), "DRAM")
            remote = self._agent.get_xfer_descs(_one_row(peer.info.scratch), "DRAM")
            req = self._agent.initialize_xfer("WRITE", local, remote, peer.name, tag)
            status = self._agent.transfer(req)
        while status == "PROC" and time.monotonic() < deadline:
            time.sleep(POLL_S)
            with self._lock:
                status = self._agent.check_xfer_state(req)
        with self._lock, contextlib.suppress(Exception):
            req.release()
        if status != "DONE":
            raise PeerError(f"warm-up write to {peer.card.peer_id} ended in {status}")

    def _await_hello(self, peer: NixlPeer, tag: bytes, deadline: float) -> None:
        key = (peer.name, tag)
        while time.monotonic() < deadline:
            self._pump()
            with self._lock:
                if key in self._hellos:
                    self._hellos.discard(key)
                    return
            time.sleep(POLL_S)
        raise PeerError(f"no warm-up notification from {peer.card.peer_id}")

    # -- notifications ----------------------------------------------------------------------
    def _pump(self) -> None:
        """Drive progress and sort what NIXL received into the inbox or the warm-up set."""
        with self._lock:
            got = self._agent.get_new_notifs()
            for name, msgs in got.items():
                name = name.decode() if isinstance(name, bytes) else name
                peer = self._names.get(name)
                for msg in msgs:
                    if msg[:1] == USER and peer is not None:
                        self.inbox.put(peer, bytes(msg[1:]))
                    elif msg[:1] == HELLO:
                        self._hellos.add((name, bytes(msg)))

    def get_notifs(self) -> list[Notification]:
        self._pump()
        return self.inbox.take()

    def wait_notifs(self, timeout_s: float) -> list[Notification]:
        end = time.monotonic() + timeout_s
        while True:
            got = self.get_notifs()
            if got or time.monotonic() >= end:
                return got
            time.sleep(NOTIF_POLL_S)

    def send_notif(self, peer: PeerId, payload: bytes) -> None:
        check_notif(payload)
        p = self._peers.primary(peer, lambda x: x.alive)
        if not p.alive:
            raise PeerError(f"peer {peer} is unreachable: {p.dead}")
        try:
            with self._lock:
                self._agent.send_notif(p.name, USER + payload)
        except Exception as exc:
            raise PeerError(f"notification to {peer} failed: {exc}") from None

    # -- transfers --------------------------------------------------------------------------
    def write(
        self, peer: PeerId, local: Descs, remote: Descs, notif: bytes | None = None
    ) -> TransferHandle:
        return self._post(Op.WRITE, peer, local, remote, notif)

    def read(
        self, peer: PeerId, local: Descs, remote: Descs, notif: bytes | None = None
    ) -> TransferHandle:
        return self._post(Op.READ, peer, local, remote, notif)

    def _post(
        self, op: Op, peer_id: PeerId, local: Descs, remote: Descs, notif: bytes | None
    ) -> TransferHandle:
        check_notif(notif)
        peer = self._peers.primary(peer_id, lambda x: x.alive)
        loc, rem = prepare(local, remote, self.regions.sizes(), peer.remote_sizes)
        self._check_mem(loc, rem, peer)
        x = self.transfers.new(peer_id, op, loc, rem, notif)
        if not peer.alive:
            self._finish(x, TransferState.ERROR, f"peer {peer_id}: {peer.dead}")
            return x.handle
        try:
            with self._lock:
                x.backend = self._request(
                    op, peer, loc, rem, USER + notif if notif is not None else b""
                )
                status = self._agent.transfer(x.backend)
        except Exception as exc:
            self._finish(x, TransferState.ERROR, f"peer {peer_id}: posting failed: {exc}")
            return x.handle
        self._settle(x, status)
        return x.handle

    def _check_mem(self, loc: np.ndarray, rem: np.ndarray, peer: NixlPeer) -> None:
        """A NIXL descriptor list has one memory type: refuse DRAM and VRAM in one side."""
        local_mems = {r.id: r.span.mem for r in self.regions.all()}
        remote_mems = {r.id: r.mem for r in peer.card.regions}
        for descs, mems in ((loc, local_mems), (rem, remote_mems)):
            if len(set(mems.values())) > 1 and single_mem(descs, mems) is None:
                raise DescriptorError("one transfer cannot mix DRAM and VRAM regions on one side")

    def _request(
        self, op: Op, peer: NixlPeer, loc: np.ndarray, rem: np.ndarray, notif: bytes
    ) -> Any:
        """A NIXL transfer request: from prepped lists when the descriptors allow, else ad hoc."""
        prepped = self._prepped_indices(loc, rem, peer)
        if prepped is not None:
            rl, li, rr, ri = prepped
            return self._agent.make_prepped_xfer(
                op.name, self._local_lists[rl], li, peer.remote_lists[rr], ri, notif
            )
        local_regions = {r.id: r for r in self.regions.all()}
        ldl = self._xfer_descs(
            loc, {i: r.span.ptr for i, r in local_regions.items()}, local_regions
        )
        remote_regions = {r.id: r for r in peer.card.regions}
        rdl = self._agent.get_xfer_descs(
            address_rows(rem, peer.info.bases, {i: r.device for i, r in remote_regions.items()}),
            remote_regions[int(rem[0, 0])].mem,
        )
        return self._agent.initialize_xfer(op.name, ldl, rdl, peer.name, notif)

    def _xfer_descs(
        self, descs: np.ndarray, bases: dict[int, int], regions: dict[int, Region]
    ) -> Any:
        devices = {i: r.span.device for i, r in regions.items()}
        return self._agent.get_xfer_descs(
            address_rows(descs, bases, devices), regions[int(descs[0, 0])].span.mem
        )

    def _prepped_indices(
        self, loc: np.ndarray, rem: np.ndarray, peer: NixlPeer
    ) -> tuple[int, np.ndarray, int, np.ndarray] | None:
        """Granule indices into the prepped lists, if both sides allow (one region each)."""
        rl, rr = int(loc[0, 0]), int(rem[0, 0])
        if rl not in self._local_lists or rr not in peer.remote_lists:
            return None
        g = self.regions.get(rl).granule
        remote_granule = next(r.granule for r in peer.card.regions if r.id == rr)
        if g != remote_granule or (loc[:, 0] != rl).any() or (rem[:, 0] != rr).any():
            return None
        if (loc[:, 1] % g).any() or (loc[:, 2] % g).any() or (rem[:, 1] % g).any():
            return None
        return (
            rl,
            expand_granules(loc[:, 1], loc[:, 2], g),
            rr,
            expand_granules(rem[:, 1], rem[:, 2], g),
        )

    def _settle(self, x: Xfer, status: str) -> None:
        if status == "DONE":
            self._finish(x, TransferState.DONE)
        elif status == "ERR":
            self._finish(
                x, TransferState.ERROR, f"peer {x.handle.peer}: NIXL reported a transfer error"
            )
        elif time.monotonic() - x.posted > self.timeout_s:
            self._finish(
                x,
                TransferState.ERROR,
                f"peer {x.handle.peer}: no completion within {self.timeout_s:g} s",
            )

    def _finish(self, x: Xfer, state: TransferState, error: str | None = None) -> None:
        with self._lock:
            if not self.transfers.finish(x, state, error) or x.backend is None:
                return
            try:
                x.backend.release()  # on a pending request this asks NIXL to cancel it
            except Exception:
                self._zombies.append(x.backend)
            x.backend = None

    def _fail_pending(self, peer: PeerId, reason: str) -> None:
        for x in self.transfers.pending():
            if x.handle.peer == peer:
                self._finish(x, TransferState.ERROR, f"peer {peer}: {reason}")

    def state(self, handle: TransferHandle) -> TransferState:
        x = self.transfers.get(handle)
        if x.state is TransferState.PENDING:
            with self._lock:
                if x.state is TransferState.PENDING and x.backend is not None:
                    try:
                        status = self._agent.check_xfer_state(x.backend)
                    except Exception as exc:
                        self._finish(x, TransferState.ERROR, f"peer {handle.peer}: {exc}")
                        return x.state
                    self._settle(x, status)
        return x.state

    def error(self, handle: TransferHandle) -> str | None:
        return self.transfers.get(handle).error

    def wait(self, handle: TransferHandle, timeout_s: float | None = None) -> TransferState:
        start = time.monotonic()
        while (st := self.state(handle)) is TransferState.PENDING:
            waited = time.monotonic() - start
            if timeout_s is not None and waited >= timeout_s:
                break
            time.sleep(0 if waited < SPIN_S else POLL_S)
        return st

    def release(self, handle: TransferHandle) -> None:
        self.transfers.release(handle)

    # -- shutdown ---------------------------------------------------------------------------
    def stopped(self) -> list[str]:
        if self._closed:
            return []
        parts = [] if self._listener.alive else [f"KV listener {self._listener.name}"]
        return parts + ([] if self._progress.is_alive() else ["NIXL progress thread"])

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop.set()
        self._progress.join(timeout=1)
        self._listener.close()
        for peer in self._peers.clear():
            self._retire(peer, "transport closed")
        for x in self.transfers.pending():
            self._finish(x, TransferState.ERROR, "transport closed")
        with self._lock:
            for dl in self._local_lists.values():
                with contextlib.suppress(Exception):
                    dl.release()
            self._local_lists.clear()
            for h in self._zombies:
                with contextlib.suppress(Exception):
                    h.release()
            for region in self.regions.all():
                with contextlib.suppress(Exception):
                    self._agent.deregister_memory(region.backend_handle)

    def __enter__(self) -> NixlTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
