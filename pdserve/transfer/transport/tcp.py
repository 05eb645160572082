"""The built-in tcp backend: no dependency beyond the standard library and numpy.

One authenticated stream connection per peer, reused by every transfer (see `tcp_link` for
the threads and `wire` for the frames). Connection set-up and authentication happen in
`add_peer`, not in the first transfer. The TCP listener binds `config.host` (127.0.0.1 by
default). When both ends share a kernel and network namespace, the connection is a
Unix-domain socket instead (abstract namespace, same frames, same handshake): several times
the bandwidth of TCP loopback. `TcpOptions(same_host_unix=False)` forces TCP.
Host memory only: a CUDA tensor cannot be registered (use nixl, or stage it).
"""

from __future__ import annotations

import secrets
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import msgspec

from pdserve.config import TransportConfig
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
    abstract_path,
    advertised_host,
    answer,
    dial,
    host_identity,
    tcp_server,
    unix_server,
)
from pdserve.transfer.transport.memory import RegionTable, span_of
from pdserve.transfer.transport.peers import PeerTable
from pdserve.transfer.transport.registry import Inbox, Transfers, check_notif, prepare
from pdserve.transfer.transport.tcp_link import TcpLink
from pdserve.transfer.transport.wire import MAX_DESCS


@dataclass(frozen=True)
class TcpOptions:
    """tcp-backend settings beyond `TransportConfig`."""

    same_host_unix: bool = True  # use a Unix-domain socket when the peer shares our host


class TcpTransport:
    """Transport over stream sockets: TCP, or Unix on one host (see `base.Transport`)."""

    def __init__(
        self, config: TransportConfig, engine_id: str, options: TcpOptions = TcpOptions()
    ) -> None:
        if not engine_id:
            raise ValueError("engine_id must not be empty")
        self.timeout_s = config.timeout_s
        self.regions = RegionTable()
        self.transfers = Transfers()
        self.inbox = Inbox()
        self._token = config.cluster_token
        self._id = PeerId(engine_id, secrets.token_hex(8))
        self._started_ns = time.time_ns()
        self._peers: PeerTable[TcpLink] = PeerTable(self._id)
        self._attach_lock = threading.Lock()
        self._closed = False
        self._host = advertised_host(config.host, config.advertise_host)
        name = f"tcp-{engine_id}"
        self._listeners = [Listener(tcp_server(config.host, config.port), self._on_accept, name)]
        self._unix_path = self._host_id = None
        path = abstract_path(f"pdserve-{name}-{self._id.incarnation}")
        unix = unix_server(path) if options.same_host_unix else None
        if unix is not None:
            self._unix_path, self._host_id = path, host_identity()
            self._listeners.append(Listener(unix, self._on_accept, f"{name}-unix"))

    @property
    def peer_id(self) -> PeerId:
        return self._id

    # -- regions and metadata ---------------------------------------------------------------
    def register(self, name: str, memory: Any, *, granule: int | None = None) -> int:
        span = span_of(memory)
        if span.mem != "DRAM":
            raise BackendUnavailableError(
                f"the tcp transport moves host memory only; region {name!r} is in {span.mem} "
                "(use --transport nixl)"
            )
        return self.regions.add(name, span, granule).id

    def _card(self) -> PeerCard:
        return PeerCard(
            kind="tcp",
            engine_id=self._id.engine_id,
            incarnation=self._id.incarnation,
            started_ns=self._started_ns,
            host=self._host,
            port=self._listeners[0].port,
            regions=self.regions.infos(),
            host_id=self._host_id,
            unix_path=self._unix_path,
        )

    def local_metadata(self) -> bytes:
        return msgspec.msgpack.encode(self._card())

    # -- peers ------------------------------------------------------------------------------
    def add_peer(self, metadata: bytes) -> PeerId:
        card = decode_card(metadata, "tcp")
        slot = self._peers.check(card)
        if slot is not None and any(link.alive for link in slot.links):
            return card.peer_id
        sock, welcome = dial(card, Me(self._card(), self._token), self.timeout_s)
        self._attach(sock, welcome.card)
        return card.peer_id

    def _on_accept(self, sock: socket.socket) -> None:
        msg = answer(sock, Me(self._card(), self._token), self._admissible, self.timeout_s)
        self._attach(sock, msg.card)

    def _admissible(self, card: PeerCard, extra: bytes) -> bytes:
        self._peers.check(card)
        return b""

    def _attach(self, sock: socket.socket, card: PeerCard) -> None:
        link = TcpLink(sock, card, self)
        with self._attach_lock:
            if self._closed:
                sock.close()
                raise PeerError("transport is closed")
            try:
                replaced = self._peers.admit(card, link, alive=lambda x: x.alive)
            except PeerError:
                sock.close()
                raise
            link.start()
        for old in replaced:
            old.close(f"peer restarted as incarnation {card.incarnation[:8]}")

    def remove_peer(self, peer: PeerId) -> None:
        for link in self._peers.remove(peer):
            link.close(f"peer {peer} removed")

    def peers(self) -> list[PeerId]:
        return self._peers.ids()

    def path_to(self, peer: PeerId) -> str:
        """How we reach `peer`: "unix" (same host) or "tcp"."""
        link = self._peers.primary(peer, lambda x: x.alive)
        return "unix" if link.sock.family == socket.AF_UNIX else "tcp"

    # -- transfers --------------------------------------------------------------------------
    def _post(
        self, op: Op, peer: PeerId, local: Descs, remote: Descs, notif: bytes | None
    ) -> TransferHandle:
        check_notif(notif)
        link = self._peers.primary(peer, lambda link: link.alive)
        loc, rem = prepare(local, remote, self.regions.sizes(), link.remote_sizes)
        if len(loc) > MAX_DESCS:
            raise DescriptorError(f"{len(loc)} descriptors after merging (limit {MAX_DESCS})")
        x = self.transfers.new(peer, op, loc, rem, notif)
        link.post(x)
        return x.handle

    def write(
        self, peer: PeerId, local: Descs, remote: Descs, notif: bytes | None = None
    ) -> TransferHandle:
        return self._post(Op.WRITE, peer, local, remote, notif)

    def read(
        self, peer: PeerId, local: Descs, remote: Descs, notif: bytes | None = None
    ) -> TransferHandle:
        return self._post(Op.READ, peer, local, remote, notif)

    def state(self, handle: TransferHandle) -> TransferState:
        return self.transfers.get(handle).state

    def error(self, handle: TransferHandle) -> str | None:
        return self.transfers.get(handle).error

    def wait(self, handle: TransferHandle, timeout_s: float | None = None) -> TransferState:
        return self.transfers.wait(handle, timeout_s)

    def release(self, handle: TransferHandle) -> None:
        self.transfers.release(handle)

    # -- notifications ----------------------------------------------------------------------
    def send_notif(self, peer: PeerId, payload: bytes) -> None:
        check_notif(payload)
        self._peers.primary(peer, lambda link: link.alive).send_notif(payload)

    def get_notifs(self) -> list[Notification]:
        return self.inbox.take()

    def wait_notifs(self, timeout_s: float) -> list[Notification]:
        return self.inbox.take(timeout_s)

    # -- shutdown ---------------------------------------------------------------------------
    def stopped(self) -> list[str]:
        if self._closed:
            return []
        return [f"KV listener {x.name}" for x in self._listeners if not x.alive]

    def close(self) -> None:
        if self._closed:
            return
        with self._attach_lock:
            self._closed = True
        for listener in self._listeners:
            listener.close()
        for link in self._peers.clear():
            link.close("transport closed")

    def __enter__(self) -> TcpTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
