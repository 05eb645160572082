"""The side channel: small authenticated control messages between instances, over ZMQ.

Each instance binds one PULL socket (127.0.0.1 unless told otherwise; `address`, what
peers are told to send to, is `advertise_host` when given) and sends with
one PUSH socket per peer address. Messages are one-way; a request/reply pair (the
handshake) is correlated by nonce. Threads: one receiver thread owns the PULL socket
and calls `handler(msg)` for every valid message (the handler must not block: it
hands work to a queue); senders may call `send` from any thread (each PUSH socket is
used under its own lock).

Dialing: a PUSH socket reconnects to its address by itself, forever, backing off up to
`RECONNECT_MAX_MS`; addresses come from peers' messages (reply_to) and from params, so a
stranger can name closed ports. A socket is therefore closed when its owner gives up on
the address (`forget`), when nothing was sent on it for `idle_s` (the receiver thread
sweeps), and the least recently used one when more than `max_sockets` are open; a later
`send` opens a fresh one. Closing drops what it still queues: after `idle_s` without a
send, that is only what a peer that never connected was owed.

Authentication: with a cluster token, every frame carries HMAC-SHA256(token, frame)
over a send time, a random nonce and the body; frames with a bad MAC, older than
`max_age_s`, or whose nonce was already seen (a captured frame sent again) are dropped
and counted. The token itself never crosses the wire. Without a token nothing is
authenticated: anyone who can reach the port can send any message.
"""

from __future__ import annotations

import contextlib
import heapq
import hmac
import logging
import math
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field

import msgspec
import zmq

from pdserve.logsafe import Throttled, shown
from pdserve.threads import Thread
from pdserve.transfer import messages as m

log = logging.getLogger(__name__)
Address = tuple[str, int]
# The largest frame the inbox takes (ZMQ drops a peer that sends more, before allocating it):
# control messages are small; the largest, a Hello with a backend's metadata, is kilobytes.
MAX_MESSAGE_BYTES = 4 << 20
RECONNECT_MAX_MS = 2000  # a PUSH socket's reconnect back-off (from ZMQ's 100 ms) ends here
# A PUSH socket nothing was sent on for this long is closed: the backstop for addresses
# nobody `forget`s (e.g. a stranger's reply_to); a live peer only pays one reconnect.
IDLE_S = 30.0
MAX_SOCKETS = 512  # PUSH sockets open at once at most (the least recently used is closed)
_SWEEP_S = 1.0  # how often the receiver thread looks for idle sockets
_WANTED_CHECK_S = 0.1  # how often a waiting `request` asks whether it is still wanted


class _Envelope(msgspec.Struct, array_like=True):
    sent_at: float
    nonce: bytes  # unique per frame: what the receiver's replay guard remembers
    body: bytes


class ReplayGuard:
    """Refuses a frame seen before, or too old to tell (receiver thread only).

    A nonce is remembered until its frame is older than `max_age_s` (then the age check
    refuses it anyway). Bounded: past `capacity` nonces the oldest are forgotten and every
    frame sent at or before the newest forgotten one is refused as stale, so a forgotten
    frame can never be replayed either; the cost is that, under a flood, frames delayed
    longer than the remembered span are dropped too.
    """

    def __init__(self, max_age_s: float, capacity: int = 200_000) -> None:
        self.max_age_s = max_age_s
        self.capacity = capacity
        self._seen: set[bytes] = set()
        self._by_time: list[tuple[float, bytes]] = []  # heap: oldest sent_at first
        self._floor = -math.inf  # frames sent at or before this are refused

    def check(self, sent_at: float, nonce: bytes, now: float) -> str | None:
        """Why the frame must be dropped, or None (then its nonce is remembered)."""
        if abs(now - sent_at) > self.max_age_s:
            return "stale frame"
        while self._by_time and self._by_time[0][0] < now - self.max_age_s:
            self._seen.discard(heapq.heappop(self._by_time)[1])
        if sent_at <= self._floor:
            return "stale frame (older than the replay window)"
        if not nonce or nonce in self._seen:
            return "replayed frame (nonce already seen)"
        self._seen.add(nonce)
        heapq.heappush(self._by_time, (sent_at, nonce))
        while len(self._seen) > self.capacity:
            t, old = heapq.heappop(self._by_time)
            self._seen.discard(old)
            self._floor = max(self._floor, t)
        return None


class SideChannel:
    """Bind, receive on a thread, send to peers, and correlate handshake replies."""

    def __init__(
        self,
        handler: Callable[[m.Message], None],
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        max_age_s: float = 120.0,
        advertise_host: str | None = None,
        idle_s: float = IDLE_S,
        max_sockets: int = MAX_SOCKETS,
    ) -> None:
        self._ctx = zmq.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        try:
            port = self._bind(host, port)
        except zmq.ZMQError as exc:
            self._pull.close()
            self._ctx.term()
            # An OSError with the errno, so that `pdserve serve` can tell "port taken" apart
            raise OSError(exc.errno, f"side channel: cannot bind {host}:{port}: {exc}") from exc
        # What peers are told (in /kv/info, pull params, reply_to): a wildcard bind address
        # would send them to their own host. `pdserve serve` refuses that combination.
        self.address: Address = (advertise_host or host, port)
        self._handler = handler
        self._key = token.encode() if token else None
        self._replays = ReplayGuard(max_age_s)
        # Address -> PUSH socket, its lock, and when it last sent (monotonic); insertion
        # order is recency order (a send moves its entry to the end), so the first is the LRU.
        self._peers: dict[Address, _Out] = {}
        self._peers_lock = threading.Lock()
        self._idle_s = idle_s
        self._max_sockets = max_sockets
        self.num_closed = 0  # PUSH sockets closed (forgotten, idle or evicted), for tests
        self._waiters: dict[str, Future[m.Reply]] = {}
        self._stop = threading.Event()
        # Wakes the receiver, which blocks without a timeout while no PUSH socket is open
        # (nothing to sweep): `close`, and a send that opens one. Used under `_wake_lock`.
        wake_at = f"inproc://pdserve-side-wake-{id(self):x}"
        self._wake_rx = self._ctx.socket(zmq.PULL)
        self._wake_rx.bind(wake_at)
        self._wake_tx = self._ctx.socket(zmq.PUSH)
        self._wake_tx.setsockopt(zmq.LINGER, 0)
        self._wake_tx.connect(wake_at)
        self._wake_lock = threading.Lock()
        self.num_rejected = 0
        self._drops = Throttled(log)  # 20,000 bad frames must not write 20,000 lines
        self._send_drops = Throttled(log)
        self._thread = Thread(target=self._recv_loop, name="pdserve-side", daemon=True)
        self._thread.start()

    def _bind(self, host: str, port: int) -> int:
        """Bind the inbox to host:port (0: a free port); the port bound."""
        if not port:
            return self._pull.bind_to_random_port(f"tcp://{host}")
        self._pull.bind(f"tcp://{host}:{port}")
        return port

    # -- sending ---------------------------------------------------------------------------
    def send(self, to: Address, msg: m.Message) -> None:
        """Queue `msg` for `to` (never blocks on the network; ZMQ buffers it).

        After `close()` messages are dropped: the instance is shutting down.
        """
        if self._stop.is_set():
            return
        env = _Envelope(time.time(), secrets.token_bytes(16), m.encode(msg))
        frame = msgspec.msgpack.encode(env)
        mac = hmac.digest(self._key, frame, "sha256") if self._key else b""
        out = self._peer(to)  # raises ZMQError for an address ZMQ cannot connect to
        with out.lock:
            if out.closed:  # forgotten meanwhile: its owner gave up on this address
                return
            try:
                out.sock.send_multipart([mac, frame], flags=zmq.NOBLOCK)
            except zmq.ZMQError as exc:  # full queue to a dead peer, or closing
                self._send_drops.warning(
                    "side channel: dropped a %s to %s: %s", type(msg).__name__, shown(to), exc
                )

    def request(
        self,
        to: Address,
        msg: m.Request,
        timeout: float,
        wanted: Callable[[], bool] | None = None,
    ) -> m.Reply:
        """Send a message with a nonce and wait for the reply carrying the same nonce;
        TimeoutError after `timeout` seconds, or as soon as `wanted()` turns False (checked
        every `_WANTED_CHECK_S`: nobody needs the answer any more)."""
        fut: Future[m.Reply] = Future()
        self._waiters[msg.nonce] = fut
        deadline = time.monotonic() + timeout
        try:
            self.send(to, msg)
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or (wanted is not None and not wanted()):
                    raise TimeoutError
                try:
                    return fut.result(min(left, _WANTED_CHECK_S) if wanted else left)
                except TimeoutError:  # concurrent.futures' is the builtin since 3.11
                    continue
        finally:
            self._waiters.pop(msg.nonce, None)

    def _peer(self, to: Address) -> _Out:
        """The PUSH socket to `to`, opened if needed (ZMQError for an address ZMQ refuses)."""
        evicted = None
        with self._peers_lock:
            out = self._peers.pop(to, None)
            if out is None:
                if len(self._peers) >= self._max_sockets:
                    evicted = self._peers.pop(next(iter(self._peers)))
                out = _Out(self._connect(to))
                opened = True
            else:
                opened = False
            out.last_used = time.monotonic()
            self._peers[to] = out  # to the end: most recently used
        if evicted is not None:
            self._close(evicted)
        if opened:  # the receiver must sweep it once idle; it may be sleeping for good
            self._wake()
        return out

    def _wake(self) -> None:
        """Wake the receiver thread (any thread)."""
        with self._wake_lock, contextlib.suppress(zmq.ZMQError):  # one pending wake is enough
            self._wake_tx.send(b"", flags=zmq.NOBLOCK)

    def _connect(self, to: Address) -> zmq.Socket:
        sock = self._ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 10000)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_MAX_MS)
        try:
            sock.connect(f"tcp://{to[0]}:{to[1]}")
        except zmq.ZMQError:
            sock.close(0)
            raise
        return sock

    def forget(self, to: Address) -> None:
        """Close the socket to `to` (the caller gave up on it): no more connects to it until
        something is sent there again. What it still queued is dropped. Any thread."""
        with self._peers_lock:
            out = self._peers.pop(to, None)
        if out is not None:
            self._close(out)

    def num_sockets(self) -> int:
        """PUSH sockets open now (any thread)."""
        return len(self._peers)

    def _close(self, out: _Out) -> None:
        with out.lock:  # never while a sender uses it
            out.closed = True
            out.sock.close(0)
        self.num_closed += 1

    def _sweep_idle(self, now: float) -> None:
        """Receiver thread: close the sockets nothing was sent on for `idle_s`."""
        with self._peers_lock:
            idle = [a for a, o in self._peers.items() if now - o.last_used > self._idle_s]
            gone = [self._peers.pop(a) for a in idle]
        for out in gone:
            self._close(out)

    # -- receiving -------------------------------------------------------------------------
    def _recv_loop(self) -> None:
        """Receive and dispatch; sweep idle PUSH sockets every `_SWEEP_S` while any is
        open. With none open it blocks until a message, a wake (`_wake`) or nothing."""
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        poller.register(self._wake_rx, zmq.POLLIN)
        next_sweep = time.monotonic() + _SWEEP_S
        while not self._stop.is_set():
            timeout = max(0.0, next_sweep - time.monotonic()) * 1000 if self._peers else None
            ready = dict(poller.poll(timeout))
            now = time.monotonic()
            if now >= next_sweep:
                next_sweep = now + _SWEEP_S
                self._sweep_idle(now)
            if self._wake_rx in ready:
                with contextlib.suppress(zmq.ZMQError):
                    while True:
                        self._wake_rx.recv(flags=zmq.NOBLOCK)
            if self._pull not in ready:
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
            if self._key:
                refused = self._replays.check(env.sent_at, env.nonce, time.time())
                if refused:
                    raise ValueError(refused)
            return m.decode(env.body)
        except (ValueError, msgspec.DecodeError, msgspec.ValidationError) as exc:
            self.num_rejected += 1
            self._drops.warning("side channel: dropped a message: %s", shown(exc))
            return None

    def _dispatch(self, msg: m.Message) -> None:
        is_reply = isinstance(msg, m.HelloReply | m.PullClaimReply)
        waiter = self._waiters.get(msg.nonce) if is_reply else None
        if waiter is not None:
            with contextlib.suppress(InvalidStateError):  # a duplicate reply (no token)
                waiter.set_result(msg)
            return
        try:
            self._handler(msg)
        except Exception:  # a handler bug must not kill the channel
            log.exception("side channel handler failed on %s", type(msg).__name__)

    def stopped(self) -> list[str]:
        """["side channel receiver"] if the receiving thread died before `close`."""
        alive = self._thread.is_alive() or self._stop.is_set()
        return [] if alive else ["side channel receiver"]

    def close(self) -> None:
        self._stop.set()
        self._wake()
        self._thread.join(2.0)
        with self._peers_lock:
            outs = list(self._peers.values())
            self._peers.clear()
        for out in outs:
            self._close(out)
        with self._wake_lock:
            self._wake_tx.close(0)
        self._wake_rx.close(0)
        self._pull.close(0)
        self._ctx.term()


@dataclass(eq=False)
class _Out:
    """One PUSH socket to a peer address; used, and closed, only under `lock`."""

    sock: zmq.Socket
    lock: threading.Lock = field(default_factory=threading.Lock)
    last_used: float = 0.0
    closed: bool = False


def new_nonce() -> str:
    return secrets.token_hex(8)
