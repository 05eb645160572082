"""tcp backend under attack: the target's own checks, not the initiator's, keep memory safe.

A "rogue" client speaks the wire protocol directly (it can skip every check the honest
initiator makes) against a real TcpTransport in this process.
"""

from __future__ import annotations

import os
import socket
import time

import numpy as np
import pytest

from pdserve.config import TransportConfig
from pdserve.transfer.transport import AuthError, TransferState, create_transport, handshake
from pdserve.transfer.transport.base import PeerCard
from pdserve.transfer.transport.handshake import (
    Listener,
    Me,
    abstract_path,
    dial,
    unix_server,
)
from pdserve.transfer.transport.wire import (
    Ack,
    Deadline,
    Fail,
    ReadReq,
    Write,
    encode_descs,
    encode_frame,
    recv_frame,
    send_frame,
)

TOKEN = "tcp-test-token"
SIZE, GUARD = 1 << 16, 4096


@pytest.fixture
def target():
    t = create_transport(TransportConfig(kind="tcp", cluster_token=TOKEN, timeout_s=2.0), "target")
    buf = np.full(SIZE + GUARD, 0x5A, dtype=np.uint8)
    region = t.register("kv", buf[:SIZE])
    try:
        yield t, buf, region
    finally:
        t.close()


def _card_of(t) -> PeerCard:
    import msgspec

    return msgspec.msgpack.decode(t.local_metadata(), type=PeerCard)


def rogue(t, token: str | None = TOKEN) -> socket.socket:
    """An authenticated raw connection to `t` (the handshake itself is the real one)."""
    me = Me(
        PeerCard(
            kind="tcp",
            engine_id="rogue",
            incarnation="r1",
            started_ns=time.time_ns(),
            host="127.0.0.1",
            port=1,
        ),
        token,
    )
    sock, _ = dial(_card_of(t), me, timeout_s=5.0)
    return sock


def live() -> Deadline:
    return Deadline(5.0, "test")


def _write_frame(
    sock: socket.socket,
    descs: list[tuple[int, int, int]],
    payload: bytes,
    nbytes: int | None = None,
) -> None:
    arr = np.array(descs, dtype=np.int64)
    frame = Write(1, encode_descs(arr), len(payload) if nbytes is None else nbytes, b"sneaky")
    send_frame(sock, frame, live(), [memoryview(payload)])


@pytest.mark.parametrize(
    "descs",
    [
        [(0, SIZE - 8, 64)],  # runs into the guard
        [(0, 0, 32), (0, SIZE, 32)],  # second one starts past the end
        [(0, -32, 64)],
        [(3, 0, 64)],  # unregistered region
    ],
)
def test_out_of_bounds_write_refused_by_target(target, descs) -> None:
    t, buf, _ = target
    before = buf.copy()
    sock = rogue(t)
    try:
        _write_frame(sock, descs, b"\xff" * 64)
        reply = recv_frame(sock, live())
        assert isinstance(reply, Fail) and reply.xfer == 1 and "refused" in reply.reason
        assert np.array_equal(buf, before)  # nothing written, guard intact
        assert t.get_notifs() == []  # and no notification delivered
        _write_frame(sock, [(0, 0, 4)], b"okay")  # the connection is still in step
        assert isinstance(recv_frame(sock, live()), Ack)
        assert bytes(buf[:4]) == b"okay"
    finally:
        sock.close()


def test_out_of_bounds_read_refused_by_target(target) -> None:
    t, _, _ = target
    sock = rogue(t)
    try:
        send_frame(sock, ReadReq(9, encode_descs(np.array([(0, SIZE - 4, 8)])), 8), live())
        reply = recv_frame(sock, live())
        assert isinstance(reply, Fail) and reply.xfer == 9
    finally:
        sock.close()


def test_lying_payload_size_closes_connection_without_writing(target) -> None:
    t, buf, _ = target
    before = buf.copy()
    sock = rogue(t)
    try:
        _write_frame(sock, [(0, 0, 64)], b"\x01" * 64, nbytes=32)  # header disagrees with descs
        with pytest.raises(ConnectionError):
            recv_frame(sock, live())
        assert np.array_equal(buf, before)
    finally:
        sock.close()


def test_unauthenticated_frames_are_refused(target) -> None:
    t, buf, _ = target
    before = buf.copy()
    host, port = _card_of(t).host, _card_of(t).port
    with socket.create_connection((host, port), timeout=5) as sock:
        sock.settimeout(5)
        frame = Write(1, encode_descs(np.array([(0, 0, 8)])), 8, None)
        sock.sendall(encode_frame(frame) + b"\x02" * 8)
        try:
            reply = recv_frame(sock, live())
        except ConnectionError:  # closed on us: the expected answer
            reply = None
        assert not isinstance(reply, Ack)
    with socket.create_connection((host, port), timeout=5) as sock:
        sock.sendall(b"\x00\x00\x00\x05garbage")  # not even a frame
    time.sleep(0.1)
    assert np.array_equal(buf, before)
    assert t.peers() == []


def test_token_mismatch_refused_both_ways(target) -> None:
    t, _, _ = target
    with pytest.raises(AuthError):
        rogue(t, token="wrong")
    with pytest.raises(AuthError):
        rogue(t, token=None)
    open_one = create_transport(TransportConfig(kind="tcp"), "no-token")
    try:
        with pytest.raises(AuthError):  # a token holder refuses a server that cannot prove it
            t.add_peer(open_one.local_metadata())
        assert t.peers() == [] and open_one.peers() == []
    finally:
        open_one.close()


def test_listener_binds_loopback_by_default(target) -> None:
    t, _, _ = target
    assert _card_of(t).host == "127.0.0.1"


def test_transfer_survives_garbage_from_another_client(target) -> None:
    t, buf, region = target
    src = create_transport(
        TransportConfig(kind="tcp", cluster_token=TOKEN, timeout_s=2.0), "honest"
    )
    try:
        data = np.arange(256, dtype=np.uint8)
        lr = src.register("src", data)
        peer = src.add_peer(t.local_metadata())
        with socket.create_connection((_card_of(t).host, _card_of(t).port)) as bad:
            bad.sendall(b"\xff" * 100)
        h = src.write(peer, [(lr, 0, 256)], [(region, 1024, 256)], b"fine")
        assert src.wait(h, 10) is TransferState.DONE
        assert np.array_equal(buf[1024:1280], data)
        assert [n.payload for n in t.wait_notifs(5)] == [b"fine"]
    finally:
        src.close()


def test_unauthenticated_frames_refused_on_unix_socket(target) -> None:
    t, buf, _ = target
    before = buf.copy()
    path = _card_of(t).unix_path
    if path is None:
        pytest.skip("no Unix-socket fast path on this platform")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(5)
        sock.connect(path)
        frame = Write(1, encode_descs(np.array([(0, 0, 8)])), 8, None)
        sock.sendall(encode_frame(frame) + b"\x03" * 8)
        try:
            reply = recv_frame(sock, live())
        except ConnectionError:
            reply = None
        assert not isinstance(reply, Ack)
    assert np.array_equal(buf, before)
    assert t.peers() == []


SLOW_TICK_S = 30.0


@pytest.mark.parametrize("family", ["tcp", "unix"])
def test_closing_a_listener_wakes_its_accept_at_once(
    family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """close() does not wait out the accept's IO tick (every transport closes one or two).
    The tick is stretched to 30 s, so only a close that wakes the accept ends in time: the
    bound below is far from any scheduling delay."""
    monkeypatch.setattr(handshake, "IO_TICK_S", SLOW_TICK_S)
    if family == "tcp":
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen()
    else:
        sock = unix_server(abstract_path(f"pdserve-test-listener-{os.getpid()}"))
        if sock is None:
            pytest.skip("no Unix-domain sockets here")
    listener = Listener(sock, lambda conn: conn.close(), "test")
    time.sleep(0.05)  # its thread is in accept()
    start = time.monotonic()
    listener.close()
    assert not listener.alive
    assert time.monotonic() - start < SLOW_TICK_S / 3
