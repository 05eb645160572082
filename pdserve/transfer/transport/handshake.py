"""Authenticated handshake on a fresh TCP connection, and the listener that accepts them.

    client                                server
      Hello(version, backend, id, nonce_c) ->
                                          <- Challenge(id, nonce_s, proof_server)
      [check proof_server, identity]
      Auth(proof_client, card, extra)     ->
                                          [check proof_client; admit(card, extra)]
                                          <- Welcome(card, extra)   or Refuse(code, reason)

The client also checks that the server's identity is the one its metadata promised: a
different incarnation at that address means the peer restarted (`StalePeerError`). Nothing
backend-specific (e.g. NIXL agent metadata, in `extra`) is given before the proofs check
out. Both backends use this: tcp keeps the socket as its data connection, nixl as a
liveness link.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass

from pdserve.logsafe import Throttled, shown
from pdserve.threads import Thread
from pdserve.transfer.transport import auth
from pdserve.transfer.transport.base import (
    PROTOCOL_VERSION,
    AuthError,
    PeerCard,
    PeerError,
    StalePeerError,
    TransportError,
)
from pdserve.transfer.transport.wire import (
    MAX_HANDSHAKE_HEADER_BYTES,
    Auth,
    Challenge,
    Deadline,
    Frame,
    Hello,
    Refuse,
    Welcome,
    recv_frame,
    send_frame,
)

log = logging.getLogger(__name__)

IO_TICK_S = 0.25  # socket timeout: how often blocked I/O wakes up to check liveness
# Connections in the handshake (not yet authenticated) at once; more are closed at once.
MAX_PENDING_HANDSHAKES = 32
# How long a connection may take to authenticate on the accepting side (the transport's own
# `timeout_s` if shorter): a connection that says nothing holds its slot no longer.
ANSWER_TIMEOUT_S = 5.0
# accept() errors that no wait cures (the socket was closed or is not a listening socket);
# the others (EMFILE, ENFILE, ENOBUFS, ENOMEM, ECONNABORTED...) pass, so they are retried.
_FATAL_ACCEPT_ERRORS = frozenset({errno.EBADF, errno.ENOTSOCK, errno.EINVAL, errno.EOPNOTSUPP})
ACCEPT_RETRY_MIN_S = 0.05  # the pause after a failed accept, doubled up to the max
ACCEPT_RETRY_MAX_S = 1.0
UNIX_BUFFER_BYTES = 4 << 20  # capped by net.core.{w,r}mem_max


@dataclass(frozen=True)
class Me:
    """The local side of a handshake."""

    card: PeerCard
    token: str | None
    extra: bytes = b""


def configure(sock: socket.socket) -> None:
    """Options every transport socket gets."""
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    else:  # Unix sockets do not autotune: 200 KB by default means a syscall per 200 KB
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            sock.setsockopt(socket.SOL_SOCKET, opt, UNIX_BUFFER_BYTES)
    sock.settimeout(IO_TICK_S)


def host_identity() -> str | None:
    """Same value in two processes iff they share a kernel boot and a network namespace,
    i.e. iff one can reach the other's abstract Unix socket. None off Linux."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}:{os.stat('/proc/self/ns/net').st_ino}"
    except OSError:
        return None


def tcp_server(host: str, port: int) -> socket.socket:
    return socket.create_server((host, port))


def abstract_path(name: str) -> str:
    """A Unix socket address in Linux's abstract namespace: no file, gone with the process."""
    return "\0" + name


def unix_server(path: str) -> socket.socket | None:
    """A listening Unix-domain socket at `path`, or None where that is unsupported."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
        sock.listen()
    except OSError:
        sock.close()
        return None
    return sock


def _connect(peer: PeerCard, me: Me, timeout_s: float) -> socket.socket:
    """Same host: the peer's Unix socket (several times faster than TCP loopback), else TCP."""
    if peer.unix_path and peer.host_id and peer.host_id == me.card.host_id:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout_s)
        try:
            sock.connect(peer.unix_path)
            return sock
        except OSError:
            sock.close()  # e.g. another network namespace after all: use TCP
    return socket.create_connection((peer.host, peer.port), timeout=timeout_s)


def _refusal(code: str, reason: str) -> TransportError:
    kinds = {"auth": AuthError, "stale": StalePeerError}
    return kinds.get(code, PeerError)(reason)


def _code(exc: TransportError) -> str:
    if isinstance(exc, AuthError):
        return "auth"
    return "stale" if isinstance(exc, StalePeerError) else "peer"


def _recv_small(sock: socket.socket, live: Deadline) -> Frame:
    """A handshake frame: nobody is authenticated yet, so only a small one is read."""
    return recv_frame(sock, live, MAX_HANDSHAKE_HEADER_BYTES)


def _expect(frame: Frame, kind: type, who: str) -> Frame:
    if isinstance(frame, Refuse):
        raise _refusal(frame.code, f"{who} refused: {frame.reason}")
    if not isinstance(frame, kind):
        raise PeerError(f"{who} sent {type(frame).__name__} during the handshake")
    return frame


def _refuse(sock: socket.socket, exc: TransportError, live: Deadline) -> TransportError:
    with contextlib.suppress(OSError):
        send_frame(sock, Refuse(_code(exc), str(exc)), live)
    return exc


def dial(peer: PeerCard, me: Me, timeout_s: float) -> tuple[socket.socket, Welcome]:
    """Connect to `peer`'s listener and authenticate both ways; returns socket + welcome."""
    who = f"peer {peer.engine_id} at {peer.host}:{peer.port}"
    try:
        sock = _connect(peer, me, timeout_s)
    except OSError as exc:
        raise PeerError(f"cannot reach {who}: {exc}") from None
    try:
        configure(sock)
        return sock, _client_side(sock, peer, me, who, Deadline(timeout_s, f"handshake with {who}"))
    except BaseException:
        sock.close()
        raise


def _client_side(sock: socket.socket, peer: PeerCard, me: Me, who: str, live: Deadline) -> Welcome:
    nonce = auth.new_nonce()
    mine = (me.card.engine_id, me.card.incarnation)
    send_frame(sock, Hello(PROTOCOL_VERSION, me.card.kind, *mine, nonce), live)
    ch = _expect(_recv_small(sock, live), Challenge, who)
    found = (ch.engine_id, ch.incarnation)
    if found != (peer.engine_id, peer.incarnation):
        raise _refuse(
            sock,
            StalePeerError(
                f"{who} is now {found[0]}@{found[1][:8]}, not incarnation {peer.incarnation[:8]} "
                "of the metadata: it restarted; get fresh metadata"
            ),
            live,
        )
    tr = auth.transcript(me.card.kind, mine, found, nonce, ch.nonce)
    if not auth.verify(me.token, auth.SERVER, tr, ch.proof):
        raise _refuse(sock, AuthError(f"{who} could not prove it knows the cluster token"), live)
    send_frame(sock, Auth(auth.prove(me.token, auth.CLIENT, tr), me.card, me.extra), live)
    return _expect(_recv_small(sock, live), Welcome, who)


Admit = Callable[[PeerCard, bytes], bytes]


def answer(sock: socket.socket, me: Me, admit: Admit, timeout_s: float) -> Auth:
    """Server side: authenticate the client, let `admit` accept it (returns our extra)."""
    live = Deadline(min(timeout_s, ANSWER_TIMEOUT_S), "handshake")
    hello = _expect(_recv_small(sock, live), Hello, "client")
    if hello.version != PROTOCOL_VERSION or hello.backend != me.card.kind:
        raise _refuse(
            sock,
            PeerError(
                f"client speaks {hello.backend} v{hello.version}, we are {me.card.kind} "
                f"v{PROTOCOL_VERSION}"
            ),
            live,
        )
    nonce = auth.new_nonce()
    theirs, mine = (hello.engine_id, hello.incarnation), (me.card.engine_id, me.card.incarnation)
    tr = auth.transcript(me.card.kind, theirs, mine, hello.nonce, nonce)
    send_frame(sock, Challenge(*mine, nonce, auth.prove(me.token, auth.SERVER, tr)), live)
    msg = _expect(_recv_small(sock, live), Auth, f"client {hello.engine_id}")
    if not auth.verify(me.token, auth.CLIENT, tr, msg.proof):
        raise _refuse(sock, AuthError(f"client {hello.engine_id} failed the token check"), live)
    if (msg.card.engine_id, msg.card.incarnation) != theirs:
        raise _refuse(sock, PeerError("client card does not match its hello"), live)
    try:
        extra = admit(msg.card, msg.extra)
    except TransportError as exc:
        raise _refuse(sock, exc, live) from None
    send_frame(sock, Welcome(me.card, extra), live)
    return msg


WILDCARD_HOSTS = ("", "0.0.0.0", "::")


def advertised_host(host: str, advertise: str | None = None) -> str:
    """The address peers are told to dial when we listen on `host`: `advertise` when given,
    else `host` itself. A wildcard `host` without `advertise` is refused (ValueError): no
    guess (the hostname's address is often 127.0.1.1) reliably reaches us from a peer."""
    if advertise:
        return advertise
    if host in WILDCARD_HOSTS:
        raise ValueError(wildcard_message(host))
    return host


def wildcard_message(host: str) -> str:
    """Why a wildcard KV bind address cannot be advertised, and what to do."""
    return (
        f"--kv-host {host or repr(host)} binds every interface, but peers need one address to "
        "dial: pass --kv-advertise-host ADDR (this instance's address as its peers reach it)"
    )


class Listener:
    """Accepts connections on a listening socket; runs `on_accept(sock)` in a thread each.

    `on_accept` is where a connection authenticates (the handshake), so at most
    `max_pending` connections run it at once: one over that is closed at once (counted in
    `refused`), so unauthenticated connections cannot take a thread and a file descriptor
    each without bound. An accept that fails (EMFILE when the process is out of file
    descriptors, ENOBUFS, ...) is logged, waited out with a growing pause and retried: the
    listener keeps going until `close()`. `alive` tells whether its thread still runs.
    """

    def __init__(
        self,
        sock: socket.socket,
        on_accept: Callable[[socket.socket], None],
        name: str,
        max_pending: int = MAX_PENDING_HANDSHAKES,
    ):
        self._sock = sock
        self._sock.settimeout(IO_TICK_S)
        self._on_accept = on_accept
        self._name = name
        self._slots = threading.BoundedSemaphore(max_pending)
        self.refused = 0  # connections closed because `max_pending` were in the handshake
        self.accept_errors = 0
        self._refusals = Throttled(log)  # a flood of bad clients writes a line per interval
        self._stop = threading.Event()
        self._thread = Thread(target=self._loop, name=f"{name}-listen", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return self._sock.getsockname()[1]

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def name(self) -> str:
        return self._name

    def _loop(self) -> None:
        pause = ACCEPT_RETRY_MIN_S
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if self._stop.is_set():
                    break
                if exc.errno in _FATAL_ACCEPT_ERRORS:  # the socket itself is gone
                    log.error("%s: the listening socket failed (%s): stopped", self._name, exc)
                    break
                self._accept_failed(exc, pause)
                pause = min(2 * pause, ACCEPT_RETRY_MAX_S)
                continue
            if self._stop.is_set():  # close()'s wake-up, or a client just too late
                conn.close()
                break
            pause = ACCEPT_RETRY_MIN_S
            self._start(conn)

    def _accept_failed(self, exc: OSError, pause: float) -> None:
        self.accept_errors += 1
        if self.accept_errors == 1 or self.accept_errors % 100 == 0:
            log.warning(
                "%s: accept failed (%s; %d so far): retrying in %.2f s",
                self._name,
                exc,
                self.accept_errors,
                pause,
            )
        self._stop.wait(pause)

    def _start(self, conn: socket.socket) -> None:
        if not self._slots.acquire(blocking=False):
            self.refused += 1
            conn.close()
            return
        try:
            configure(conn)
            Thread(target=self._serve, args=(conn,), name=f"{self._name}-conn", daemon=True).start()
        except BaseException:  # e.g. no thread could be started: give the slot back
            self._slots.release()
            conn.close()
            raise

    def _serve(self, conn: socket.socket) -> None:
        try:
            self._on_accept(conn)
        except Exception as exc:  # one bad client must not take the listener down
            self._refusals.warning("%s: refused a connection: %s", self._name, shown(exc, 300))
            conn.close()
        finally:
            self._slots.release()

    def close(self) -> None:
        self._stop.set()
        self._wake()
        self._thread.join(timeout=2 * IO_TICK_S + 1)
        self._sock.close()

    def _wake(self) -> None:
        """End a blocked accept() now rather than at the next IO tick (close() would wait it
        out). A TCP listening socket shut down fails it (Linux: EINVAL); a Unix one is not
        woken by that, so it gets a connection, which the loop drops. Where neither works,
        the tick still ends the loop."""
        with contextlib.suppress(OSError):
            if self._sock.family == socket.AF_UNIX:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as poke:
                    poke.settimeout(IO_TICK_S)
                    poke.connect(self._sock.getsockname())
            else:
                self._sock.shutdown(socket.SHUT_RDWR)
