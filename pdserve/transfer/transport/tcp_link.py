"""One authenticated TCP connection of the tcp backend: a sender and a receiver thread.

Sender: takes frames from two queues, control first (Ack, Fail), then data in posting order
(Write with its payload, ReadReq, ReadResp with its payload, Notif), and sends each with
one `sendmsg` over memoryviews of the registered memory (no copy in Python).

Receiver: reads frames. For an incoming Write or ReadReq it checks every descriptor against
the local region table BEFORE touching memory; a refused Write's payload is read into a
scratch buffer and dropped, and a Fail frame goes back. Accepted payloads are received with
`recv_into` straight into the registered memory. A Write's notification is delivered only
after its last byte landed, then the Ack goes back. The receiver is the only thread that
writes into registered memory, and the only one that fails pending transfers when the link
dies, so once a transfer is ERROR nothing of this link touches its memory any more.

Liveness: sockets time out every I/O tick; if work is pending (or a frame is half read) and
no byte moved either way for `timeout_s`, the link is declared dead.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections import deque
from typing import Protocol

from pdserve.threads import Thread
from pdserve.tracelog import hop
from pdserve.transfer.transport.base import (
    DescriptorError,
    Op,
    PeerCard,
    PeerError,
    TransferState,
)
from pdserve.transfer.transport.memory import RegionTable, size_table
from pdserve.transfer.transport.registry import Inbox, Transfers, Xfer
from pdserve.transfer.transport.wire import (
    Ack,
    Fail,
    Frame,
    Notif,
    ProtocolError,
    ReadReq,
    ReadResp,
    Stalled,
    Write,
    decode_descs,
    discard,
    encode_descs,
    recv_frame,
    recv_views,
    send_frame,
)

log = logging.getLogger(__name__)

Outgoing = tuple[Frame, list[memoryview]]


class LinkHost(Protocol):
    """What a link needs from its transport."""

    regions: RegionTable
    transfers: Transfers
    inbox: Inbox
    timeout_s: float


class TcpLink:
    """The connection to one peer incarnation. Created after a successful handshake."""

    def __init__(self, sock: socket.socket, card: PeerCard, host: LinkHost) -> None:
        self.sock = sock
        self.card = card
        self.peer = card.peer_id
        self.remote_sizes = size_table({r.id: r.size for r in card.regions})
        self._host = host
        self._cv = threading.Condition()
        self._ctl: deque[Outgoing] = deque()
        self._data: deque[Outgoing | Xfer] = deque()
        self._pending: dict[int, Xfer] = {}
        self._last_progress = time.monotonic()
        self._reason: str | None = None  # set once the link is going down
        self._sender = Thread(target=self._send_loop, name=f"tcp-send-{self.peer}", daemon=True)
        self._receiver = Thread(target=self._recv_loop, name=f"tcp-recv-{self.peer}", daemon=True)

    def start(self) -> None:
        self._sender.start()
        self._receiver.start()

    @property
    def alive(self) -> bool:
        return self._reason is None

    # -- posting (user threads) -------------------------------------------------------------
    def post(self, x: Xfer) -> None:
        """Queue a WRITE or READ; a dead link fails it at once."""
        with self._cv:
            reason = self._reason
            if reason is None:
                if not self._pending:
                    self._last_progress = time.monotonic()  # idle time before is not a stall
                self._pending[x.handle.id] = x
                self._data.append(x)
                self._cv.notify()
        if reason is not None:
            self._host.transfers.finish(x, TransferState.ERROR, f"peer {self.peer}: {reason}")

    def send_notif(self, payload: bytes) -> None:
        self._enqueue(self._data, (Notif(payload), []))

    def _enqueue(self, queue: deque, item: Outgoing) -> None:
        with self._cv:
            if self._reason is not None:
                raise PeerError(f"peer {self.peer} is unreachable: {self._reason}")
            queue.append(item)
            self._cv.notify()

    def kill(self, reason: str) -> None:
        """Start tearing the link down; the receiver fails pending transfers."""
        with self._cv:
            if self._reason is not None:
                return
            self._reason = reason
            self._cv.notify_all()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def close(self, reason: str) -> None:
        self.kill(reason)
        for t in (self._sender, self._receiver):
            if t.is_alive() and t is not threading.current_thread():
                t.join(timeout=self._host.timeout_s + 1)

    # -- liveness (called by wire I/O on both threads) ----------------------------------------
    def progress(self) -> None:
        self._last_progress = time.monotonic()

    def idle(self, mid_frame: bool) -> None:
        if self._reason is not None:
            raise ConnectionError(self._reason)
        waiting = mid_frame or bool(self._pending)
        quiet = time.monotonic() - self._last_progress
        if waiting and quiet > self._host.timeout_s:
            raise Stalled(f"no progress for {quiet:.1f} s (timeout {self._host.timeout_s:g} s)")

    # -- sender thread ----------------------------------------------------------------------
    def _next(self) -> Outgoing | Xfer | None:
        with self._cv:
            self._cv.wait_for(lambda: self._ctl or self._data or self._reason is not None)
            if self._reason is not None:
                return None
            return self._ctl.popleft() if self._ctl else self._data.popleft()

    def _outgoing(self, item: Outgoing | Xfer) -> Outgoing:
        if not isinstance(item, Xfer):
            return item
        h, remote = item.handle, encode_descs(item.remote)
        if h.op is Op.READ:
            return ReadReq(h.id, remote, h.nbytes), []
        return Write(h.id, remote, h.nbytes, item.notif), self._host.regions.views(item.local)

    def _send_loop(self) -> None:
        try:
            while (item := self._next()) is not None:
                frame, payload = self._outgoing(item)
                send_frame(self.sock, frame, self, payload)
                if isinstance(frame, Notif | Write):
                    hop(type(frame).__name__, "tcp.sent")
        except Exception as exc:
            self.kill(f"send failed: {exc}")

    # -- receiver thread --------------------------------------------------------------------
    def _recv_loop(self) -> None:
        reason = "connection closed"
        try:
            while True:
                self._dispatch(recv_frame(self.sock, self))
        except Exception as exc:
            reason = self._reason or str(exc) or type(exc).__name__
        finally:
            self._teardown(reason)

    def _teardown(self, reason: str) -> None:
        self.kill(reason)
        # The sender may still be reading a WRITE's source bytes: let it stop first, so that
        # ERROR, once visible, means no thread of this link touches that memory any more.
        self._sender.join(timeout=self._host.timeout_s + 1)
        with self._cv:
            pending = list(self._pending.values())
            self._pending.clear()
        for x in pending:
            self._host.transfers.finish(x, TransferState.ERROR, f"peer {self.peer}: {reason}")
        self.sock.close()

    def _dispatch(self, frame: Frame) -> None:
        if isinstance(frame, Write):
            self._on_write(frame)
        elif isinstance(frame, ReadReq):
            self._on_read_req(frame)
        elif isinstance(frame, ReadResp):
            self._on_read_resp(frame)
        elif isinstance(frame, Ack):
            hop(str(frame.xfer), "tcp.ack_recv")
            self._complete(frame.xfer, TransferState.DONE, None)
        elif isinstance(frame, Fail):
            self._complete(frame.xfer, TransferState.ERROR, f"peer {self.peer}: {frame.reason}")
        elif isinstance(frame, Notif):
            hop("Notif", "tcp.recv")
            if self.alive:
                self._host.inbox.put(self.peer, frame.payload)
        else:
            raise ProtocolError(f"unexpected {type(frame).__name__} frame")

    def _checked(self, raw: bytes, nbytes: int) -> list[memoryview]:
        """Views of the local memory named by a peer's descriptors, or DescriptorError."""
        descs = decode_descs(raw)
        if int(descs[:, 2].sum()) != nbytes:
            raise ProtocolError("descriptor lengths do not add up to the payload size")
        self._host.regions.check(descs, "remote")
        return self._host.regions.views(descs)

    def _on_write(self, f: Write) -> None:
        try:
            views = self._checked(f.descs, f.nbytes)
        except DescriptorError as exc:
            discard(self.sock, f.nbytes, self)
            self._enqueue(self._ctl, (Fail(f.xfer, f"write refused: {exc}"), []))
            return
        recv_views(self.sock, views, self)
        hop("Write", "tcp.recv")
        if f.notif is not None and self.alive:
            self._host.inbox.put(self.peer, f.notif)
        self._enqueue(self._ctl, (Ack(f.xfer), []))

    def _on_read_req(self, f: ReadReq) -> None:
        try:
            views = self._checked(f.descs, f.nbytes)
        except DescriptorError as exc:
            self._enqueue(self._ctl, (Fail(f.xfer, f"read refused: {exc}"), []))
            return
        self._enqueue(self._data, (ReadResp(f.xfer, f.nbytes), views))

    def _on_read_resp(self, f: ReadResp) -> None:
        with self._cv:
            x = self._pending.get(f.xfer)
        if x is None or x.handle.op is not Op.READ or x.handle.nbytes != f.nbytes:
            raise ProtocolError(f"unexpected read data for transfer {f.xfer}")
        recv_views(self.sock, self._host.regions.views(x.local), self)
        if x.notif is not None:
            self._enqueue(self._data, (Notif(x.notif), []))
        self._complete(f.xfer, TransferState.DONE, None)

    def _complete(self, xfer_id: int, state: TransferState, error: str | None) -> None:
        with self._cv:
            x = self._pending.pop(xfer_id, None)
        if x is None:
            raise ProtocolError(f"completion for unknown transfer {xfer_id}")
        self._host.transfers.finish(x, state, error)
