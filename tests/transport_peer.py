"""A transport peer in its own process, driven by the conformance tests over a pipe.

The child owns one region of `size` bytes inside a buffer of `size + GUARD` bytes (the guard
is never registered, so any write landing there is a bug). It polls notifications between
commands (that also drives NIXL progress on the target side) and, for each notification it
was told to expect, checks at the moment of arrival that the data is already in place.

Commands and replies are msgspec structs over `Connection.send_bytes` (no pickles).
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import signal
import time
from multiprocessing.connection import Connection

import msgspec
import numpy as np
from freeze import freeze

from pdserve.config import TransportConfig
from pdserve.transfer.transport import PeerId, Transport, create_transport
from pdserve.transfer.transport.tcp import TcpOptions, TcpTransport

GUARD = 4096
GUARD_BYTE = 0xA5
REPLY_TIMEOUT_S = 30.0


def pattern(seed: int, size: int) -> np.ndarray:
    """The bytes a region filled with `seed` holds (both processes compute the same)."""
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8)


def digest(buf: np.ndarray, descs: np.ndarray) -> bytes:
    h = hashlib.sha256()
    for _, off, n in descs.tolist():
        h.update(buf[off : off + n].tobytes())
    return h.digest()


class Setup(msgspec.Struct, frozen=True):
    kind: str
    engine_id: str
    size: int
    token: str | None = None
    timeout_s: float = 5.0
    port: int = 0
    granule: int | None = None
    seed: int = 0


class Expect(msgspec.Struct, tag="expect"):
    payload: bytes
    descs: bytes  # int64 (N, 3) in this child's region
    sha256: bytes


class Dump(msgspec.Struct, tag="dump"):
    pass


class Notifs(msgspec.Struct, tag="notifs"):
    pass


class AddPeer(msgspec.Struct, tag="add_peer"):
    metadata: bytes


class Peers(msgspec.Struct, tag="peers"):
    pass


class SendNotif(msgspec.Struct, tag="send_notif"):
    engine_id: str
    payload: bytes


class Quit(msgspec.Struct, tag="quit"):
    pass


Command = Expect | Dump | Notifs | AddPeer | Peers | SendNotif | Quit


class Seen(msgspec.Struct, frozen=True):
    """A notification as the child saw it; `data_ok` None when nothing was expected."""

    engine_id: str
    incarnation: str
    payload: bytes
    data_ok: bool | None


class Reply(msgspec.Struct):
    ok: bool = True
    error: str | None = None
    metadata: bytes = b""
    data: bytes = b""
    seen: list[Seen] = []
    peers: list[PeerId] = []
    pid: int = 0


def open_transport(variant: str, engine_id: str, **config) -> Transport:
    """A transport for a test variant: "tcp" (Unix socket on one host), "tcp-inet" (TCP
    forced), "nixl"."""
    if variant == "tcp-inet":
        cfg = TransportConfig(kind="tcp", **config)
        return TcpTransport(cfg, engine_id, TcpOptions(same_host_unix=False))
    return create_transport(TransportConfig(kind=variant, **config), engine_id)


class _Child:
    def __init__(self, setup: Setup) -> None:
        self.t = open_transport(
            setup.kind,
            setup.engine_id,
            cluster_token=setup.token,
            timeout_s=setup.timeout_s,
            port=setup.port,
        )
        self.buf = np.full(setup.size + GUARD, GUARD_BYTE, dtype=np.uint8)
        self.buf[: setup.size] = pattern(setup.seed, setup.size)
        self.region = self.t.register("r", self.buf[: setup.size], granule=setup.granule)
        self.expected: dict[bytes, Expect] = {}
        self.seen: list[Seen] = []

    def poll_notifs(self) -> None:
        for n in self.t.get_notifs():
            exp = self.expected.pop(n.payload, None)
            ok = None
            if exp is not None:
                descs = np.frombuffer(exp.descs, dtype=np.int64).reshape(-1, 3)
                ok = digest(self.buf, descs) == exp.sha256
            self.seen.append(Seen(n.peer.engine_id, n.peer.incarnation, n.payload, ok))

    def handle(self, cmd: Command) -> Reply:
        if isinstance(cmd, Expect):
            self.expected[cmd.payload] = cmd
            return Reply()
        if isinstance(cmd, Dump):
            return Reply(data=self.buf.tobytes())
        if isinstance(cmd, Notifs):
            self.poll_notifs()
            seen, self.seen = self.seen, []
            return Reply(seen=seen)
        if isinstance(cmd, AddPeer):
            self.t.add_peer(cmd.metadata)
            return Reply()
        if isinstance(cmd, Peers):
            return Reply(peers=self.t.peers())
        if isinstance(cmd, SendNotif):
            peer = next(p for p in self.t.peers() if p.engine_id == cmd.engine_id)
            self.t.send_notif(peer, cmd.payload)
            return Reply()
        raise ValueError(f"unknown command {cmd!r}")


def child_main(conn: Connection, setup_bytes: bytes) -> None:
    """Entry point of the child process."""
    child = _Child(msgspec.msgpack.decode(setup_bytes, type=Setup))
    conn.send_bytes(
        msgspec.msgpack.encode(Reply(metadata=child.t.local_metadata(), pid=os.getpid()))
    )
    decoder = msgspec.msgpack.Decoder(Command)
    while True:
        if conn.poll(0.001):
            cmd = decoder.decode(conn.recv_bytes())
            if isinstance(cmd, Quit):
                break
            try:
                reply = child.handle(cmd)
            except Exception as exc:
                reply = Reply(ok=False, error=f"{type(exc).__name__}: {exc}")
            conn.send_bytes(msgspec.msgpack.encode(reply))
        child.poll_notifs()
    child.t.close()


class PeerProcess:
    """Parent-side handle of one child; stop() kills it by PID."""

    def __init__(self, setup: Setup) -> None:
        self.setup = setup
        ctx = mp.get_context("spawn")
        self.conn, child_conn = ctx.Pipe()
        self.proc = ctx.Process(
            target=child_main, args=(child_conn, msgspec.msgpack.encode(setup)), daemon=True
        )
        self.proc.start()
        first = self._reply()
        self.metadata, self.pid = first.metadata, first.pid

    def _reply(self) -> Reply:
        if not self.conn.poll(REPLY_TIMEOUT_S):
            raise TimeoutError(f"peer process {self.setup.engine_id} did not answer")
        return msgspec.msgpack.decode(self.conn.recv_bytes(), type=Reply)

    def call(self, cmd: Command) -> Reply:
        self.conn.send_bytes(msgspec.msgpack.encode(cmd))
        reply = self._reply()
        if not reply.ok:
            raise RuntimeError(reply.error)
        return reply

    def region_bytes(self) -> np.ndarray:
        return np.frombuffer(self.call(Dump()).data, dtype=np.uint8)

    def notifs(self) -> list[Seen]:
        return self.call(Notifs()).seen

    def wait_notifs(self, count: int, timeout_s: float = 10.0) -> list[Seen]:
        seen: list[Seen] = []
        end = time.monotonic() + timeout_s
        while len(seen) < count and time.monotonic() < end:
            seen += self.notifs()
            time.sleep(0.005)
        return seen

    def stop_signal(self) -> None:
        freeze(self.pid)

    def kill(self) -> None:
        if self.proc.is_alive():
            os.kill(self.pid, signal.SIGKILL)
        self.proc.join(timeout=10)

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send_bytes(msgspec.msgpack.encode(Quit()))
                self.proc.join(timeout=5)
            except OSError:
                pass
        self.kill()
