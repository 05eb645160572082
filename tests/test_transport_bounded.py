"""Bounded before authentication: what a stranger who reaches a KV or side-channel port can
cost an instance without the cluster token.

- a frame header announced huge costs nothing until its bytes arrive, and a handshake frame
  over `MAX_HANDSHAKE_HEADER_BYTES` is refused before it is read;
- connections that never authenticate take at most `MAX_PENDING_HANDSHAKES` threads, for at
  most the answer timeout each, and an honest peer gets in afterwards;
- a failing accept (EMFILE) does not end the listener;
- the side channel drops oversized frames inside ZMQ, before they are allocated, and keeps
  working; its warnings about bad frames are throttled.
"""

from __future__ import annotations

import errno
import logging
import socket
import struct
import subprocess
import sys
import threading
import time
import tracemalloc
from collections.abc import Callable

import msgspec
import numpy as np
import pytest
import zmq

from pdserve.config import TransportConfig
from pdserve.logsafe import Throttled, shown
from pdserve.transfer import messages as m
from pdserve.transfer.side_channel import MAX_MESSAGE_BYTES, SideChannel
from pdserve.transfer.transport import create_transport, handshake
from pdserve.transfer.transport.base import PeerCard
from pdserve.transfer.transport.handshake import Listener, Me, dial
from pdserve.transfer.transport.wire import (
    MAX_HANDSHAKE_HEADER_BYTES,
    Deadline,
    ProtocolError,
    recv_frame,
)

TOKEN = "bounded-test-token"


def wait_for(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met"
        time.sleep(0.02)


def tcp(name: str = "target"):
    t = create_transport(TransportConfig(kind="tcp", cluster_token=TOKEN, timeout_s=5.0), name)
    t.register("kv", np.zeros(4096, dtype=np.uint8))
    return t


def listen_port(t) -> int:
    return t._listeners[0].port


def test_an_announced_header_costs_only_the_bytes_that_came() -> None:
    a, b = socket.socketpair()
    a.sendall(struct.pack("!I", 16 << 20) + b"\x81" * 100)
    a.close()
    tracemalloc.start()
    try:
        with pytest.raises(ConnectionError):
            recv_frame(b, Deadline(5.0, "test"))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
        b.close()
    assert peak < 1 << 20, peak  # 16 MiB announced; the old code allocated all of it


def test_a_large_handshake_frame_is_refused_unread() -> None:
    a, b = socket.socketpair()
    a.sendall(struct.pack("!I", MAX_HANDSHAKE_HEADER_BYTES + 1))
    with pytest.raises(ProtocolError, match="limit"):
        recv_frame(b, Deadline(5.0, "test"), MAX_HANDSHAKE_HEADER_BYTES)
    a.close()
    b.close()


def _honest_peer_connects(target) -> bool:
    peer = tcp("honest")
    try:
        peer.add_peer(target.local_metadata())
        return True
    finally:
        peer.close()


def test_silent_connections_are_capped_and_time_out(monkeypatch) -> None:
    monkeypatch.setattr(handshake, "ANSWER_TIMEOUT_S", 1.0)
    t = tcp()
    silent: list[socket.socket] = []
    try:
        port = listen_port(t)
        listener = t._listeners[0]
        for _ in range(handshake.MAX_PENDING_HANDSHAKES + 10):
            silent.append(socket.create_connection(("127.0.0.1", port)))
        wait_for(lambda: listener.refused >= 10)
        conns = [th for th in threading.enumerate() if th.name.endswith("-conn")]
        assert len(conns) <= handshake.MAX_PENDING_HANDSHAKES
        # Each silent connection holds its slot until the answer timeout, then is closed.
        wait_for(lambda: all(_closed_by_peer(s) for s in silent), timeout=15.0)
        assert _honest_peer_connects(t)
    finally:
        for s in silent:
            s.close()
        t.close()


def _closed_by_peer(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True


class FlakyAccept:
    """A listening socket whose first `failures` accepts fail with EMFILE."""

    def __init__(self, sock: socket.socket, failures: int) -> None:
        self._sock = sock
        self.failures = failures

    def accept(self) -> tuple[socket.socket, object]:
        if self.failures:
            self.failures -= 1
            raise OSError(errno.EMFILE, "Too many open files")
        return self._sock.accept()

    def __getattr__(self, name: str) -> object:
        return getattr(self._sock, name)


def test_the_listener_survives_running_out_of_file_descriptors(caplog) -> None:
    served = threading.Event()
    server = socket.create_server(("127.0.0.1", 0))
    flaky = FlakyAccept(server, failures=5)

    def on_accept(conn: socket.socket) -> None:
        served.set()
        conn.close()

    listener = Listener(flaky, on_accept, "flaky")  # type: ignore[arg-type]
    try:
        with caplog.at_level(logging.WARNING):
            socket.create_connection(("127.0.0.1", listener.port)).close()
            assert served.wait(10.0), "the listener stopped accepting after EMFILE"
        assert listener.alive and listener.accept_errors == 5
        assert sum("accept failed" in r.getMessage() for r in caplog.records) == 1
    finally:
        listener.close()
    assert not listener.alive


def test_the_side_channel_drops_oversized_frames_before_allocating_them() -> None:
    got: list[m.Message] = []
    side = SideChannel(got.append, token=TOKEN)
    try:
        before = _rss_bytes()
        sender = subprocess.run(
            [sys.executable, "-c", _OVERSIZED_SENDER, str(side.address[1])],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert sender.returncode == 0, sender.stderr
        grown = _rss_bytes() - before
        assert grown < 64 << 20, f"RSS grew by {grown >> 20} MiB"
        # ZMQ dropped them: none reached the MAC check (which would count a rejection).
        assert side.num_rejected == 0
        honest = SideChannel(lambda msg: None, token=TOKEN)
        try:
            honest.send(side.address, m.Ping(reply_to=honest.address))
            wait_for(lambda: bool(got))
        finally:
            honest.close()
        assert isinstance(got[0], m.Ping)
    finally:
        side.close()


# Three frames of 8x the limit with a bogus MAC, then wait until they are gone.
_OVERSIZED_SENDER = f"""
import sys, time, zmq
ctx = zmq.Context()
s = ctx.socket(zmq.PUSH)
s.setsockopt(zmq.LINGER, 5000)
s.connect(f"tcp://127.0.0.1:{{sys.argv[1]}}")
for _ in range(3):
    s.send_multipart([b"x" * 32, bytes({8 * MAX_MESSAGE_BYTES})])
time.sleep(1.0)
s.close()
ctx.term()
"""


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_zmq_is_what_enforces_the_limit() -> None:
    """Guards the test above: the limit is a socket option of the inbox, not our code."""
    side = SideChannel(lambda msg: None)
    try:
        assert side._pull.getsockopt(zmq.MAXMSGSIZE) == MAX_MESSAGE_BYTES
    finally:
        side.close()


def test_shown_escapes_and_truncates() -> None:
    assert shown("engine\nINFO forged line") == "engine\\nINFO forged line"
    long = shown("x" * 10_000)
    assert long.startswith("x" * 120) and long.endswith("(10000 chars)") and len(long) < 150


def test_throttled_logs_one_line_per_interval_with_the_count(caplog) -> None:
    now = [0.0]
    t = Throttled(logging.getLogger("throttle-test"), interval_s=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="throttle-test"):
        logged = [t.warning("bad frame %d", i) for i in range(20_000)]
        now[0] = 11.0
        logged.append(t.warning("bad frame %d", 20_000))
    assert sum(logged) == 2 and t.count == 20_001
    assert caplog.records[-1].getMessage() == (
        "bad frame 20000 (and 19999 more like it in the last 10 s)"
    )


def test_a_peer_cannot_forge_log_lines(caplog) -> None:
    """A client whose engine id carries a newline and 100 kB fails the token check; the
    warning naming it is one escaped, bounded line."""
    t = tcp()
    forged = "evil\n2026-12-02 00:00:00 INFO pdserve: all good" + "x" * 100_000
    me = Me(
        PeerCard(
            kind="tcp",
            engine_id=forged,
            incarnation="i1",
            started_ns=time.time_ns(),
            host="127.0.0.1",
            port=1,
        ),
        "not-the-token",
    )
    try:
        with caplog.at_level(logging.WARNING), pytest.raises(Exception):  # noqa: B017
            dial(msgspec.msgpack.decode(t.local_metadata(), type=PeerCard), me, 5.0)
        wait_for(lambda: any("refused a connection" in r.getMessage() for r in caplog.records))
    finally:
        t.close()
    lines = [r.getMessage() for r in caplog.records if "refused a connection" in r.getMessage()]
    assert lines and all("\n" not in m and len(m) < 1000 for m in lines), lines
    assert any("evil\\n2026" in m for m in lines), lines  # escaped, still readable
