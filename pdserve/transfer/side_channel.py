"""The side channel: small authenticated control messages between instances, over ZMQ.

Each instance binds one PULL socket (127.0.0.1 unless told otherwise) and sends with
one PUSH socket per peer address. Messages are one-way; a request/reply pair (the
handshake) is correlated by nonce. Threads: one receiver thread owns the PULL socket
and calls `handler(msg)` for every valid message (the handler must not block: it
hands work to a queue); senders may call `send` from any thread (each PUSH socket is
used under its own lock).

Authentication: with a cluster token, every frame carries HMAC-SHA256(token, body)
and a send time; frames with a bad MAC or older than `max_age_s` are dropped and
counted. The token itself never crosses the wire.
"""

from __future__ import annotations

import hmac
import logging
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

import msgspec
import zmq

from pdserve.transfer import messages as m

log = logging.getLogger(__name__)
Address = tuple[str, int]


class _Envelope(msgspec.Struct, array_like=True):
    sent_at: float
    body: bytes


class SideChannel:
    """Bind, receive on a thread, send to peers, and correlate handshake replies."""

    def __init__(
        self,
        handler: Callable[[m.Message], None],
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        max_age_s: float = 120.0,
    ) -> None:
        self._ctx = zmq.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        if port:
            self._pull.bind(f"tcp://{host}:{port}")
        else:
            port = self._pull.bind_to_random_port(f"tcp://{host}")
        self.address: Address = (host, port)
        self._handler = handler
        self._key = token.encode() if token else None
        self._max_age = max_age_s
        self._peers: dict[Address, tuple[zmq.Socket, threading.Lock]] = {}
        self._peers_lock = threading.Lock()
        self._waiters: dict[str, Future[m.Message]] = {}
        self._stop = threading.Event()
        self.num_rejected = 0
        self._thread = threading.Thread(target=self._recv_loop, name="pdserve-side", daemon=True)
        self._thread.start()

    # -- sending ---------------------------------------------------------------------------
    def send(self, to: Address, msg: m.Message) -> None:
        """Queue `msg` for `to` (never blocks on the network; ZMQ buffers it).

        After `close()` messages are dropped: the instance is shutting down.
        """
        if self._stop.is_set():
            return
        sock, lock = self._peer(to)
        frame = msgspec.msgpack.encode(_Envelope(time.time(), m.encode(msg)))
        mac = hmac.digest(self._key, frame, "sha256") if self._key else b""
        with lock:
            try:
                sock.send_multipart([mac, frame], flags=zmq.NOBLOCK)
            except zmq.ZMQError as exc:  # full queue to a dead peer, or closing
                log.warning("side channel: dropped a %s to %s: %s", type(msg).__name__, to, exc)

    def request(self, to: Address, msg: m.Hello, timeout: float) -> m.Message:
        """Send a message with a nonce and wait for the reply carrying the same nonce."""
        fut: Future[m.Message] = Future()
        self._waiters[msg.nonce] = fut
        try:
            self.send(to, msg)
            return fut.result(timeout)
        finally:
            self._waiters.pop(msg.nonce, None)

    def _peer(self, to: Address) -> tuple[zmq.Socket, threading.Lock]:
        with self._peers_lock:
            entry = self._peers.get(to)
            if entry is None:
                sock = self._ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDHWM, 10000)
                sock.connect(f"tcp://{to[0]}:{to[1]}")
                entry = self._peers[to] = (sock, threading.Lock())
            return entry

    # -- receiving -------------------------------------------------------------------------
    def _recv_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            try:
                parts = self._pull.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                continue
            msg = self._open(parts)
            if msg is not None:
                self._dispatch(msg)

    def _open(self, parts: list[bytes]) -> m.Message | None:
        """Verify and decode a frame; None (and a count) for anything invalid."""
        try:
            mac, frame = parts
            if self._key and not hmac.compare_digest(mac, hmac.digest(self._key, frame, "sha256")):
                raise ValueError("bad MAC (wrong or missing cluster token)")
            env = msgspec.msgpack.decode(frame, type=_Envelope)
            if self._key and abs(time.time() - env.sent_at) > self._max_age:
                raise ValueError("stale frame")
            return m.decode(env.body)
        except (ValueError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            self.num_rejected += 1
            log.warning("side channel: dropped a message: %s", exc)
            return None

    def _dispatch(self, msg: m.Message) -> None:
        waiter = (
            self._waiters.get(getattr(msg, "nonce", "")) if isinstance(msg, m.HelloReply) else None
        )
        if waiter is not None:
            waiter.set_result(msg)
            return
        try:
            self._handler(msg)
        except Exception:  # a handler bug must not kill the channel
            log.exception("side channel handler failed on %s", type(msg).__name__)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2.0)
        with self._peers_lock:
            for sock, _ in self._peers.values():
                sock.close(0)
            self._peers.clear()
        self._pull.close(0)
        self._ctx.term()


def new_nonce() -> str:
    return secrets.token_hex(8)
