"""pdserve.vllm's transfer agent without vLLM: two agents over real transports, fake caches.

The agent only needs per-layer tensors shaped like vLLM's CPU cache
([num_blocks, kv_heads, block_size, 2 * head_dim]); these tests drive it the way the
connector does (recv/send specs, finished ids) and read what it reports.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import msgspec
import pytest
import torch

from pdserve.ports import free_port
from pdserve.transfer import messages as m
from pdserve.transfer.transport import BackendUnavailableError
from pdserve.transfer.transport.nixl_peer import load_nixl
from pdserve.vllm.agent import Results, TransferAgent
from pdserve.vllm.config import VllmConnectorConfig
from pdserve.vllm.layout import KVLayout
from pdserve.vllm.specs import RecvSpec, ReleaseSpec, SendSpec

NUM_BLOCKS, LAYERS = 16, 2


def _nixl_available() -> bool:
    try:
        load_nixl()
    except BackendUnavailableError:
        return False
    return True


TRANSPORTS = [
    "tcp",
    pytest.param(
        "nixl",
        marks=[
            pytest.mark.nixl,
            pytest.mark.skipif(not _nixl_available(), reason="nixl not installed"),
        ],
    ),
]


def caches(fill: float | None) -> dict[str, torch.Tensor]:
    out = {}
    for i in range(LAYERS):
        t = torch.zeros(NUM_BLOCKS, 2, 4, 16)
        if fill is None:
            t.copy_(torch.randn_like(t))
        out[f"model.layers.{i}.attn"] = t
    return out


def make_agent(name: str, kv: dict[str, torch.Tensor], **cfg: object) -> TransferAgent:
    conf = VllmConnectorConfig.from_extra({"side_port": free_port(), **cfg})
    layout = KVLayout.from_caches(kv)
    compat = m.Compat(
        model="x",
        dtype="f32",
        num_layers=LAYERS,
        num_kv_heads=2,
        head_dim=16,
        block_size=4,
        layout=layout.signature(),
    )
    return TransferAgent(conf, name, layout, compat)


def wait_results(agent: TransferAgent, want: str, rid: str, timeout_s: float = 20) -> Results:
    got = Results()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        r = agent.take_results()
        got.finished_sending |= r.finished_sending
        got.finished_recving |= r.finished_recving
        got.failed_recving |= r.failed_recving
        if rid in getattr(got, want):
            return got
        time.sleep(0.05)
    raise AssertionError(f"{rid} not in {want} after {timeout_s} s: {got}")


@pytest.fixture(params=TRANSPORTS)
def pair(
    request: pytest.FixtureRequest,
) -> Iterator[tuple[TransferAgent, TransferAgent, dict, dict]]:
    p_kv, d_kv = caches(None), caches(0.0)
    conf = {"heartbeat_s": 0.2, "heartbeat_misses": 5, "transport": request.param}
    p = make_agent("P", p_kv, **conf)
    d = make_agent("D", d_kv, **conf)
    yield p, d, p_kv, d_kv
    p.close()
    d.close()


def recv_spec(p: TransferAgent, mode: str, dst: list[int], src: list[int], first: int = 0):
    return RecvSpec(
        request_id="d-req",
        mode=mode,
        remote_engine_id=p.me.engine_id,
        remote_incarnation=p.me.incarnation,
        remote_request_id="p-req",
        remote_address=p.side.address,
        block_ids=dst,
        remote_block_ids=src,
        first_block=first,
        num_tokens=len(src) * 4,
    )


@pytest.mark.parametrize("mode", ["push", "pull"])
@pytest.mark.parametrize("p_first", [True, False])
def test_blocks_arrive_and_both_sides_give_them_back(pair, mode: str, p_first: bool) -> None:
    p, d, p_kv, d_kv = pair
    src, dst = [3, 4, 9, 10], [0, 1, 7, 12]
    send = SendSpec(request_id="p-req", block_ids=src, num_tokens=15)
    if p_first:
        p.send(send)
        time.sleep(0.2)
    d.recv(recv_spec(p, mode, dst[1:], src, first=1))
    if not p_first:
        time.sleep(0.5)
        p.send(send)
    got = wait_results(d, "finished_recving", "d-req")
    assert got.failed_recving == set()
    wait_results(p, "finished_sending", "p-req")
    for name in p_kv:
        for s, t in zip(src[1:], dst[1:], strict=True):
            assert torch.equal(d_kv[name][t], p_kv[name][s])
        assert not d_kv[name][dst[0]].any()  # block 0 was D's own prefix: untouched


def test_release_frees_prefill_blocks_d_will_not_load(pair) -> None:
    p, d, _, _ = pair
    p.send(SendSpec(request_id="p-req", block_ids=[2], num_tokens=1))
    d.release(ReleaseSpec(remote_request_id="p-req", remote_address=p.side.address))
    wait_results(p, "finished_sending", "p-req", timeout_s=5)


def test_lost_prefill_fails_the_receive(pair) -> None:
    p, d, _, _ = pair
    d.recv(recv_spec(p, "push", [1], [2]))  # P never finishes this request
    time.sleep(0.5)
    p.close()  # P gone: D's heartbeat declares it dead
    got = wait_results(d, "finished_recving", "d-req")
    assert got.failed_recving == {"d-req"}


def test_lease_frees_blocks_nobody_came_for() -> None:
    p = make_agent("P", caches(None), lease_s=0.5)
    try:
        p.send(SendSpec(request_id="p-req", block_ids=[1, 2], num_tokens=8))
        wait_results(p, "finished_sending", "p-req", timeout_s=5)
    finally:
        p.close()


def test_unknown_request_fails_after_grace(pair) -> None:
    p, d, _, _ = pair
    p.close()
    p2 = make_agent("P", caches(None), registration_grace_s=0.5)
    try:
        d.recv(recv_spec(p2, "push", [1], [2]))
        got = wait_results(d, "finished_recving", "d-req")
        assert got.failed_recving == {"d-req"}
    finally:
        p2.close()


def test_abort_while_waiting_returns_blocks_after_p_acks(pair) -> None:
    p, d, _, _ = pair
    d.recv(recv_spec(p, "push", [1], [2]))
    time.sleep(0.5)  # registered at P, which has no finished request yet
    d.finished({"d-req"})
    got = wait_results(d, "finished_recving", "d-req")
    assert "d-req" in got.finished_recving
    p.send(SendSpec(request_id="p-req", block_ids=[2], num_tokens=4))
    wait_results(p, "finished_sending", "p-req", timeout_s=5)


@pytest.mark.parametrize("p_first", [True, False])
def test_push_without_p_incarnation_pairs_by_transfer_id(pair, p_first: bool) -> None:
    # Both legs at once: D's spec names P by engine id and address only, and the transfer
    # by the router's id, which P's request (a different id) carries.
    p, d, p_kv, d_kv = pair
    src, dst = [3, 4], [5, 6]
    send = SendSpec(request_id="p-req", block_ids=src, num_tokens=8, transfer_id="t1")
    spec = RecvSpec(
        request_id="d-req",
        mode="push",
        remote_engine_id=p.me.engine_id,
        remote_incarnation="",
        remote_request_id="t1",
        remote_address=p.side.address,
        block_ids=dst,
        remote_block_ids=[],
        first_block=0,
        num_tokens=8,
    )
    if p_first:
        p.send(send)
        time.sleep(0.2)
    d.recv(spec)
    if not p_first:
        time.sleep(0.5)  # the registration waits on P for its request
        p.send(send)
    got = wait_results(d, "finished_recving", "d-req")
    assert got.failed_recving == set()
    assert "p-req" in wait_results(p, "finished_sending", "p-req").finished_sending
    assert p.early_registrations == (0 if p_first else 1)
    for name in p_kv:
        for s, t in zip(src, dst, strict=True):
            assert torch.equal(d_kv[name][t], p_kv[name][s])
    # a second transfer reuses the incarnation the first handshake found
    d.recv(msgspec.structs.replace(spec, request_id="d-req2", remote_request_id="t2"))
    p.send(SendSpec(request_id="p-req2", block_ids=src, num_tokens=8, transfer_id="t2"))
    assert wait_results(d, "finished_recving", "d-req2").failed_recving == set()


def test_registration_for_a_prefill_that_never_ends_fails_the_receive() -> None:
    # Legs at once, and P's leg failed (P never hands the agent the request): D's receive
    # ends (failed) once P's registration grace is over, rather than waiting for ever.
    p_kv, d_kv = caches(None), caches(0.0)
    p = make_agent("P", p_kv, registration_grace_s=0.5)
    d = make_agent("D", d_kv)
    try:
        spec = RecvSpec(
            request_id="d-req",
            mode="push",
            remote_engine_id=p.me.engine_id,
            remote_incarnation="",
            remote_request_id="t-lost",
            remote_address=p.side.address,
            block_ids=[1],
            remote_block_ids=[],
            first_block=0,
            num_tokens=4,
        )
        d.recv(spec)
        got = wait_results(d, "finished_recving", "d-req", timeout_s=10)
        assert got.failed_recving == {"d-req"}
        assert p.early_registrations == 1
    finally:
        p.close()
        d.close()


def test_restarted_prefill_is_found_again_without_an_incarnation() -> None:
    # Specs naming no incarnation reuse the one D's last handshake found at that address;
    # once P restarted there, the first receive fails (P does not know D's connection)
    # and the next one handshakes again with the new incarnation.
    p_kv, d_kv = caches(None), caches(0.0)
    port = free_port()
    p = make_agent("P", p_kv, side_port=port)
    d = make_agent("D", d_kv)
    p2 = None
    try:

        def spec(rid: str) -> RecvSpec:
            return RecvSpec(
                request_id=rid,
                mode="push",
                remote_engine_id="P",
                remote_incarnation="",
                remote_request_id=f"t-{rid}",
                remote_address=p.side.address,
                block_ids=[1],
                remote_block_ids=[],
                first_block=0,
                num_tokens=4,
            )

        def transfer(agent: TransferAgent, rid: str) -> Results:
            d.recv(spec(rid))
            agent.send(
                SendSpec(request_id=rid, block_ids=[2], num_tokens=4, transfer_id=f"t-{rid}")
            )
            return wait_results(d, "finished_recving", rid)

        assert transfer(p, "r1").failed_recving == set()
        p.close()
        p2 = make_agent("P", p_kv, side_port=port)  # same engine id and address, new incarnation
        assert p2.me.incarnation != p.me.incarnation
        assert transfer(p2, "r2").failed_recving == {"r2"}
        assert transfer(p2, "r3").failed_recving == set()
    finally:
        for agent in (p2, d):
            if agent is not None:
                agent.close()


def test_registration_that_overtakes_d_s_transport_connection_waits_for_it(pair) -> None:
    # The side channel and the KV transport are two sockets dialed at one handshake: D's
    # registration can reach P before D's transport connection does (seen in CI). P waits
    # for the connection (up to handshake_timeout_s) instead of answering unknown_peer.
    p, d, p_kv, d_kv = pair
    real_peers = p.transport.peers
    hidden = {"on": True}
    p.transport.peers = lambda: set() if hidden["on"] else real_peers()  # type: ignore[method-assign]
    src, dst = [3, 4], [5, 6]
    p.send(SendSpec(request_id="p-req", block_ids=src, num_tokens=8))
    d.recv(recv_spec(p, "push", dst, src))
    time.sleep(0.5)  # the registration has arrived and waits: nothing failed meanwhile
    assert d.take_results().failed_recving == set()
    hidden["on"] = False
    got = wait_results(d, "finished_recving", "d-req")
    assert got.failed_recving == set()
    for name in p_kv:
        for s, t in zip(src, dst, strict=True):
            assert torch.equal(d_kv[name][t], p_kv[name][s])
