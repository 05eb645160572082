"""Untrusted peers on the side channel: with a cluster token, frames that cannot prove it
are dropped, and nothing they say changes what an instance does.

In process, with the P/D harness (two real engines, real connectors over tcp, stepped by
hand): forged PullDone (would free P's hold while D still needs it), forged
PushRegistration (would make P write a prompt's KV where an attacker says), forged
PushFailed (would fail a healthy request on D), forged Hello (would make P trust a new
peer), and a whole instance holding the wrong token. Each forgery is sent without a MAC,
with a MAC made with the wrong token, and as raw garbage; each must be counted as rejected
while the genuine transfer still gives the monolithic engine's tokens.

The transports' own handshakes (a peer without the token cannot connect) are covered by
tests/test_transport_tcp.py and tests/test_transport_conformance.py.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator

import msgspec
import pytest
import torch
import zmq

from pdserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, TransportConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.types import FinishReason, SamplingParams
from pdserve.model.loader import LoadedModel, load_model
from pdserve.transfer import messages as m
from pdserve.transfer.connector import ConnectorConfig
from pdserve.transfer.factory import build_factory
from pdserve.transfer.side_channel import Address, ReplayGuard, SideChannel, new_nonce
from tests.pd_harness import Pair, _fields, greedy_tokens

# Slow (P and D engines over real sockets (tests/pd_harness.py), waiting out rejected peers):
# `make test` runs it, the unit tier (`make test-fast`) does not.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

TOKEN = "cluster-secret"
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPT = list(range(5, 70))


def engine(loaded: LoadedModel, role: str, mode: str, token: str | None, **kw: float) -> LLMEngine:
    """An engine whose side channel and transport both use `token`."""
    cfg = EngineConfig(
        cache=CacheConfig(block_size=16, num_blocks=64),
        scheduler=SchedulerConfig(max_num_batched_tokens=1024, max_num_seqs=16),
    )
    ccfg = ConnectorConfig(
        role=role, mode=mode, engine_id=f"{role}-{uuid.uuid4().hex[:6]}", cluster_token=token, **kw
    )
    tcfg = TransportConfig(kind="tcp", cluster_token=token, timeout_s=5.0)
    return LLMEngine(loaded, cfg, build_factory(ccfg, tcfg))


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    torch.set_num_threads(1)
    return load_model(ModelConfig(cache_dir=tmp_path_factory.mktemp("models")))


@pytest.fixture(scope="module")
def reference(loaded: LoadedModel) -> list[int]:
    mono = LLMEngine(loaded, EngineConfig(cache=CacheConfig(block_size=16, num_blocks=64)))
    return greedy_tokens(mono, PROMPT, GREEDY)


@pytest.fixture
def make_pair(loaded: LoadedModel) -> Iterator[Callable[..., Pair]]:
    made: list[Pair] = []

    def make(mode: str, p_token: str | None = TOKEN, d_token: str | None = TOKEN, **kw) -> Pair:
        pair = Pair(
            engine(loaded, "prefill", mode, p_token, **kw),
            engine(loaded, "decode", mode, d_token, **kw),
            mode,
        )
        made.append(pair)
        return pair

    yield make
    for pair in made:
        pair.close()


class Forger:
    """Sends frames to an instance's side channel: unsigned, signed with a wrong token, and
    raw garbage. Owns its sockets; also listens, to see whether anyone answers."""

    def __init__(self) -> None:
        self.heard: list[m.Message] = []
        self.unsigned = SideChannel(self.heard.append, token=None)
        self.wrong = SideChannel(self.heard.append, token="not-the-cluster-token")
        self._ctx = zmq.Context()
        self._raw = self._ctx.socket(zmq.PUSH)
        self._raw.setsockopt(zmq.LINGER, 0)
        self._connected: set[Address] = set()

    @property
    def address(self) -> Address:
        return self.unsigned.address

    def send_all(self, to: Address, msg: m.Message) -> int:
        """Every forgery of `msg`; returns how many frames were sent."""
        self.unsigned.send(to, msg)
        self.wrong.send(to, msg)
        if to not in self._connected:
            self._raw.connect(f"tcp://{to[0]}:{to[1]}")
            self._connected.add(to)
        body = m.encode(msg)
        self._raw.send_multipart([b"", body])  # no MAC at all, body not even enveloped
        self._raw.send_multipart([b"x" * 32, b"garbage"])
        self._raw.send(b"one part only")
        return 5

    def close(self) -> None:
        self.unsigned.close()
        self.wrong.close()
        self._raw.close(0)
        self._ctx.term()


@pytest.fixture
def forger() -> Iterator[Forger]:
    f = Forger()
    yield f
    f.close()


def rejected(pair: Pair, eng: LLMEngine, at_least: int, timeout: float = 5.0) -> None:
    """Step the pair until `eng`'s side channel has rejected `at_least` frames."""
    assert eng.connector is not None
    side = eng.connector.side
    pair.run_until(lambda: side.num_rejected >= at_least, timeout)


def side_address(eng: LLMEngine) -> Address:
    assert eng.connector is not None
    return eng.connector.side.address


def test_forged_pull_done_does_not_release_the_hold(make_pair, forger, reference) -> None:
    pair = make_pair("pull")
    pair.submit_p("r-p", PROMPT)
    pair.run_until(lambda: pair.finished("r-p"))
    kv = pair.finished("r-p").kv_transfer_params
    held = pair.p.pool.num_used
    assert held > 0 and kv.transfer_id in pair.p.connector.holds

    # The forgery names the right blocks: only the missing proof of the token stops it.
    forged = m.PullDone(transfer_id=kv.transfer_id, ok=True, block_ids=kv.remote_block_ids)
    sent = forger.send_all(side_address(pair.p), forged)
    rejected(pair, pair.p, sent)
    assert pair.p.pool.num_used == held and kv.transfer_id in pair.p.connector.holds

    # D still reads the KV it was promised.
    params = type(kv)(**{**_fields(kv), "do_remote_prefill": True})
    pair.submit_d("r", PROMPT, GREEDY, params)
    pair.run_until(lambda: pair.finished("r"))
    assert pair.tokens("r") == reference
    pair.settle()
    assert forger.heard == []


def test_forged_push_registration_is_ignored(make_pair, forger, reference) -> None:
    pair = make_pair("push")
    tid = uuid.uuid4().hex
    pair.submit_p("r-p", PROMPT, tid)
    pair.run_until(lambda: pair.finished("r-p"))
    assert pair.p.pool.num_used > 0  # P waits for a registration with its finished prompt

    forged = m.PushRegistration(
        transfer_id=tid,
        engine_id="attacker",
        incarnation="1",
        reply_to=forger.address,
        block_ids=list(range(5)),
        num_tokens=len(PROMPT),
    )
    sent = forger.send_all(side_address(pair.p), forged)
    rejected(pair, pair.p, sent)
    time.sleep(0.1)  # the writer would have acted on it by now
    p = pair.p.connector
    assert p.stats.transfers == 0 and p.stats.failures == 0 and p.num_blocks_held() > 0
    assert forger.heard == []  # not even a failure notice went to the forger

    pair.submit_d("r", PROMPT, GREEDY, pair.push_params(tid))
    pair.run_until(lambda: pair.finished("r"))
    assert pair.tokens("r") == reference
    pair.settle()


def test_forged_push_failure_does_not_fail_a_healthy_request(make_pair, forger, reference) -> None:
    pair = make_pair("push")
    tid = uuid.uuid4().hex
    pair.submit_d("r", PROMPT, GREEDY, pair.push_params(tid))
    pair.run_until(lambda: pair.d.stats().num_waiting_for_kv == 1, only=pair.d)

    sent = forger.send_all(side_address(pair.d), m.PushFailed(transfer_id=tid, reason="forged"))
    rejected(pair, pair.d, sent, timeout=5.0)
    assert pair.finished("r") is None and pair.d.stats().num_waiting_for_kv == 1

    pair.submit_p("r-p", PROMPT, tid)
    pair.run_until(lambda: pair.finished("r"))
    assert pair.finished("r").finish_reason is FinishReason.LENGTH
    assert pair.tokens("r") == reference
    pair.settle()


def test_forged_hello_gets_no_answer_and_no_peer(make_pair, forger) -> None:
    pair = make_pair("pull")
    p = pair.p.connector
    hello = m.Hello(
        nonce=new_nonce(),
        engine_id="attacker",
        incarnation="1",
        reply_to=forger.address,
        compat=p.compat,
        num_blocks=64,
        transport_metadata=b"",
    )
    with pytest.raises(TimeoutError):
        forger.unsigned.request(side_address(pair.p), hello, timeout=0.5)
    sent = 1 + forger.send_all(side_address(pair.p), hello)
    rejected(pair, pair.p, sent)
    assert p.known_peer("attacker", "1") is None
    assert forger.heard == []


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_instance_with_the_wrong_token_cannot_take_part(make_pair, mode) -> None:
    """D holds another token: in pull, D refuses P's signature before contacting P; in
    push, P drops D's handshake, so the request fails with a clear error within the
    handshake timeout. Either way P's blocks come back (lease)."""
    pair = make_pair(
        mode, d_token="other-token", handshake_timeout_s=0.5, lease_s=1.0, registration_ttl_s=1.0
    )
    out = pair.generate("r", PROMPT, GREEDY)
    assert out.finish_reason is FinishReason.ERROR
    if mode == "pull":
        assert "[params_rejected]" in out.error and "signature" in out.error, out.error
        assert pair.d.connector.stats.transfers == 0
    else:
        assert "handshake" in out.error and "timed out" in out.error, out.error
        assert pair.p.connector.side.num_rejected >= 1
    d = pair.d.connector.cfg
    assert pair.p.connector.known_peer(d.engine_id, d.incarnation) is None
    pair.settle(timeout=10.0)


def test_frames_are_accepted_with_the_token(make_pair, forger) -> None:
    """The control: the same PullDone, signed with the cluster token, does release the hold
    (so the tests above would notice if forged frames got through)."""
    pair = make_pair("pull")
    pair.submit_p("r-p", PROMPT)
    pair.run_until(lambda: pair.finished("r-p"))
    kv = pair.finished("r-p").kv_transfer_params
    signed = SideChannel(lambda msg: None, token=TOKEN)
    try:
        done = m.PullDone(transfer_id=kv.transfer_id, ok=True, block_ids=kv.remote_block_ids)
        signed.send(side_address(pair.p), done)
        pair.settle(timeout=5.0)
    finally:
        signed.close()
    assert pair.p.connector.side.num_rejected == 0


def test_envelope_shape_is_what_the_forger_mimics() -> None:
    """Guard for the raw forgeries above: a genuine frame is [mac, msgpack(envelope)]."""
    got: list[list[bytes]] = []
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    sender = SideChannel(lambda msg: None, token=TOKEN)
    try:
        sender.send(("127.0.0.1", port), m.PullDone(transfer_id="t", ok=True))
        assert pull.poll(2000)
        got.append(pull.recv_multipart())
    finally:
        sender.close()
        pull.close(0)
        ctx.term()
    mac, frame = got[0]
    assert len(mac) == 32
    sent_at, nonce, body = msgspec.msgpack.decode(frame)
    assert isinstance(sent_at, float) and len(nonce) == 16
    assert isinstance(m.decode(body), m.PullDone)


def capture_frame(msg: m.Message, token: str | None = TOKEN) -> list[bytes]:
    """A genuine frame of `msg`, as a cluster member sends it, caught on the wire."""
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    sender = SideChannel(lambda msg: None, token=token)
    try:
        sender.send(("127.0.0.1", port), msg)
        assert pull.poll(2000)
        return pull.recv_multipart()
    finally:
        sender.close()
        pull.close(0)
        ctx.term()


def test_captured_frame_replayed_is_dropped() -> None:
    """A frame caught on the wire and sent again (within the age window, MAC intact) is
    applied once: the copy is counted as rejected and never reaches the handler."""
    heard: list[m.Message] = []
    receiver = SideChannel(heard.append, token=TOKEN)
    ctx = zmq.Context()
    raw = ctx.socket(zmq.PUSH)
    raw.setsockopt(zmq.LINGER, 0)
    try:
        frame = capture_frame(m.PushFailed(transfer_id="t-victim", reason="captured"))
        raw.connect(f"tcp://{receiver.address[0]}:{receiver.address[1]}")
        for _ in range(3):  # the original delivery, then two replays
            raw.send_multipart(frame)
        deadline = time.monotonic() + 5.0
        while receiver.num_rejected < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert receiver.num_rejected == 2
        assert [type(x) for x in heard] == [m.PushFailed]
        # A fresh frame with the same body (new nonce) is still accepted.
        raw.send_multipart(capture_frame(m.PushFailed(transfer_id="t-victim", reason="captured")))
        deadline = time.monotonic() + 5.0
        while len(heard) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(heard) == 2 and receiver.num_rejected == 2
    finally:
        raw.close(0)
        ctx.term()
        receiver.close()


def test_pull_claims_grant_a_hold_to_one_reader_only(make_pair) -> None:
    """P grants a hold to one claimant: another instance's claim and its PullDone are
    refused/ignored, and a claim sent again once the hold is gone is refused (by then the
    blocks may belong to other requests)."""
    pair = make_pair("pull")
    pair.submit_p("r-p", PROMPT)
    pair.run_until(lambda: pair.finished("r-p"))
    kv = pair.finished("r-p").kv_transfer_params
    held = pair.p.pool.num_used
    member = SideChannel(lambda msg: None, token=TOKEN)
    to = side_address(pair.p)

    def claim(engine_id: str, blocks: list[int]) -> m.PullClaimReply:
        msg = m.PullClaim(
            nonce=new_nonce(),
            transfer_id=kv.transfer_id,
            block_ids=blocks,
            engine_id=engine_id,
            incarnation="1",
            reply_to=member.address,
        )
        reply = member.request(to, msg, timeout=2.0)
        assert isinstance(reply, m.PullClaimReply)
        return reply

    def done(engine_id: str) -> m.PullDone:
        return m.PullDone(transfer_id=kv.transfer_id, ok=True, engine_id=engine_id, incarnation="1")

    try:
        other_blocks = [b + 1 for b in kv.remote_block_ids]
        assert "do not belong" in (claim("decode-x", other_blocks).error or "")
        assert claim("decode-x", kv.remote_block_ids).error is None
        assert "another instance" in (claim("decode-y", kv.remote_block_ids).error or "")
        member.send(to, done("decode-y"))  # not the claimant: ignored
        # A round trip behind it on the same socket: P's receiver thread handles frames in
        # order, so once this is answered the PullDone above has been handled too.
        assert "another instance" in (claim("decode-y", kv.remote_block_ids).error or "")
        pair.step(only=pair.p)
        assert pair.p.pool.num_used == held
        member.send(to, done("decode-x"))
        pair.settle(timeout=5.0)  # the claimant's PullDone freed the hold
        again = claim("decode-x", kv.remote_block_ids)
        assert again.error and again.lease_expired
    finally:
        member.close()


def test_replay_guard_stays_bounded_and_never_readmits() -> None:
    guard = ReplayGuard(max_age_s=120.0, capacity=3)
    now = 1000.0
    for i in range(5):
        assert guard.check(now + i, bytes([i]), now + i) is None
    assert len(guard._seen) == 3  # the two oldest were forgotten...
    assert "stale" in guard.check(now + 0, bytes([0]), now + 5)  # ...and cannot come back
    assert "stale" in guard.check(now + 1, b"new", now + 5)  # nor anything as old
    assert "replayed" in guard.check(now + 4, bytes([4]), now + 5)
    assert guard.check(now + 5, b"fresh", now + 5) is None
    assert "stale" in guard.check(now - 200, b"ancient", now + 5)
