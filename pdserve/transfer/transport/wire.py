"""Frames on a transport connection, and blocking socket I/O that never waits forever.

Every frame is  u32 big-endian header length | msgpack header | payload (header.nbytes).
Only Write and ReadResp carry a payload: the raw bytes of the descriptors, in order.
Descriptor lists travel as little-endian int64 triples (region, offset, length).

Sockets run with a short timeout (the I/O tick). Each time an operation times out, the
`Liveness` hook decides whether to keep waiting or to give up: that is how a stalled peer
is detected within a bounded time without a watchdog thread.
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Sequence
from typing import Protocol

import msgspec
import numpy as np

from pdserve.transfer.transport.base import PeerCard

_PREFIX = struct.Struct("!I")
MAX_HEADER_BYTES = 16 << 20  # a header bigger than this is garbage or hostile
# Before the peer has proven the token, its frames are small (identity, nonces, proofs, its
# card and a backend's metadata): anything larger is refused before it is read.
MAX_HANDSHAKE_HEADER_BYTES = 1 << 20
_HEADER_CHUNK = 64 << 10  # a header is read in chunks: memory grows only as bytes arrive
MAX_DESCS = (MAX_HEADER_BYTES - 4096) // 24  # descriptors one frame can carry
IOV_MAX = 1024  # Linux's limit on buffers per sendmsg
_DISCARD_CHUNK = 1 << 20


# -- handshake frames ------------------------------------------------------------------------
class Hello(msgspec.Struct, tag="hello"):
    version: int
    backend: str
    engine_id: str
    incarnation: str
    nonce: bytes


class Challenge(msgspec.Struct, tag="challenge"):
    engine_id: str
    incarnation: str
    nonce: bytes
    proof: bytes


class Auth(msgspec.Struct, tag="auth"):
    proof: bytes
    card: PeerCard
    extra: bytes  # backend-specific, e.g. NIXL agent metadata


class Welcome(msgspec.Struct, tag="welcome"):
    card: PeerCard
    extra: bytes


class Ready(msgspec.Struct, tag="ready"):
    """Backend set-up after the handshake (NIXL warm-up) finished on the server side."""


class Refuse(msgspec.Struct, tag="refuse"):
    code: str  # "auth" | "stale" | "peer"
    reason: str


# -- data-path frames ------------------------------------------------------------------------
class Write(msgspec.Struct, tag="write"):
    xfer: int
    descs: bytes  # remote (target-side) descriptors
    nbytes: int
    notif: bytes | None = None


class ReadReq(msgspec.Struct, tag="read"):
    xfer: int
    descs: bytes  # descriptors in the owner's regions
    nbytes: int


class ReadResp(msgspec.Struct, tag="data"):
    xfer: int
    nbytes: int


class Ack(msgspec.Struct, tag="ack"):
    xfer: int


class Fail(msgspec.Struct, tag="fail"):
    xfer: int
    reason: str


class Notif(msgspec.Struct, tag="notif"):
    payload: bytes


Frame = (
    Hello
    | Challenge
    | Auth
    | Welcome
    | Ready
    | Refuse
    | Write
    | ReadReq
    | ReadResp
    | Ack
    | Fail
    | Notif
)

_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Frame)


class ProtocolError(ConnectionError):
    """The peer sent something that is not a valid frame; the connection is unusable."""


class Stalled(ConnectionError):
    """No progress for longer than allowed."""


def encode_descs(descs: np.ndarray) -> bytes:
    return np.ascontiguousarray(descs, dtype="<i8").tobytes()


def decode_descs(raw: bytes) -> np.ndarray:
    if len(raw) % 24 or not raw:
        raise ProtocolError(f"descriptor block of {len(raw)} bytes")
    return np.frombuffer(raw, dtype="<i8").reshape(-1, 3).astype(np.int64)


def encode_frame(frame: Frame) -> bytes:
    header = _ENCODER.encode(frame)
    return _PREFIX.pack(len(header)) + header


class Liveness(Protocol):
    """Told about progress; asked what to do when a socket operation times out."""

    def progress(self) -> None: ...

    def idle(self, mid_frame: bool) -> None:
        """Return to keep waiting, raise (e.g. Stalled) to give up."""


class Deadline:
    """Liveness for handshakes: a fixed deadline, progress does not extend it."""

    def __init__(self, timeout_s: float, what: str) -> None:
        self._end = time.monotonic() + timeout_s
        self._what = what

    def progress(self) -> None:
        pass

    def idle(self, mid_frame: bool) -> None:
        if time.monotonic() > self._end:
            raise Stalled(f"{self._what} timed out")


def send_frame(
    sock: socket.socket, frame: Frame, live: Liveness, payload: Sequence[memoryview] = ()
) -> None:
    """Send one frame and its payload, zero-copy from the payload views."""
    sendmsg_all(sock, [memoryview(encode_frame(frame)), *payload], live)


def _advance(bufs: list[memoryview], i: int, n: int) -> int:
    """Consume `n` bytes from bufs[i:], trimming a partly used buffer; returns the new i."""
    while n:
        size = bufs[i].nbytes
        if n >= size:
            n -= size
            i += 1
        else:
            bufs[i] = bufs[i][n:]
            n = 0
    return i


def sendmsg_all(sock: socket.socket, bufs: list[memoryview], live: Liveness) -> None:
    """sendmsg until every buffer is out, resuming after partial sends and timeouts."""
    i = 0
    while i < len(bufs):
        try:
            sent = sock.sendmsg(bufs[i : i + IOV_MAX])
        except TimeoutError:
            live.idle(True)
            continue
        live.progress()
        i = _advance(bufs, i, sent)


def recv_into(sock: socket.socket, view: memoryview, live: Liveness, mid_frame: bool) -> None:
    """Fill `view` completely; EOF raises ConnectionError."""
    pos, end = 0, view.nbytes
    while pos < end:
        try:
            n = sock.recv_into(view[pos:], end - pos)
        except TimeoutError:
            live.idle(mid_frame or pos > 0)
            continue
        if n == 0:
            raise ConnectionError("connection closed by peer")
        pos += n
        live.progress()


def recv_views(sock: socket.socket, views: Sequence[memoryview], live: Liveness) -> None:
    """Scatter-receive into `views` in order (one recvmsg_into fills up to IOV_MAX of them)."""
    bufs, i = list(views), 0
    while i < len(bufs):
        try:
            n = sock.recvmsg_into(bufs[i : i + IOV_MAX])[0]
        except TimeoutError:
            live.idle(True)
            continue
        if n == 0:
            raise ConnectionError("connection closed by peer")
        live.progress()
        i = _advance(bufs, i, n)


def discard(sock: socket.socket, nbytes: int, live: Liveness) -> None:
    """Read and drop `nbytes` (a refused payload) so the stream stays in step."""
    scratch = memoryview(bytearray(min(nbytes, _DISCARD_CHUNK) or 1))
    while nbytes > 0:
        n = min(nbytes, scratch.nbytes)
        recv_into(sock, scratch[:n], live, True)
        nbytes -= n


def recv_frame(sock: socket.socket, live: Liveness, max_bytes: int = MAX_HEADER_BYTES) -> Frame:
    """Read one frame header (its payload, if any, is left on the socket). A header
    announced larger than `max_bytes` is refused before any of it is read, and one that is
    allowed is read in chunks, so a peer that announces much and sends little costs little."""
    prefix = bytearray(_PREFIX.size)
    recv_into(sock, memoryview(prefix), live, False)
    (size,) = _PREFIX.unpack(prefix)
    if size > max_bytes:
        raise ProtocolError(f"frame header of {size} bytes (limit {max_bytes})")
    header = bytearray(min(size, _HEADER_CHUNK))
    recv_into(sock, memoryview(header), live, True)
    while len(header) < size:
        chunk = bytearray(min(_HEADER_CHUNK, size - len(header)))
        recv_into(sock, memoryview(chunk), live, True)
        header += chunk
    try:
        return _DECODER.decode(header)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"bad frame: {exc}") from None
