"""Conformance suite: every Transport backend, with the two ends in separate processes.

The test process is one end (the initiator, mostly); `transport_peer` runs the other end in
a spawned child that reports what it saw. Every wait is bounded; children are killed by PID.
"""

from __future__ import annotations

import hashlib
import threading

import numpy as np
import pytest
from procs import free_port
from transport_peer import (
    GUARD,
    GUARD_BYTE,
    AddPeer,
    Expect,
    PeerProcess,
    Peers,
    SendNotif,
    Setup,
    open_transport,
)

from pdserve.transfer.transport import (
    AuthError,
    DescriptorError,
    PeerError,
    StalePeerError,
    TransferState,
)
from pdserve.transfer.transport.base import BackendUnavailableError
from pdserve.transfer.transport.nixl_peer import load_nixl

BLOCK = 4096
NBLOCKS = 1024
REGION = BLOCK * NBLOCKS
TOKEN = "conformance-token"
WAIT_S = 20.0  # generous bound on any single wait: a hang fails the test, slowness does not

DONE, ERROR, PENDING = TransferState.DONE, TransferState.ERROR, TransferState.PENDING


def _nixl_available() -> bool:
    try:
        load_nixl()
    except BackendUnavailableError:
        return False
    return True


KINDS = [
    "tcp",  # on one host: the Unix-socket fast path
    "tcp-inet",  # TCP forced
    pytest.param(
        "nixl",
        marks=[
            pytest.mark.nixl,
            pytest.mark.skipif(not _nixl_available(), reason="nixl not installed"),
        ],
    ),
]


@pytest.fixture(scope="module", params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return request.param


def spawn(kind: str, engine_id: str, **kw) -> PeerProcess:
    return PeerProcess(
        Setup(kind=kind, engine_id=engine_id, size=REGION, granule=BLOCK, seed=7, **kw)
    )


@pytest.fixture(scope="module")
def target(kind: str):
    p = spawn(kind, "target", token=TOKEN)
    try:
        yield p
    finally:
        p.stop()


class Local:
    """The test process's end: a transport with one registered region (plus guard)."""

    def __init__(
        self, kind: str, token: str | None = TOKEN, timeout_s: float = 3.0, name: str = "initiator"
    ):
        self.t = open_transport(kind, name, cluster_token=token, timeout_s=timeout_s)
        self.buf = np.full(REGION + GUARD, GUARD_BYTE, dtype=np.uint8)
        self.buf[:REGION] = np.random.default_rng(99).integers(0, 256, REGION, dtype=np.uint8)
        self.region = self.t.register("kv", self.buf[:REGION], granule=BLOCK)


@pytest.fixture(scope="module")
def local(kind: str):
    loc = Local(kind)
    try:
        yield loc
    finally:
        loc.t.close()


@pytest.fixture(scope="module")
def peer(local: Local, target: PeerProcess):
    return local.t.add_peer(target.metadata)


def blocks(local_region: int, src: list[int], dst: list[int]) -> tuple[np.ndarray, np.ndarray]:
    loc = np.array([(local_region, s * BLOCK, BLOCK) for s in src], dtype=np.int64)
    rem = np.array([(0, d * BLOCK, BLOCK) for d in dst], dtype=np.int64)
    return loc, rem


def expect_write(
    target: PeerProcess, payload: bytes, src_buf: np.ndarray, loc: np.ndarray, rem: np.ndarray
) -> None:
    """Tell the child which bytes must already be in place when `payload` arrives."""
    data = b"".join(src_buf[o : o + n].tobytes() for _, o, n in loc.tolist())
    target.call(Expect(payload, rem.astype(np.int64).tobytes(), hashlib.sha256(data).digest()))


def apply(expected: np.ndarray, src_buf: np.ndarray, loc: np.ndarray, rem: np.ndarray) -> None:
    for (_, so, n), (_, do, _) in zip(loc.tolist(), rem.tolist(), strict=True):
        expected[do : do + n] = src_buf[so : so + n]


def test_write_many_noncontiguous_blocks_byte_exact(
    local: Local, target: PeerProcess, peer
) -> None:
    rng = np.random.default_rng(1)
    dst = rng.choice(900, 300, replace=False).tolist()
    src = rng.choice(NBLOCKS, 300, replace=False).tolist()
    loc, rem = blocks(local.region, src + list(range(900, 940)), dst + list(range(950, 990)))
    before = target.region_bytes()
    expected = before.copy()
    apply(expected, local.buf, loc, rem)
    expect_write(target, b"w-exact", local.buf, loc, rem)

    h = local.t.write(peer, loc, rem, b"w-exact")
    assert local.t.wait(h, WAIT_S) is DONE, local.t.error(h)
    assert h.nbytes == len(loc) * BLOCK
    assert h.ndesc < len(loc)  # contiguous runs were merged
    local.t.release(h)

    seen = target.wait_notifs(1)
    assert [(s.engine_id, s.payload, s.data_ok) for s in seen] == [("initiator", b"w-exact", True)]
    assert np.array_equal(target.region_bytes(), expected)  # guard included


def test_read_many_noncontiguous_blocks_byte_exact(local: Local, target: PeerProcess, peer) -> None:
    rng = np.random.default_rng(2)
    remote_blocks = rng.choice(NBLOCKS, 200, replace=False).tolist()
    local_blocks = rng.choice(NBLOCKS, 200, replace=False).tolist()
    loc, rem = blocks(local.region, local_blocks, remote_blocks)
    theirs = target.region_bytes()
    expected = local.buf.copy()
    apply(expected, theirs, rem, loc)

    h = local.t.read(peer, loc, rem, b"r-done")
    assert local.t.wait(h, WAIT_S) is DONE, local.t.error(h)
    local.t.release(h)
    assert np.array_equal(local.buf, expected)
    seen = target.wait_notifs(1)
    assert [(s.engine_id, s.payload) for s in seen] == [("initiator", b"r-done")]


def test_notification_arrives_strictly_after_its_data(
    local: Local, target: PeerProcess, peer
) -> None:
    """Back-to-back large writes; the child checks each one's bytes when its notif lands."""
    handles, payloads = [], []
    for i in range(8):
        src = list(range(i * 64, (i + 1) * 64))
        dst = list(range(NBLOCKS - (i + 1) * 64, NBLOCKS - i * 64))[::-1]  # reversed: no merging
        loc, rem = blocks(local.region, src, dst)
        payload = f"after-{i}".encode()
        expect_write(target, payload, local.buf, loc, rem)
        payloads.append(payload)
        handles.append(local.t.write(peer, loc, rem, payload))
    for h in handles:
        assert local.t.wait(h, WAIT_S) is DONE, local.t.error(h)
        local.t.release(h)
    seen = target.wait_notifs(8)
    assert sorted(s.payload for s in seen) == sorted(payloads)
    assert all(s.data_ok for s in seen)


def test_many_concurrent_transfers(local: Local, target: PeerProcess, peer) -> None:
    """4 writer threads (64 writes) and 1 reader thread (16 reads) on one peer at once."""
    rng = np.random.default_rng(3)
    order = rng.permutation(NBLOCKS)
    write_dst, read_src = order[:768].reshape(64, 12), order[768:].reshape(16, 16)
    before = target.region_bytes()
    expected = before.copy()
    writes = []
    for i, dst in enumerate(write_dst):
        loc, rem = blocks(
            local.region, rng.choice(NBLOCKS, 12, replace=False).tolist(), dst.tolist()
        )
        apply(expected, local.buf, loc, rem)
        expect_write(target, f"cw-{i}".encode(), local.buf, loc, rem)
        writes.append((loc, rem, f"cw-{i}".encode()))
    read_bufs = [np.zeros(16 * BLOCK, dtype=np.uint8) for _ in read_src]
    read_regions = [local.t.register(f"rd{i}", b) for i, b in enumerate(read_bufs)]
    results: list[tuple[object, TransferState]] = []
    lock = threading.Lock()

    def post_and_wait(jobs) -> None:
        hs = [job() for job in jobs]
        for h in hs:
            st = local.t.wait(h, WAIT_S)
            with lock:
                results.append((h, st))

    def write_job(w):
        return lambda: local.t.write(peer, w[0], w[1], w[2])

    def read_job(i):
        loc = np.array([(read_regions[i], j * BLOCK, BLOCK) for j in range(16)])
        rem = np.array([(0, int(b) * BLOCK, BLOCK) for b in read_src[i]])
        return lambda: local.t.read(peer, loc, rem)

    threads = [
        threading.Thread(target=post_and_wait, args=([write_job(w) for w in writes[k::4]],))
        for k in range(4)
    ]
    threads.append(threading.Thread(target=post_and_wait, args=([read_job(i) for i in range(16)],)))
    for th in threads:
        th.start()
    for th in threads:
        th.join(WAIT_S * 2)
    assert len(results) == 80
    assert all(st is DONE for _, st in results), [
        local.t.error(h) for h, st in results if st is not DONE
    ]
    seen = target.wait_notifs(64)
    assert sorted(s.payload for s in seen) == sorted(w[2] for w in writes)
    assert all(s.data_ok for s in seen)
    assert np.array_equal(target.region_bytes(), expected)
    for i, blk in enumerate(read_src):
        want = np.concatenate([before[b * BLOCK : (b + 1) * BLOCK] for b in blk])
        assert np.array_equal(read_bufs[i], want)


def test_notifications_both_ways(local: Local, target: PeerProcess, peer) -> None:
    local.t.send_notif(peer, b"to-child")
    seen = target.wait_notifs(1)
    assert [(s.engine_id, s.payload) for s in seen] == [("initiator", b"to-child")]
    target.call(SendNotif("initiator", b"to-parent"))  # the child knows us from our handshake
    got = local.t.wait_notifs(WAIT_S)
    assert [(n.peer, n.payload) for n in got] == [(peer, b"to-parent")]


@pytest.mark.parametrize(
    ("remote", "why"),
    [
        ((0, REGION - 100, BLOCK), "past the end"),
        ((0, -BLOCK, BLOCK), "negative offset"),
        ((5, 0, BLOCK), "unknown region"),
        ((0, 0, 0), "empty"),
    ],
)
def test_out_of_bounds_descriptors_refused(
    local: Local, target: PeerProcess, peer, remote, why
) -> None:
    before = target.region_bytes()
    length = remote[2] or BLOCK
    for post in (local.t.write, local.t.read):
        with pytest.raises(DescriptorError):
            post(peer, [(local.region, 0, length)], [remote])
    with pytest.raises(DescriptorError):
        local.t.write(peer, [(local.region, REGION - 10, BLOCK)], [(0, 0, BLOCK)])  # local side
    assert np.array_equal(target.region_bytes(), before), why
    assert (target.region_bytes()[REGION:] == GUARD_BYTE).all()


def test_wrong_or_missing_token_refused(kind: str) -> None:
    other = spawn(kind, "guarded", token="another-token")
    wrong = Local(kind, token=TOKEN, name="wrong-token")
    none = Local(kind, token=None, name="no-token")
    try:
        for loc in (wrong, none):
            with pytest.raises(AuthError):
                loc.t.add_peer(other.metadata)
            assert loc.t.peers() == []
        assert other.call(Peers()).peers == []  # neither got registered on the other side
        with pytest.raises(RuntimeError, match="AuthError"):
            other.call(AddPeer(wrong.t.local_metadata()))  # and it cannot register with us
        assert wrong.t.peers() == []
    finally:
        other.kill()
        wrong.t.close()
        none.t.close()


def one_sided(kind: str) -> bool:
    """nixl over UCX on one host writes with CMA, without the target's help: a frozen
    (SIGSTOP) target may still receive the bytes and the WRITE may complete."""
    return kind == "nixl"


def test_connection_path(kind: str, local: Local, peer) -> None:
    """On one host the tcp backend uses its Unix socket unless told not to."""
    if kind.startswith("tcp"):
        assert local.t.path_to(peer) == ("unix" if kind == "tcp" else "tcp")


def _write_blocks(local: Local, peer, n: int = 256) -> list:
    return [
        local.t.write(
            peer, *blocks(local.region, list(range(i * n, (i + 1) * n)), list(range(n))), b"x"
        )
        for i in range(2)
    ]


def test_peer_killed_mid_transfer_errors_without_hang(
    kind: str, local: Local, target: PeerProcess, peer
) -> None:
    victim = spawn(kind, "victim", token=TOKEN)
    try:
        vp = local.t.add_peer(victim.metadata)
        victim.stop_signal()  # frozen: what we post now cannot complete
        inflight = _write_blocks(local, vp)
        victim.kill()
        states = [local.t.wait(h, WAIT_S) for h in inflight]
        assert PENDING not in states
        if not one_sided(kind):
            assert states == [ERROR, ERROR]  # a frozen target acknowledges nothing
        failed = [h for h, st in zip(inflight, states, strict=True) if st is ERROR]
        assert all("peer victim" in local.t.error(h) for h in failed)
        after = local.t.write(vp, [(local.region, 0, BLOCK)], [(0, 0, BLOCK)])
        assert local.t.wait(after, WAIT_S) is ERROR
    finally:
        victim.kill()
    # the other peer is unaffected
    loc, rem = blocks(local.region, [5], [6])
    h = local.t.write(peer, loc, rem)
    assert local.t.wait(h, WAIT_S) is DONE, local.t.error(h)
    assert np.array_equal(
        target.region_bytes()[6 * BLOCK : 7 * BLOCK], local.buf[5 * BLOCK : 6 * BLOCK]
    )


def test_hung_peer_times_out(kind: str) -> None:
    me = Local(kind, timeout_s=1.0, name="impatient")
    hung = spawn(kind, "hung", token=TOKEN)
    try:
        hp = me.t.add_peer(hung.metadata)
        hung.stop_signal()
        h = me.t.write(hp, *blocks(me.region, list(range(512)), list(range(512))), b"never")
        st = me.t.wait(h, WAIT_S)
        assert st is not PENDING  # bounded by timeout_s, not by the peer
        if not one_sided(kind):
            assert st is ERROR and "1 s" in me.t.error(h)
    finally:
        hung.kill()
        me.t.close()


def test_restarted_peer_recognised_as_new(kind: str, local: Local) -> None:
    first = spawn(kind, "restarty", token=TOKEN)
    second = None
    try:
        p1 = local.t.add_peer(first.metadata)
        h = local.t.write(p1, *blocks(local.region, [1], [1]))
        assert local.t.wait(h, WAIT_S) is DONE
        first.stop_signal()
        stuck = local.t.write(p1, *blocks(local.region, list(range(512)), list(range(512))), b"old")
        second = spawn(kind, "restarty", token=TOKEN)
        p2 = local.t.add_peer(second.metadata)
        assert (p2.engine_id, p2 == p1) == (p1.engine_id, False)
        st = local.t.wait(stuck, WAIT_S)
        assert st is not PENDING
        if not one_sided(kind):
            assert st is ERROR and "restarted" in local.t.error(stuck)
        with pytest.raises(PeerError, match="replaced"):
            local.t.write(p1, *blocks(local.region, [1], [1]))
        with pytest.raises(StalePeerError):
            local.t.add_peer(first.metadata)  # the old incarnation's metadata is refused
        loc, rem = blocks(local.region, [2, 3], [9, 8])
        h = local.t.write(p2, loc, rem)
        assert local.t.wait(h, WAIT_S) is DONE, local.t.error(h)
        got = second.region_bytes()
        assert np.array_equal(got[8 * BLOCK : 9 * BLOCK], local.buf[3 * BLOCK : 4 * BLOCK])
        assert [p for p in local.t.peers() if p.engine_id == "restarty"] == [p2]
    finally:
        first.kill()
        if second is not None:
            second.kill()


def test_stale_metadata_at_reused_address_refused(kind: str, local: Local) -> None:
    """A restarted peer on the same host:port: its old metadata does not reach the new process."""
    port = free_port()
    first = spawn(kind, "same-port", token=TOKEN, port=port)
    first.kill()
    second = spawn(kind, "same-port", token=TOKEN, port=port)
    try:
        with pytest.raises(StalePeerError, match="restarted"):
            local.t.add_peer(first.metadata)
        assert local.t.add_peer(second.metadata).engine_id == "same-port"
    finally:
        second.kill()
