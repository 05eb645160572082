"""No unbounded work for unknown transfers (in one process, tests/pd_harness.py).

- P answers a push registration for a transfer it never heard of with
  PushFailed(unknown_transfer) after `unknown_transfer_grace_s`, not `registration_ttl_s`;
  a registration that comes before its prompt (the router sends both legs at once) still
  succeeds, also when P queues the prompt for longer than the grace.
- D refuses legs over `max_waiting_per_peer` (cause `overloaded`) and keeps the blocks
  reserved for remote KV under `max_waiting_kv_fraction` (a leg over it waits; a local
  request behind it runs).
- P refuses new P legs while blocks held for unclaimed transfers pass
  `max_unclaimed_hold_fraction`; the router's release makes room again.
- Dialing: D gives up on addresses nobody answers at, fails their requests, and keeps no
  socket, lane thread or connect attempt to them afterwards.
Every scenario ends with both pools whole (`check_integrity`).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

import pytest

from pdserve.config import ModelConfig
from pdserve.engine.types import EngineRequest, FinishReason, SamplingParams
from pdserve.faults import Faults
from pdserve.model.loader import load_model
from pdserve.ports import free_ports
from pdserve.transfer import messages as m
from pdserve.transfer.errors import TransferCause, parse_transfer_error
from pdserve.transfer.params import KVTransferParams
from pdserve.transfer.side_channel import SideChannel
from tests.pd_harness import Pair, _fields, greedy_tokens, make_engine

# Slow (P and D engines over real sockets (tests/pd_harness.py), waiting out grace periods): `make
# test` runs it, the unit tier (`make test-fast`) does not.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
IDS = list(range(3, 120))  # 117 tokens: 8 blocks of 16


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    return load_model(ModelConfig(cache_dir=tmp_path_factory.mktemp("models")))


@pytest.fixture(scope="module")
def reference(loaded):
    return greedy_tokens(make_engine(loaded, "both", "pull"), IDS, GREEDY)


@pytest.fixture
def pair_factory(loaded):
    made: list[Pair] = []

    def make(mode: str, p_kw=None, d_kw=None, num_blocks: int = 256) -> Pair:
        pair = Pair(
            make_engine(loaded, "prefill", mode, num_blocks=num_blocks, **(p_kw or {})),
            make_engine(loaded, "decode", mode, num_blocks=num_blocks, **(d_kw or {})),
            mode,
        )
        made.append(pair)
        return pair

    yield make
    for pair in made:
        pair.close()


def cause_of(error: str | None) -> TransferCause | None:
    parsed = parse_transfer_error(error)
    return parsed[0] if parsed else None


# -- 1. unknown transfers --------------------------------------------------------------------
def test_registration_for_an_unknown_transfer_fails_within_the_grace(pair_factory) -> None:
    """A forged leg (P's real address, a transfer id P never heard of) ends after the grace,
    not after `registration_ttl_s` (300 s here) or D's watchdog (60 s)."""
    pair = pair_factory(
        "push",
        p_kw={"unknown_transfer_grace_s": 0.5, "registration_ttl_s": 300.0},
        d_kw={"recv_timeout_s": 60.0},
    )
    t0 = time.monotonic()
    pair.submit_d("r", IDS, GREEDY, pair.push_params("t-forged"))
    pair.run_until(lambda: pair.finished("r"), timeout=10.0)
    took = time.monotonic() - t0
    out = pair.finished("r")
    assert out.finish_reason is FinishReason.ERROR
    assert cause_of(out.error) is TransferCause.UNKNOWN_TRANSFER, out.error
    assert 0.5 <= took < 5.0, took
    assert pair.p.connector.writer_stats.failures_by_cause == {"unknown_transfer": 1}
    assert pair.d.connector.stats.recv_timeouts == 0
    pair.settle()


def test_registration_before_its_prompt_still_succeeds(pair_factory, reference) -> None:
    """D's registration reaches P before P's leg (within the grace): the transfer works."""
    pair = pair_factory("push", p_kw={"unknown_transfer_grace_s": 2.0})
    pair.submit_d("r", IDS, GREEDY, pair.push_params("t-early"))
    pair.run_until(lambda: "t-early" in pair.p.connector._registered, only=pair.d)
    time.sleep(0.5)  # P's HTTP gate is slow to hand over the P leg
    pair.submit_p("r-p", IDS, "t-early")
    pair.run_until(lambda: pair.finished("r"))
    assert pair.finished("r").finish_reason is FinishReason.LENGTH, pair.finished("r").error
    assert pair.tokens("r") == reference
    assert not pair.p.connector.writer_stats.failures_by_cause
    pair.settle()


def test_a_prompt_queued_longer_than_the_grace_is_not_unknown(pair_factory, reference) -> None:
    """P admitted the P leg (it is announced) but computes it only after the grace: a busy P
    under load. The registration waits for it; nothing is failed."""
    pair = pair_factory("push", p_kw={"unknown_transfer_grace_s": 0.3})
    pair.submit_p("r-p", IDS, "t-queued")  # queued on P, not stepped yet
    pair.submit_d("r", IDS, GREEDY, pair.push_params("t-queued"))
    pair.run_until(lambda: "t-queued" in pair.p.connector._registered, only=pair.d)
    time.sleep(1.0)  # three graces with P's prompt still queued
    pair.run_until(lambda: pair.finished("r"))
    assert pair.finished("r").finish_reason is FinishReason.LENGTH, pair.finished("r").error
    assert pair.tokens("r") == reference
    assert pair.p.connector.stats.registrations_expired == 0
    pair.settle()


# -- 2. caps -------------------------------------------------------------------------------------
def test_decode_refuses_legs_over_the_per_peer_cap(pair_factory) -> None:
    pair = pair_factory(
        "push",
        p_kw={"unknown_transfer_grace_s": 60.0},
        d_kw={"max_waiting_per_peer": 2, "recv_timeout_s": 60.0},
    )
    for i in range(2):
        pair.submit_d(f"r{i}", IDS, GREEDY, pair.push_params(f"t{i}"))
    pair.submit_d("r2", IDS, GREEDY, pair.push_params("t2"))  # the third for this P
    out = pair.finished("r2")
    assert out is not None and out.finish_reason is FinishReason.ERROR
    assert cause_of(out.error) is TransferCause.OVERLOADED, out.error
    assert "--kv-max-waiting-per-peer" in out.error
    assert "r2" not in pair.d.requests and pair.d.connector.stats.legs_refused == 1
    other = KVTransferParams(**{**_fields(pair.push_params("t-other")), "remote_port": 1})
    pair.submit_d("r-other", IDS, GREEDY, other)  # another prefill instance: its own count
    assert pair.finished("r-other") is None and "r-other" in pair.d.requests
    for rid in ("r0", "r1", "r-other"):
        pair.d.abort_request(rid)
    pair.settle()


def test_decode_caps_blocks_reserved_for_remote_kv(pair_factory, reference) -> None:
    """Cap 25 of 256 blocks: three 8-block legs reserve 24, the fourth waits in the queue
    while a local request queued behind it runs; all four complete once their KV comes."""
    pair = pair_factory("push", d_kw={"max_waiting_kv_fraction": 0.1, "recv_timeout_s": 60.0})
    for i in range(4):
        pair.submit_d(f"r{i}", IDS, GREEDY, pair.push_params(f"t{i}"))
    local = EngineRequest(request_id="local", prompt_token_ids=IDS, params=GREEDY)
    assert pair.d.add_request(local) == []
    pair.run_until(lambda: pair.finished("local"), only=pair.d)
    assert pair.finished("local").finish_reason is FinishReason.LENGTH
    assert pair.d.stats().num_waiting_for_kv == 3
    reserved = sum(len(r.block_ids) for r in pair.d.scheduler.waiting_for_kv.values())
    assert reserved == 24 and [r.request_id for r in pair.d.scheduler.waiting] == ["r3"]
    for i in range(4):
        pair.submit_p(f"r{i}-p", IDS, f"t{i}")
    pair.run_until(lambda: all(pair.finished(f"r{i}") for i in range(4)))
    for i in range(4):
        assert pair.tokens(f"r{i}") == reference, pair.finished(f"r{i}").error
    pair.settle()


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_prefill_refuses_legs_over_the_unclaimed_hold_cap(pair_factory, mode) -> None:
    """Cap 16 of 64 blocks: two finished 8-block prompts nobody claimed fill it; the third
    P leg is refused until the router releases one."""
    long = {"lease_s": 300.0, "registration_ttl_s": 300.0, "max_unclaimed_hold_fraction": 0.25}
    pair = pair_factory(mode, p_kw=long, num_blocks=64)
    for i in range(2):
        pair.submit_p(f"p{i}", IDS, f"t{i}")
        pair.run_until(lambda i=i: pair.finished(f"p{i}"), only=pair.p)
        assert pair.finished(f"p{i}").finish_reason is FinishReason.LENGTH
    assert pair.p.connector.unclaimed_blocks() == 16
    pair.submit_p("p2", IDS, "t2")
    out = pair.p.add_request(
        EngineRequest(
            request_id="p3",
            prompt_token_ids=IDS,
            params=SamplingParams(max_tokens=1),
            kv_transfer=KVTransferParams(do_remote_decode=True, transfer_mode=mode),
        )
    )
    assert len(out) == 1 and cause_of(out[0].error) is TransferCause.OVERLOADED, out
    assert "--kv-max-unclaimed-fraction" in out[0].error
    assert "p2" not in pair.p.requests  # refused too (submit_p drops the output)
    pair.p.release_transfer("t0")
    pair.run_until(lambda: pair.p.connector.unclaimed_blocks() == 8, timeout=5.0, only=pair.p)
    pair.submit_p("p4", IDS, "t4")
    pair.run_until(lambda: pair.finished("p4"), only=pair.p)
    assert pair.finished("p4").finish_reason is FinishReason.LENGTH
    for tid in ("t1", "t4"):
        pair.p.release_transfer(tid)
    pair.settle()
    assert pair.p.connector.stats.lease_expired == 0


def test_push_registered_holds_do_not_count_as_unclaimed(pair_factory) -> None:
    """A prompt D registered for is claimed the moment the writer pairs it."""
    long = {"lease_s": 300.0, "max_unclaimed_hold_fraction": 0.25}
    pair = pair_factory("push", p_kw={**long, "faults": Faults(finish_delay_s=1.0)}, num_blocks=64)
    pair.submit_d("r", IDS, GREEDY, pair.push_params("t-reg"))
    pair.run_until(lambda: "t-reg" in pair.p.connector._registered, only=pair.d)
    pair.submit_p("r-p", IDS, "t-reg")
    pair.run_until(lambda: pair.finished("r-p"), only=pair.p)
    # Held (the hand-off to the writer is delayed) and unclaimed until the writer pairs it.
    assert pair.p.connector.unclaimed_blocks() == 8
    pair.run_until(lambda: pair.finished("r"), timeout=10.0)
    assert pair.finished("r").finish_reason is FinishReason.LENGTH
    assert pair.p.connector.unclaimed_blocks() == 0
    pair.settle()


# -- 3. dialing ----------------------------------------------------------------------------------
class CountingListener:
    """Accepts TCP connections and closes them at once, counting them (a peer that never
    answers a handshake: ZMQ reconnects to it after every close)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.1)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2.0)
        self.sock.close()


def forged(tid: str, port: int) -> KVTransferParams:
    return KVTransferParams(
        do_remote_prefill=True,
        transfer_mode="push",
        transfer_id=tid,
        remote_engine_id="prefill-forged",
        remote_host="127.0.0.1",
        remote_port=port,
    )


def num_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
def test_decode_gives_up_on_unreachable_addresses_and_keeps_nothing(pair_factory, caplog) -> None:
    d_kw = {"handshake_timeout_s": 1.4, "recv_timeout_s": 60.0, "max_waiting_kv_fraction": 1.0}
    pair = pair_factory("push", d_kw=d_kw)
    d = pair.d
    listener = CountingListener()
    try:
        pair.run_until(lambda: True, only=d)
        base_fds, base_threads = num_fds(), threading.active_count()
        ports = [*free_ports(19), listener.port]
        with caplog.at_level(logging.WARNING, logger="pdserve.transfer"):
            for i, port in enumerate(ports):
                d.add_request(
                    EngineRequest(
                        request_id=f"f{i}",
                        prompt_token_ids=IDS,
                        params=GREEDY,
                        kv_transfer=forged(f"t-f{i}", port),
                    )
                )
            # D does dial them: each registration lane handshakes.
            pair.run_until(lambda: d.connector.side.num_sockets() >= 10, timeout=5.0, only=d)
            pair.run_until(lambda: not d.requests, timeout=15.0, only=d)
        for i in range(len(ports)):
            out = pair.finished(f"f{i}")
            assert cause_of(out.error) is TransferCause.PEER_UNREACHABLE, out.error
        assert listener.accepted >= 1  # it was dialed too
        assert d.connector.stats.peers_given_up == len(ports)
        # Give the lanes and the heartbeat a moment to notice, then nothing may remain.
        pair.run_until(lambda: threading.active_count() <= base_threads, timeout=5.0, only=d)
        accepted = listener.accepted
        for _ in range(6):  # 3 s: no socket, no connect attempt, no fd or thread growth
            time.sleep(0.5)
            d.poll_connector()
            assert d.connector.side.num_sockets() == 0
            assert num_fds() <= base_fds, (num_fds(), base_fds)
            assert threading.active_count() <= base_threads
        assert listener.accepted == accepted  # no reconnects to a peer given up on
        # A new leg naming a given-up address fails at once, without dialing it.
        t0 = time.monotonic()
        pair.submit_d("again", IDS, GREEDY, forged("t-again", ports[0]))
        pair.run_until(lambda: pair.finished("again"), timeout=5.0, only=d)
        assert time.monotonic() - t0 < 1.0
        assert "gave up on" in pair.finished("again").error
        assert d.connector.side.num_sockets() == 0
        # Twenty peers given up on (40 failures: registration and peer), but the warnings
        # are throttled per cause: one line, the rest counted.
        lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert 1 <= len(lines) <= 2, lines
        d.check_integrity()
        assert d.pool.num_used == 0
    finally:
        listener.close()


def test_side_channel_closes_idle_and_least_recently_used_sockets() -> None:
    side = SideChannel(lambda msg: None, idle_s=0.5, max_sockets=2)
    try:
        ports = free_ports(3)
        ping = m.Ping(reply_to=side.address)
        for port in ports:
            side.send(("127.0.0.1", port), ping)
        assert side.num_sockets() == 2 and side.num_closed == 1  # the first was evicted
        side.forget(("127.0.0.1", ports[1]))
        assert side.num_sockets() == 1
        deadline = time.monotonic() + 5.0
        while side.num_sockets() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert side.num_sockets() == 0 and side.num_closed == 3  # idle for 0.5 s
        side.send(("127.0.0.1", ports[0]), ping)  # a later send opens a fresh one
        assert side.num_sockets() == 1
    finally:
        side.close()


def test_push_fail_causes_map_to_client_causes() -> None:
    assert m.PushFailCause.UNKNOWN_TRANSFER.client_cause() is TransferCause.UNKNOWN_TRANSFER
    assert m.PushFailCause.RELEASED.client_cause() is TransferCause.TRANSFER_FAILED
    notice = m.PushFailed(transfer_id="t", reason="x", cause=m.PushFailCause.UNKNOWN_TRANSFER)
    assert m.decode(m.encode(notice)) == notice
