"""Unit tests of the transport's pure parts: coalescing, bounds checks, auth, frames, peers."""

from __future__ import annotations

import subprocess
import sys

import msgspec
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdserve.config import TransportConfig
from pdserve.transfer.coalesce import coalesce, coalesce_pairs
from pdserve.transfer.transport import BackendUnavailableError, auth, create_transport
from pdserve.transfer.transport.base import (
    Desc,
    DescriptorError,
    PeerCard,
    PeerError,
    PeerId,
    RegionInfo,
    StalePeerError,
    as_desc_array,
)
from pdserve.transfer.transport.memory import RegionTable, check_descs, size_table, span_of
from pdserve.transfer.transport.nixl_peer import expand_granules, granule_rows
from pdserve.transfer.transport.peers import PeerTable
from pdserve.transfer.transport.registry import prepare
from pdserve.transfer.transport.wire import (
    Ack,
    ProtocolError,
    Write,
    decode_descs,
    encode_descs,
    encode_frame,
)

# -- coalescing ----------------------------------------------------------------------------


def _byte_pairs(loc: np.ndarray, rem: np.ndarray) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """Every byte a paired list moves, in order: ((local region, addr), (remote region, addr))."""
    out = []
    for (lr, lo, n), (rr, ro, _) in zip(loc.tolist(), rem.tolist(), strict=True):
        out += [((lr, lo + k), (rr, ro + k)) for k in range(n)]
    return out


pairs = st.lists(
    st.tuples(
        st.integers(0, 1),
        st.integers(0, 40),
        st.integers(0, 1),
        st.integers(0, 40),
        st.integers(1, 3),
    ),
    min_size=1,
    max_size=30,
)


@given(pairs)
def test_coalesce_pairs_moves_the_same_bytes(raw) -> None:
    loc = np.array([(lr, lo * 4, n * 4) for lr, lo, _, _, n in raw], dtype=np.int64)
    rem = np.array([(rr, ro * 4, n * 4) for _, _, rr, ro, n in raw], dtype=np.int64)
    cl, cr = coalesce_pairs(loc, rem)
    assert np.array_equal(cl[:, 2], cr[:, 2])
    assert len(cl) <= len(loc)
    assert _byte_pairs(cl, cr) == _byte_pairs(loc, rem)  # same bytes, same order


def test_coalesce_merges_only_runs_adjacent_on_both_sides() -> None:
    loc = np.array([(0, 0, 4), (0, 4, 4), (0, 8, 4), (0, 100, 4)])
    rem = np.array([(0, 40, 4), (0, 44, 4), (0, 0, 4), (0, 4, 4)])
    cl, cr = coalesce_pairs(loc, rem)
    assert cl.tolist() == [[0, 0, 8], [0, 8, 4], [0, 100, 4]]
    assert cr.tolist() == [[0, 40, 8], [0, 0, 4], [0, 4, 4]]


def test_coalesce_single_list_respects_regions() -> None:
    d = np.array([(0, 0, 4), (0, 4, 4), (1, 8, 4), (1, 12, 4), (1, 20, 1)])
    assert coalesce(d).tolist() == [[0, 0, 8], [1, 8, 8], [1, 20, 1]]


def test_coalesce_pairs_rejects_unequal_lengths() -> None:
    with pytest.raises(ValueError):
        coalesce_pairs(np.array([(0, 0, 4)]), np.array([(0, 0, 5)]))


# -- descriptors and bounds ----------------------------------------------------------------


def test_as_desc_array_accepts_structs_tuples_arrays() -> None:
    want = [[0, 8, 16]]
    assert as_desc_array([Desc(0, 8, 16)]).tolist() == want
    assert as_desc_array([(0, 8, 16)]).tolist() == want
    assert as_desc_array(np.array(want, dtype=np.int32)).dtype == np.int64
    with pytest.raises(DescriptorError):
        as_desc_array([])
    with pytest.raises(DescriptorError):
        as_desc_array([(1, 2)])


@pytest.mark.parametrize(
    ("desc", "message"),
    [
        ((0, 90, 20), "outside"),
        ((0, -1, 4), "outside"),
        ((0, 0, 0), "outside"),
        ((2, 0, 4), "unregistered"),
        ((-1, 0, 4), "unregistered"),
        ((1, 0, 4), "unregistered"),  # a hole in the id space
    ],
)
def test_check_descs_refuses(desc, message) -> None:
    sizes = size_table({0: 100, 2: 50}) if desc[0] != 2 else size_table({0: 100})
    with pytest.raises(DescriptorError, match=message):
        check_descs(np.array([desc], dtype=np.int64), sizes, "remote")


def test_check_descs_accepts_exact_fit() -> None:
    check_descs(np.array([(0, 0, 100), (0, 99, 1)]), size_table({0: 100}), "local")


def test_prepare_validates_both_sides_and_pairs() -> None:
    s = size_table({0: 64})
    loc, rem = prepare([(0, 0, 8), (0, 8, 8)], [(0, 16, 8), (0, 24, 8)], s, s)
    assert loc.tolist() == [[0, 0, 16]] and rem.tolist() == [[0, 16, 16]]
    with pytest.raises(DescriptorError, match="differ in length"):
        prepare([(0, 0, 8)], [(0, 0, 4)], s, s)
    with pytest.raises(DescriptorError, match="local"):
        prepare([(0, 60, 8)], [(0, 0, 8)], s, s)
    with pytest.raises(DescriptorError, match="1 local descriptors vs 2"):
        prepare([(0, 0, 8)], [(0, 0, 8), (0, 8, 8)], s, s)


def test_region_views_are_zero_copy() -> None:
    buf = np.zeros(64, dtype=np.uint8)
    table = RegionTable()
    r = table.add("a", span_of(buf), granule=16)
    (v,) = table.views(np.array([(r.id, 8, 4)]))
    v[:] = b"abcd"
    assert bytes(buf[8:12]) == b"abcd"
    with pytest.raises(DescriptorError, match="granule"):
        table.add("b", span_of(np.zeros(10, dtype=np.uint8)), granule=3)


def test_span_of_refuses_read_only_and_strided() -> None:
    with pytest.raises(DescriptorError):
        span_of(bytes(8))
    with pytest.raises(DescriptorError):
        span_of(np.zeros((4, 4), dtype=np.uint8)[:, 0])


def test_span_of_torch_tensor() -> None:
    torch = pytest.importorskip("torch")
    t = torch.zeros(4, 8, dtype=torch.bfloat16)
    span = span_of(t)
    assert (span.ptr, span.size, span.mem) == (t.data_ptr(), 64, "DRAM")


def test_granule_helpers() -> None:
    rows = granule_rows(1000, 64, 0, 16)
    assert rows[:, 0].tolist() == [1000, 1016, 1032, 1048] and set(rows[:, 1].tolist()) == {16}
    idx = expand_granules(np.array([32, 0]), np.array([32, 16]), 16)
    assert idx.tolist() == [2, 3, 0] and idx.dtype == np.int32


# -- auth ----------------------------------------------------------------------------------


def _tr(nonce_c: bytes = b"c" * 32, nonce_s: bytes = b"s" * 32) -> bytes:
    return auth.transcript("tcp", ("a", "1"), ("b", "2"), nonce_c, nonce_s)


def test_proofs_check_out_only_with_the_same_token() -> None:
    proof = auth.prove("secret", auth.CLIENT, _tr())
    assert auth.verify("secret", auth.CLIENT, _tr(), proof)
    assert not auth.verify("other", auth.CLIENT, _tr(), proof)
    assert not auth.verify("secret", auth.SERVER, _tr(), proof)  # no reflection
    assert not auth.verify("secret", auth.CLIENT, _tr(nonce_s=b"x" * 32), proof)  # no replay
    assert b"secret" not in proof
    assert not auth.verify("secret", auth.CLIENT, _tr(), b"")


def test_tokenless_side_accepts_and_proves_nothing() -> None:
    assert auth.prove(None, auth.CLIENT, _tr()) == b""
    assert auth.verify(None, auth.CLIENT, _tr(), b"anything")


def test_resolve_token_prefers_flag_then_env(monkeypatch) -> None:
    monkeypatch.setenv(auth.TOKEN_ENV, "from-env")
    assert auth.resolve_token("flag") == "flag"
    assert auth.resolve_token(None) == "from-env"
    monkeypatch.delenv(auth.TOKEN_ENV)
    assert auth.resolve_token(None) is None


# -- frames ----------------------------------------------------------------------------------


def test_frame_roundtrip_and_descs() -> None:
    descs = np.array([(0, 4096, 8192), (3, 0, 1)], dtype=np.int64)
    frame = Write(7, encode_descs(descs), 8193, b"n")
    raw = encode_frame(frame)
    decoded = msgspec.msgpack.decode(raw[4:], type=Write | Ack)
    assert decoded == frame
    assert np.array_equal(decode_descs(decoded.descs), descs)
    with pytest.raises(ProtocolError):
        decode_descs(b"\x00" * 23)


# -- peers -----------------------------------------------------------------------------------


def _card(engine: str, inc: str, started: int) -> PeerCard:
    return PeerCard(
        kind="tcp",
        engine_id=engine,
        incarnation=inc,
        started_ns=started,
        host="h",
        port=1,
        regions=(RegionInfo(0, 8),),
    )


def test_peer_table_replaces_older_and_refuses_stale_incarnations() -> None:
    table: PeerTable[str] = PeerTable(PeerId("me", "0"))
    assert table.admit(_card("p", "old", 1), "link-old") == []
    assert table.admit(_card("p", "new", 2), "link-new") == ["link-old"]
    with pytest.raises(StalePeerError):
        table.admit(_card("p", "old", 1), "again")
    with pytest.raises(PeerError, match="replaced"):
        table.lookup(PeerId("p", "old"))
    assert table.lookup(PeerId("p", "new")).links == ["link-new"]
    with pytest.raises(PeerError, match="own engine id"):
        table.check(_card("me", "x", 5))


def test_create_transport_without_nixl_names_the_install_command(monkeypatch) -> None:
    for name in ("nixl", "nixl._api", "nixl_cu12", "nixl_cu13"):
        monkeypatch.setitem(sys.modules, name, None)  # makes `import name` fail
    with pytest.raises(BackendUnavailableError, match="pip install nixl-cu12"):
        create_transport(TransportConfig(kind="nixl"), "p0")


def test_tcp_path_never_imports_nixl() -> None:
    code = (
        "import sys; from pdserve.config import TransportConfig; "
        "from pdserve.transfer.transport import create_transport; "
        "t = create_transport(TransportConfig(kind='tcp'), 'x'); t.close(); "
        "assert not any(m.startswith('nixl') for m in sys.modules), 'nixl imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
