"""Malformed `kv_transfer_params` on P/D instances: a 400, or a prompt clear error, never a
dead or wedged engine.

A prefill and a decode instance (real engines on builtin:tiny with real connectors over the
tcp transport) are served in process by their FastAPI apps; each test sends legs the way the
router would, then breaks one thing. What only the asynchronous transfer can discover (an
engine id nobody has at that address, an address nobody answers at) must end the request
with an error naming the cause within the configured bounds. After every test a normal P->D
request still gives the monolithic engine's tokens and both block pools drain to zero.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from procs import free_port

from pdserve.config import ModelConfig, ServerConfig
from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.engine import LLMEngine
from pdserve.model.loader import LoadedModel, load_model
from pdserve.server.app import create_app
from pdserve.sse import events_data
from pdserve.transfer import messages as m
from pdserve.transfer.cluster_auth import LEG_SIGNATURE_HEADER, sign_leg
from pdserve.transfer.side_channel import Address, SideChannel
from tests.pd_harness import make_engine

pytestmark = pytest.mark.timeout(300)

PROMPT = list(range(3, 40))  # 37 tokens: three blocks of 16
GREEDY = {"max_tokens": 4, "temperature": 0, "ignore_eos": True}
# Short bounds so that what can only fail late fails fast: D's handshake and watchdog, P's
# wait for a prompt registered for. P's lease is long, so that no read a test makes can come
# after it on a slow machine; the test that leaves holds unread has a P with a short one.
P_KW = {"lease_s": 300.0, "registration_ttl_s": 1.0}
SHORT_LEASE_S = 2.0
D_KW = {"handshake_timeout_s": 1.0, "recv_timeout_s": 4.0, "registration_ttl_s": 1.0}
# For a decode instance whose stuck request must stay stuck until the test ends it (see
# `SilentPrefill`): no bound of its own can end it first, however slow the machine.
PATIENT_D_KW = {"handshake_timeout_s": 300.0, "recv_timeout_s": 300.0, "heartbeat_misses": 10**6}


@dataclass
class Served:
    """One instance: its engine (read-only from tests) and a client for its app. With a
    cluster token, legs are signed as the router signs them (the tests play the router)."""

    llm: LLMEngine
    engine: AsyncEngine
    client: TestClient
    token: str | None = None

    def complete(self, ids: list[int], kv: dict[str, Any] | None, **extra: Any) -> Any:
        body: dict[str, Any] = {"prompt": ids, **GREEDY, **extra}
        headers = {"Content-Type": "application/json"}
        if kv is not None:
            body["kv_transfer_params"] = kv
            if self.token is not None:
                headers[LEG_SIGNATURE_HEADER] = sign_leg(self.token, kv)
        return self.client.post(
            "/v1/completions", content=json.dumps(body).encode(), headers=headers
        )

    def drained(self, timeout: float = 60.0) -> bool:
        """True once the pool is full again (holds, quarantines and requests all gone)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.engine.stats().kv_blocks_used == 0:
                return True
            time.sleep(0.02)
        return False


@dataclass
class PD:
    p: Served
    d: Served
    mode: str
    reference: list[int] = field(default_factory=list)
    template: dict[str, Any] | None = None  # see stale_params

    def prefill(self, ids: list[int] = PROMPT, tid: str | None = None) -> dict[str, Any]:
        """P's leg; returns P's kv_transfer_params (pull) or the push params for D."""
        tid = tid or uuid.uuid4().hex
        kv = {"do_remote_decode": True, "transfer_mode": self.mode, "transfer_id": tid}
        r = self.p.complete(ids, kv, max_tokens=1)
        assert r.status_code == 200, r.text
        return r.json()["kv_transfer_params"]

    def stale_params(self) -> dict[str, Any]:
        """Well-formed pull params for D, from a prefill whose hold is long gone (a transfer
        with them would read blocks P no longer holds): for tests where D must refuse them
        before any transfer. No hold is left behind to wait for."""
        if self.template is None:
            self.template = {**self.prefill(), "do_remote_prefill": True}
            r = self.d.complete(PROMPT, self.template)
            assert r.status_code == 200, r.text
        # Unsigned (no cluster token here): a lease end far away keeps D's own expiry
        # check out of the way, so what these tests meet is the check they are about.
        return {**self.template, "transfer_id": uuid.uuid4().hex, "expires_at": time.time() + 3600}

    def push_params(self, tid: str) -> dict[str, Any]:
        c = self.p.llm.connector
        assert c is not None
        host, port = c.side.address
        return {
            "do_remote_prefill": True,
            "transfer_mode": "push",
            "transfer_id": tid,
            "remote_engine_id": c.cfg.engine_id,
            "remote_host": host,
            "remote_port": port,
        }

    def decode_params(self, ids: list[int] = PROMPT) -> dict[str, Any]:
        """Valid D params for `ids` (the P leg already ran, for either mode)."""
        if self.mode == "pull":
            return {**self.prefill(ids), "do_remote_prefill": True}
        tid = uuid.uuid4().hex
        params = self.push_params(tid)
        threading.Thread(target=self.prefill, args=(ids, tid), daemon=True).start()
        return params

    def tokens(self) -> list[int]:
        r = self.d.complete(PROMPT, self.decode_params(), return_token_ids=True)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]

    def assert_healthy(self) -> None:
        """Both alive, a normal request gives the reference tokens, both pools drain."""
        for s in (self.p, self.d):
            assert s.client.get("/health").status_code == 200
        assert self.tokens() == self.reference
        assert self.p.drained() and self.d.drained(), (self.p.llm.stats(), self.d.llm.stats())


def serve(llm: LLMEngine, stack: list[Callable[[], None]]) -> Served:
    """`llm` behind its app, with its connector's cluster token (as `pdserve serve` does)."""
    engine = AsyncEngine(llm)
    engine.start()
    token = llm.connector.cfg.cluster_token if llm.connector is not None else None
    app = create_app(engine, ServerConfig(cluster_token=token))
    client = TestClient(app, raise_server_exceptions=False)
    client.__enter__()
    stack.append(engine.shutdown)
    stack.append(lambda: client.__exit__(None, None, None))
    return Served(llm, engine, client, token)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    torch.set_num_threads(1)  # threads fight over shared cores; one is much faster here
    return load_model(ModelConfig(cache_dir=tmp_path_factory.mktemp("models")))


@pytest.fixture(scope="module")
def reference(loaded: LoadedModel) -> list[int]:
    mono = make_engine(loaded, "both", "pull")
    stack: list[Callable[[], None]] = []
    served = serve(mono, stack)
    r = served.complete(PROMPT, None, return_token_ids=True)
    for close in reversed(stack):
        close()
    return r.json()["choices"][0]["token_ids"]


def make_pd(
    loaded: LoadedModel,
    mode: str,
    reference: list[int],
    p_kw: dict[str, Any] = P_KW,
    d_kw: dict[str, Any] = D_KW,
) -> Iterator[PD]:
    """A served P/D pair for a module's tests; on teardown both engines must still be
    alive and both pools pass their integrity check."""
    stack: list[Callable[[], None]] = []
    try:
        p = serve(make_engine(loaded, "prefill", mode, **p_kw), stack)
        d = serve(make_engine(loaded, "decode", mode, **d_kw), stack)
        pd = PD(p, d, mode, reference)
        yield pd
        for s in (p, d):
            assert s.engine.is_alive
    finally:
        for close in reversed(stack):
            close()
    for s in (p, d):
        s.llm.check_integrity()


@pytest.fixture(scope="module")
def pull(loaded: LoadedModel, reference: list[int]) -> Iterator[PD]:
    yield from make_pd(loaded, "pull", reference)


@pytest.fixture(scope="module")
def push(loaded: LoadedModel, reference: list[int]) -> Iterator[PD]:
    yield from make_pd(loaded, "push", reference)


def assert_400(r: Any, *words: str) -> str:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "kv_transfer_params", err
    for w in words:
        assert w in err["message"], err["message"]
    return err["message"]


def in_background(fn: Callable[[], Any]) -> Callable[[], Any]:
    """Run `fn` in a thread; the returned call waits for (and returns) its result."""
    box: list[Any] = []
    t = threading.Thread(target=lambda: box.append(fn()), daemon=True)
    t.start()

    def result(timeout: float = 30.0) -> Any:
        t.join(timeout)
        assert box, "the request did not return"
        return box[0]

    return result


def wait_until(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met"
        time.sleep(0.01)


class SilentPrefill:
    """A side channel where a prefill instance would be, that takes D's Hello and answers
    nothing, so D's handshake hangs for as long as D lets it, until `refuse()`: then every
    Hello (those waiting and any later one) is turned down and the requests on it end."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._hellos: list[m.Hello] = []
        self._refusing = False
        self._side = SideChannel(self._on_message)

    @property
    def address(self) -> Address:
        return self._side.address

    def _on_message(self, msg: m.Message) -> None:
        if isinstance(msg, m.Hello):
            with self._lock:
                self._hellos.append(msg)
                refusing = self._refusing
            if refusing:
                self._refuse(msg)

    def refuse(self) -> None:
        wait_until(lambda: bool(self._hellos), timeout=60.0)  # D's lane has asked
        with self._lock:
            self._refusing = True
            waiting = list(self._hellos)
        for hello in waiting:
            self._refuse(hello)

    def _refuse(self, hello: m.Hello) -> None:
        reply = m.HelloReply(
            nonce=hello.nonce,
            engine_id="silent",
            incarnation="0",
            compat=hello.compat,
            num_blocks=0,
            transport_metadata=b"",
            error="refused by the test",
        )
        self._side.send(tuple(hello.reply_to), reply)

    def close(self) -> None:
        self._side.close()


@contextlib.contextmanager
def patient_decode(loaded: LoadedModel, mode: str) -> Iterator[tuple[Served, SilentPrefill]]:
    """A fresh decode instance (PATIENT_D_KW) and a silent prefill address; on the way out
    the silent one refuses (ending whatever still waits on it), and D must have drained."""
    stack: list[Callable[[], None]] = []
    silent = SilentPrefill()
    stack.append(silent.close)
    try:
        d = serve(make_engine(loaded, "decode", mode, **PATIENT_D_KW), stack)
        yield d, silent
        assert d.drained(), d.llm.stats()
        d.llm.check_integrity()
    finally:
        for close in reversed(stack):
            close()


# -- decode legs --------------------------------------------------------------------------


def test_baseline_pull_and_push_equal_monolithic(pull: PD, push: PD) -> None:
    pull.assert_healthy()
    push.assert_healthy()


DECODE_FIELDS = ["remote_engine_id", "remote_host", "remote_port", "remote_block_ids"]
DECODE_FIELDS += ["remote_num_tokens", "first_token_id", "transfer_id", "transfer_mode"]


@pytest.mark.parametrize("missing", DECODE_FIELDS)
def test_missing_field_is_a_400(pull: PD, missing: str) -> None:
    params = pull.stale_params()
    del params[missing]
    assert_400(pull.d.complete(PROMPT, params), missing)
    pull.assert_healthy()


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("remote_port", "8000"),
        ("remote_port", 0),
        ("remote_port", 70000),
        ("remote_block_ids", "0,1,2"),
        ("remote_block_ids", [0, 1, -1]),
        ("remote_block_ids", [0, 0, 1]),
        ("remote_block_ids", [0, 1]),  # the prompt fills three blocks
        ("first_token_id", 1.5),
        ("first_token_id", 10**6),  # outside the vocabulary: once a sampler crash
        ("transfer_id", 7),
        ("transfer_id", "has space"),
        ("transfer_id", "x" * 300),
        ("remote_host", "a b"),  # once killed the pull reader thread
        ("remote_host", ""),
        ("remote_num_tokens", 36),
        ("remote_num_tokens", 0),
        ("transfer_mode", "push"),  # this decode instance pulls
        ("transfer_mode", "carrier-pigeon"),
        ("do_remote_decode", True),  # both legs at once
        ("prefill_done_time", "yesterday"),
        ("no_such_field", 1),
    ],
)
def test_wrong_field_is_a_400(pull: PD, name: str, value: Any) -> None:
    params = {**pull.stale_params(), name: value}
    assert_400(pull.d.complete(PROMPT, params), name)
    pull.assert_healthy()


def test_params_that_are_not_an_object_are_a_400(pull: PD) -> None:
    for value in ([1, 2], "pull", 3, True):
        assert_400(pull.d.complete(PROMPT, value))  # type: ignore[arg-type]
    pull.assert_healthy()


def test_prompt_other_than_the_prefilled_one_is_a_400(pull: PD) -> None:
    params = pull.stale_params()
    assert_400(pull.d.complete(PROMPT[:-1], params), "remote_num_tokens", "36")
    pull.assert_healthy()


def test_legs_on_the_wrong_role_are_a_400(pull: PD) -> None:
    params = pull.stale_params()
    assert_400(pull.p.complete(PROMPT, params), "decode instance", "prefill")
    p_leg = {"do_remote_decode": True, "transfer_mode": "pull", "transfer_id": "t-wrong-role"}
    assert_400(pull.d.complete(PROMPT, p_leg, max_tokens=1), "prefill instance", "decode")
    pull.assert_healthy()


def test_block_ids_out_of_range_are_a_400_once_p_is_known(pull: PD) -> None:
    pull.assert_healthy()  # D knows P (and its cache size) from a handshake
    nb = pull.p.llm.pool.num_blocks
    params = {**pull.stale_params(), "remote_block_ids": [nb, nb + 1, 10**9]}
    assert_400(pull.d.complete(PROMPT, params), "remote_block_ids", str(nb))
    pull.assert_healthy()


def test_block_ids_out_of_range_on_first_contact_move_nothing(
    loaded: LoadedModel, pull: PD
) -> None:
    """A decode instance that never met P cannot check the range before its handshake; P
    refuses the claim (those blocks are not the transfer's), so nothing is read. (Behind
    that, the transport would refuse the descriptor list: the last layer's slice of any
    block beyond P's cache lies outside P's region.)"""
    stack: list[Callable[[], None]] = []
    try:
        fresh = serve(make_engine(loaded, "decode", "pull", **D_KW), stack)
        nb = pull.p.llm.pool.num_blocks
        genuine = pull.decode_params()
        params = {**genuine, "remote_block_ids": [nb, nb + 1, nb + 2]}
        r = fresh.complete(PROMPT, params)
        assert r.status_code == 400 and "do not belong" in r.json()["error"]["message"], r.text
        assert r.json()["error"]["code"] == "kv_params_rejected"
        assert fresh.llm.connector is not None and fresh.llm.connector.stats.transfers == 0
        assert fresh.drained()
        # P's hold is intact: the genuine params read the prompt's KV (and free the hold).
        r = pull.d.complete(PROMPT, genuine, return_token_ids=True)
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == pull.reference
    finally:
        for close in reversed(stack):
            close()
    pull.assert_healthy()


def test_unknown_engine_id_is_a_prompt_clear_error(pull: PD) -> None:
    params = {**pull.decode_params(), "remote_engine_id": "prefill-nobody"}
    r = pull.d.complete(PROMPT, params)
    assert r.status_code >= 500 and "prefill-nobody" in r.json()["error"]["message"], r.text
    pull.assert_healthy()


def test_unreachable_address_fails_within_the_handshake_timeout(pull: PD) -> None:
    params = {**pull.stale_params(), "remote_port": free_port()}  # nobody listens there
    r = pull.d.complete(PROMPT, params)
    assert r.status_code == 502, r.text
    err = r.json()["error"]
    assert err["type"] == "kv_transfer_error" and err["code"] == "kv_peer_unreachable", err
    assert "handshake" in err["message"] and "timed out" in err["message"], err
    pull.assert_healthy()


def sse_events(r: Any) -> list[Any]:
    lines = events_data(r.content)
    assert lines[-1] == "[DONE]", r.text
    return [json.loads(x) for x in lines[:-1]]


def test_transfer_failure_in_a_stream_is_an_error_event(pull: PD) -> None:
    """Streamed, the status line is out before the KV fails: the cause comes as an SSE
    error event of the same type and code, then [DONE]."""
    params = {**pull.stale_params(), "remote_port": free_port()}
    r = pull.d.complete(PROMPT, params, stream=True)
    assert r.status_code == 200
    events = sse_events(r)
    err = events[-1]["error"]
    assert err["type"] == "kv_transfer_error" and err["code"] == "kv_peer_unreachable", err
    assert not any("choices" in e for e in events)
    pull.assert_healthy()


def test_read_of_a_hold_that_is_gone_is_a_lease_error(pull: PD) -> None:
    """Params whose hold P has released (here: used once already) are refused by P's
    claim, so D never reads blocks that may now belong to other requests."""
    params = pull.stale_params()
    before = pull.d.llm.connector.stats.transfers
    r = pull.d.complete(PROMPT, params)
    assert r.status_code == 502, r.text
    err = r.json()["error"]
    assert err["code"] == "kv_lease_expired" and "not held" in err["message"], err
    assert pull.d.llm.connector.stats.transfers == before
    pull.assert_healthy()


def test_push_prompt_that_never_comes_is_a_transfer_error(push: PD) -> None:
    r = push.d.complete(PROMPT, push.push_params(uuid.uuid4().hex))  # no P leg
    assert r.status_code == 502, r.text
    err = r.json()["error"]
    # P never heard of the transfer: it says so after its grace (P_KW: at most its 1 s TTL).
    assert err["type"] == "kv_transfer_error" and err["code"] == "kv_unknown_transfer", err
    assert "never finished" in err["message"], err
    push.assert_healthy()


def test_unreachable_address_does_not_delay_other_pulls(loaded: LoadedModel, pull: PD) -> None:
    """Each prefill instance has its own lane on D: a pull stuck in a handshake with an
    address that never answers does not hold up a pull from the live P. (The stuck
    handshake lasts until the test ends it, so the live pull cannot have waited behind it
    and still be first, however slow the machine.)"""
    with patient_decode(loaded, "pull") as (d, silent):
        bad = {**pull.stale_params(), "remote_port": silent.address[1]}
        slow = in_background(lambda: d.complete(PROMPT, bad))
        wait_until(lambda: d.engine.stats().num_waiting_for_kv == 1)
        r = d.complete(PROMPT, pull.decode_params(), return_token_ids=True)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == pull.reference
        assert d.engine.stats().num_waiting_for_kv == 1  # the stuck pull still waits
        silent.refuse()
        assert slow().status_code >= 500
    pull.assert_healthy()


# -- transfer ids -------------------------------------------------------------------------


def test_transfer_id_reused_on_p_while_held_is_a_400(pull: PD) -> None:
    tid = uuid.uuid4().hex
    first = {**pull.prefill(tid=tid), "do_remote_prefill": True}
    kv = {"do_remote_decode": True, "transfer_mode": "pull", "transfer_id": tid}
    assert_400(pull.p.complete(PROMPT, kv, max_tokens=1), tid, "in use")
    # The first transfer's hold is intact: D reads the right KV with the first params.
    r = pull.d.complete(PROMPT, first, return_token_ids=True)
    assert r.json()["choices"][0]["token_ids"] == pull.reference
    pull.assert_healthy()


def test_transfer_id_reused_on_d_while_in_flight_is_a_400(loaded: LoadedModel, pull: PD) -> None:
    # A P that never answers keeps the first request in its handshake until refused.
    with patient_decode(loaded, "pull") as (d, silent):
        params = {**pull.stale_params(), "remote_port": silent.address[1]}
        first = in_background(lambda: d.complete(PROMPT, params))
        wait_until(lambda: d.engine.stats().num_waiting_for_kv == 1)
        assert_400(d.complete(PROMPT, params), params["transfer_id"], "in use")
        silent.refuse()
        r = first()
        assert r.status_code >= 500 and "refused by the test" in r.json()["error"]["message"]
    pull.assert_healthy()


def test_push_transfer_id_reused_while_registered_is_a_400(loaded: LoadedModel, push: PD) -> None:
    """A second push leg with a transfer id D is waiting on is refused, and the first is
    undisturbed: once its prompt comes, it gets the monolithic tokens. (P and D here have
    no short bound that could end the first while the second is sent.)"""
    with patient_decode(loaded, "push") as (d, _):
        stack: list[Callable[[], None]] = []
        try:
            p_kw = {**P_KW, "registration_ttl_s": 300.0, "lease_s": 300.0}
            p = serve(make_engine(loaded, "prefill", "push", **p_kw), stack)
            pd = PD(p, d, "push", push.reference)
            tid = uuid.uuid4().hex
            params = pd.push_params(tid)
            first = in_background(lambda: d.complete(PROMPT, params, return_token_ids=True))
            connector = p.llm.connector
            assert connector is not None
            wait_until(lambda: tid in connector._registered)  # D's registration reached P
            assert_400(d.complete(PROMPT, params), tid, "in use")
            pd.prefill(PROMPT, tid)  # the first one's prompt
            r = first()
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == push.reference
            assert p.drained(), p.llm.stats()
        finally:
            for close in reversed(stack):
                close()
    push.assert_healthy()


def test_push_legs_with_wrong_fields_are_a_400(push: PD) -> None:
    tid = uuid.uuid4().hex
    base = push.push_params(tid)
    for name, value in [("remote_port", -1), ("remote_host", "a b"), ("transfer_mode", "pull")]:
        assert_400(push.d.complete(PROMPT, {**base, name: value}), name)
    p_leg = {"do_remote_decode": True, "transfer_mode": "push"}  # no transfer_id
    assert_400(push.p.complete(PROMPT, p_leg, max_tokens=1), "transfer_id")
    push.assert_healthy()


# -- fuzz ---------------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner),
    max_leaves=6,
)
FIELDS = [
    "transfer_id",
    "remote_engine_id",
    "remote_incarnation",
    "remote_host",
    "remote_port",
    "remote_block_ids",
    "remote_num_tokens",
    "first_token_id",
    "prefill_done_time",
    "transfer_mode",
    "do_remote_prefill",
    "do_remote_decode",
]
# Addresses stay on this host and off other processes' ports: an unused port, or nonsense.
ADDRESS_VALUES = {
    "remote_host": st.sampled_from(["127.0.0.1", "localhost", "a b", "", "::1", "-x"]),
    "remote_port": st.sampled_from([-1, 0, 70000, "x", None]) | st.builds(free_port),
}


def change() -> st.SearchStrategy[tuple[str, str, Any]]:
    def with_value(op: str, name: str) -> st.SearchStrategy[tuple[str, str, Any]]:
        return st.tuples(st.just(op), st.just(name), ADDRESS_VALUES.get(name, json_values))

    names = st.sampled_from(FIELDS)
    return st.tuples(st.sampled_from(["drop", "set", "add"]), names).flatmap(
        lambda pair: with_value(*pair)
    )


mutations = st.lists(change(), min_size=1, max_size=3)


def mutate(params: dict[str, Any], changes: list[tuple[str, str, Any]]) -> dict[str, Any]:
    out = dict(params)
    for op, name, value in changes:
        if op == "drop":
            out.pop(name, None)
        elif op == "set":
            out[name] = value
        else:
            out[f"x_{name}"] = value
    return out


def test_mutated_decode_params_never_kill_or_wedge(loaded: LoadedModel, pull: PD) -> None:
    # Params D refuses leave P's hold unread: this P's short lease frees them.
    stack: list[Callable[[], None]] = []
    try:
        p_kw = {**P_KW, "lease_s": SHORT_LEASE_S}
        p = serve(make_engine(loaded, "prefill", "pull", **p_kw), stack)
        fuzz_decode_params(PD(p, pull.d, "pull", pull.reference))
    finally:
        for close in reversed(stack):
            close()


def fuzz_decode_params(pull: PD) -> None:
    """Mutated params of genuine prefills: each a 400, a clear error or a completion; then
    both instances are healthy."""
    seen: dict[int, int] = {}

    @settings(
        max_examples=40,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow],
    )
    @given(mutations)
    def run(changes: list[tuple[str, str, Any]]) -> None:
        params = mutate(pull.decode_params(), changes)
        r = in_background(lambda: pull.d.complete(PROMPT, params))()
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        if r.status_code >= 400:
            assert r.json()["error"]["message"], r.text  # a reason, not a bare status
        else:
            assert len(r.json()["choices"][0]["text"]) >= 0
        assert pull.d.engine.is_alive and pull.p.engine.is_alive

    run()
    assert seen.get(400, 0) >= 10, seen
    pull.assert_healthy()
