"""P/D legs and routes for routers need the cluster token (pdserve.transfer.cluster_auth).

The threat: anyone who reaches an instance's HTTP port could send a request carrying
`kv_transfer_params` and make a decode instance reserve blocks and a slot for KV that never
comes (and dial a peer the caller named), or make a prefill instance hold a prompt's blocks
for its lease. With a cluster token only the router, which signs each leg, may do that.

Instances: a prefill and a decode instance with the same token, served in process by their
FastAPI apps (real engines on builtin:tiny, tcp), as in tests/test_pull_signed_params.py.
The tests play the stranger (unsigned, wrongly signed, stale, replayed legs) and check the
status, the error code, and that neither engine allocated a block or started a transfer;
then that the router's kind of signed legs still give the monolithic engine's tokens.
Router: with fake instances (tests/test_router_fake_instance.py), that it signs every leg
over exactly the params it sends and proves the token on its /kv/info and /load polls.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import torch

from pdserve.config import ModelConfig, ServerConfig
from pdserve.engine.async_engine import AsyncEngine
from pdserve.model.loader import LoadedModel, load_model
from pdserve.server.app import create_app
from pdserve.transfer.cluster_auth import (
    CLUSTER_AUTH_HEADER,
    LEG_SIGNATURE_HEADER,
    MAX_AGE_S,
    Proof,
    SeenSignatures,
    check_leg,
    check_route,
    route_headers,
    route_proof,
    sign_leg,
)
from pdserve.transfer.params import InvalidKVTransferParams, parse_kv_transfer_params
from pdserve.transfer.release import SIGNATURE_HEADER, release_signature
from tests.pd_harness import make_engine
from tests.test_fuzz_kv_params import GREEDY, PD, PROMPT, Served, make_pd, serve
from tests.test_router_fake_instance import FakeInstance, running_router

# Slow (routers, fake instances and P/D engines served over real sockets): `make test` runs it,
# the unit tier (`make test-fast`) does not.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

TOKEN = "cluster-secret"
P_KW = {"lease_s": 300.0, "registration_ttl_s": 1.0, "cluster_token": TOKEN}
D_KW = {"handshake_timeout_s": 1.0, "recv_timeout_s": 4.0, "cluster_token": TOKEN}
LONG_PROMPT = list(range(3, 250)) * 4  # 988 tokens: 62 blocks of 16, if anyone held them


# -- the module's pure functions --------------------------------------------------------------


def push_d_params(tid: str | None = None, port: int = 40_001) -> dict[str, Any]:
    return {
        "do_remote_prefill": True,
        "transfer_mode": "push",
        "transfer_id": tid or uuid.uuid4().hex,
        "remote_engine_id": "prefill-0123abcd",
        "remote_incarnation": "a1b2c3d4e5f6",
        "remote_host": "127.0.0.1",
        "remote_port": port,
    }


def test_a_leg_signature_covers_every_field_and_its_time() -> None:
    params = push_d_params()
    header = sign_leg(TOKEN, params, now=1000.0)
    parsed = parse_kv_transfer_params(params)
    assert check_leg(TOKEN, parsed, header, now=1000.0) is Proof.OK
    assert check_leg(TOKEN, parsed, header, now=1000.0 + MAX_AGE_S) is Proof.OK
    assert check_leg(TOKEN, parsed, header, now=1001.0 + MAX_AGE_S) is Proof.EXPIRED
    assert check_leg(TOKEN, parsed, header, now=999.0 - MAX_AGE_S) is Proof.EXPIRED  # future
    assert check_leg("another-token", parsed, header, now=1000.0) is Proof.WRONG
    assert check_leg(TOKEN, parsed, None) is Proof.MISSING
    assert check_leg(None, parsed, None) is Proof.OK  # no token: as before
    changed = {
        "transfer_id": "0" * 32,
        "remote_engine_id": "prefill-other",
        "remote_incarnation": "ffffffffffff",
        "remote_host": "10.0.0.9",
        "remote_port": 40_002,
        "do_remote_prefill": False,  # and do_remote_decode: a P leg instead
    }
    for name, value in changed.items():
        other = {**params, name: value}
        if name == "do_remote_prefill":
            other = {"do_remote_decode": True, "transfer_mode": "push", "transfer_id": "t"}
        proof = check_leg(TOKEN, parse_kv_transfer_params(other), header, now=1000.0)
        assert proof is Proof.WRONG, name
    stamp = header.rpartition(":")[2]
    for bad in ("", "x", f"{'0' * 64}:{stamp}", header.upper(), f"{header}:1", f"{header} "):
        assert check_leg(TOKEN, parsed, bad or None, now=1000.0) in (Proof.WRONG, Proof.MISSING)


def test_a_route_proof_is_bound_to_its_path() -> None:
    proof = route_proof(TOKEN, "/load", now=50.0)
    assert check_route(TOKEN, "/load", proof, now=50.0) is Proof.OK
    assert check_route(TOKEN, "/kv/info", proof, now=50.0) is Proof.WRONG
    assert check_route(TOKEN, "/load", proof, now=51.0 + MAX_AGE_S) is Proof.EXPIRED
    assert TOKEN not in proof and route_headers(None, "/load") == {}


def test_seen_signatures_refuse_a_second_use_until_it_has_expired() -> None:
    seen = SeenSignatures()
    a, b = sign_leg(TOKEN, push_d_params(), now=100.0), sign_leg(TOKEN, push_d_params(), now=100.0)
    assert seen.first_use(a, now=100.0) and seen.first_use(b, now=100.0)
    assert not seen.first_use(a, now=100.0 + MAX_AGE_S)
    seen.first_use(sign_leg(TOKEN, push_d_params(), now=200.0), now=200.0)
    assert len(seen) == 1  # a and b expired: the set stays as small as the window


def test_the_release_signature_is_unchanged() -> None:
    import hmac

    expected = hmac.new(TOKEN.encode(), b"pdserve kv release v1\0tid", "sha256").hexdigest()
    assert release_signature(TOKEN, "tid") == expected


# -- instances with a token -------------------------------------------------------------------


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    torch.set_num_threads(1)
    return load_model(ModelConfig(cache_dir=tmp_path_factory.mktemp("models")))


@pytest.fixture(scope="module")
def reference(loaded: LoadedModel) -> list[int]:
    stack: list[Callable[[], None]] = []
    try:
        r = serve(make_engine(loaded, "both", "pull"), stack).complete(
            PROMPT, None, return_token_ids=True
        )
    finally:
        for close in reversed(stack):
            close()
    return r.json()["choices"][0]["token_ids"]


@pytest.fixture(scope="module", params=["pull", "push"])
def pd(request: pytest.FixtureRequest, loaded: LoadedModel, reference: list[int]) -> Iterator[PD]:
    yield from make_pd(loaded, request.param, reference, P_KW, D_KW)


def stranger(s: Served, kv: dict[str, Any], headers: dict[str, str] | None = None) -> Any:
    """A request to `s` as a stranger sends it: `kv` with only the `headers` given."""
    body = {"prompt": LONG_PROMPT, **GREEDY, "kv_transfer_params": kv}
    return s.client.post("/v1/completions", json=body, headers=headers or {})


def forged_legs(pd: PD) -> dict[str, tuple[Served, dict[str, Any]]]:
    """A plausible leg for each side, as a stranger who cannot read /kv/info makes them."""
    tid = uuid.uuid4().hex
    p_leg = {"do_remote_decode": True, "transfer_mode": pd.mode, "transfer_id": tid}
    d_leg = push_d_params(tid)
    if pd.mode == "pull":
        blocks = list(range(len(LONG_PROMPT) // 16 + 1))
        d_leg = {**d_leg, "transfer_mode": "pull", "remote_block_ids": blocks}
        d_leg |= {"remote_num_tokens": len(LONG_PROMPT), "first_token_id": 5}
    return {"prefill": (pd.p, p_leg), "decode": (pd.d, d_leg)}


def assert_nothing_allocated(pd: PD) -> None:
    """Neither engine holds a block, waits for KV, or has started a transfer; read from
    /load with a proof of the token, and from the connectors' counters."""
    time.sleep(0.1)  # what an admitted leg would take to reach its engine
    for s in (pd.p, pd.d):
        load = s.client.get("/load", headers=route_headers(TOKEN, "/load"))
        assert load.status_code == 200, load.text
        body = load.json()
        assert body["kv_blocks_used"] == 0 and body["num_waiting_for_kv"] == 0, body
        assert body["num_running"] == 0 and body["num_waiting"] == 0, body
        metrics = s.engine.connector_metrics()
        assert metrics is not None and metrics.blocks_held == 0
    assert pd.d.llm.connector is not None  # never dialed the peer a stranger named
    assert pd.d.llm.connector.known_peer("prefill-0123abcd", "a1b2c3d4e5f6") is None


@pytest.mark.parametrize("leg", ["prefill", "decode"])
def test_a_leg_without_a_signature_is_401_and_allocates_nothing(pd: PD, leg: str) -> None:
    served, kv = forged_legs(pd)[leg]
    r = stranger(served, kv)
    assert r.status_code == 401, r.text
    err = r.json()["error"]
    assert err["code"] == "missing_leg_signature" and err["type"] == "authentication_error"
    assert LEG_SIGNATURE_HEADER in err["message"]
    assert_nothing_allocated(pd)


@pytest.mark.parametrize("leg", ["prefill", "decode"])
@pytest.mark.parametrize(
    ("how", "code"),
    [
        ("other token", "invalid_leg_signature"),
        ("other params", "invalid_leg_signature"),
        ("too old", "expired_leg_signature"),
        ("garbage", "invalid_leg_signature"),
    ],
)
def test_a_wrong_or_stale_signature_is_403_and_allocates_nothing(
    pd: PD, leg: str, how: str, code: str
) -> None:
    served, kv = forged_legs(pd)[leg]
    signature = {
        "other token": lambda: sign_leg("not-the-token", kv),
        "other params": lambda: sign_leg(TOKEN, {**kv, "transfer_id": uuid.uuid4().hex}),
        "too old": lambda: sign_leg(TOKEN, kv, now=time.time() - MAX_AGE_S - 5),
        "garbage": lambda: "not-a-signature",
    }[how]()
    r = stranger(served, kv, {LEG_SIGNATURE_HEADER: signature})
    assert r.status_code == 403, r.text
    assert r.json()["error"]["code"] == code
    assert_nothing_allocated(pd)


def test_a_signature_replayed_after_its_transfer_ended_is_403(pd: PD) -> None:
    """A leg's signature is good once: the replay is refused even though its transfer id
    is free again (P's hold released), which the gate's transfer-id check alone allows."""
    tid = uuid.uuid4().hex
    kv = {"do_remote_decode": True, "transfer_mode": pd.mode, "transfer_id": tid}
    header = {LEG_SIGNATURE_HEADER: sign_leg(TOKEN, kv)}
    body = {"prompt": PROMPT, **GREEDY, "max_tokens": 1, "kv_transfer_params": kv}
    assert pd.p.client.post("/v1/completions", json=body, headers=header).status_code == 200
    release = {SIGNATURE_HEADER: release_signature(TOKEN, tid)}
    r = pd.p.client.post("/kv/release", json={"transfer_id": tid}, headers=release)
    assert r.status_code == 202 and pd.p.drained()
    r = pd.p.client.post("/v1/completions", json=body, headers=header)
    assert r.status_code == 403 and r.json()["error"]["code"] == "replayed_leg_signature"
    # Another second, another signature (the router never signs the same params twice: each
    # leg has a fresh transfer id).
    fresh = {LEG_SIGNATURE_HEADER: sign_leg(TOKEN, kv, now=time.time() + 1)}
    assert pd.p.client.post("/v1/completions", json=body, headers=fresh).status_code == 200
    pd.p.client.post("/kv/release", json={"transfer_id": tid}, headers=release)
    assert pd.p.drained()


def test_signed_legs_and_plain_requests_still_work(pd: PD) -> None:
    pd.assert_healthy()  # the helper signs its legs as the router does
    r = pd.d.complete(PROMPT, None, return_token_ids=True)  # a plain request needs no token
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == pd.reference


@pytest.mark.parametrize("path", ["/kv/info", "/load"])
def test_routes_for_routers_need_a_proof_of_the_token(pd: PD, path: str) -> None:
    for s in (pd.p, pd.d):
        r = s.client.get(path)
        assert r.status_code == 401 and r.json()["error"]["code"] == "missing_cluster_auth"
        for wrong in (
            route_proof("not-the-token", path),
            route_proof(TOKEN, "/health"),
            route_proof(TOKEN, path, now=time.time() - MAX_AGE_S - 5),
        ):
            r = s.client.get(path, headers={CLUSTER_AUTH_HEADER: wrong})
            assert r.status_code == 403, (path, r.text)
        assert s.client.get(path, headers=route_headers(TOKEN, path)).status_code == 200
        assert s.client.get("/health").status_code == 200
        assert s.client.get("/metrics").status_code == 200


def test_the_front_end_must_have_the_engines_token(loaded: LoadedModel) -> None:
    llm = make_engine(loaded, "decode", "push", cluster_token=TOKEN)
    engine = AsyncEngine(llm)
    engine.start()
    try:
        for wrong in (None, "another-token"):
            with pytest.raises(ValueError, match="cluster_token"):
                create_app(engine, ServerConfig(cluster_token=wrong))
        create_app(engine, ServerConfig(cluster_token=TOKEN))
    finally:
        engine.shutdown()
        llm.close()


# -- the router -------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_the_router_signs_every_leg_over_what_it_sends(mode: str) -> None:
    with FakeInstance("prefill") as p, FakeInstance("decode") as d:
        p.cluster_token = d.cluster_token = TOKEN  # /kv/info and /load need the proof
        with running_router([p], [d], mode=mode, cluster_token=TOKEN) as url:
            r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200, r.text
    for rec in (p.received[0], d.received[0]):
        params = parse_kv_transfer_params(rec.params)
        assert check_leg(TOKEN, params, rec.headers[LEG_SIGNATURE_HEADER.lower()]) is Proof.OK
    if mode == "push":  # D's remote coordinates are the ones the signature covers
        assert d.received[0].params["remote_port"] == p.side_channel_port


def test_a_router_without_the_token_cannot_read_push_prefill_coordinates(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """P's /kv/info refuses it: the router never pairs P (it prefills on D instead) and
    its log says what to fix."""
    with FakeInstance("prefill") as p, FakeInstance("decode") as d:
        p.cluster_token = TOKEN
        with running_router([p], [d], mode="push", wait_ready=False) as url:
            time.sleep(0.3)  # several health rounds
            r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200 and not p.received
    assert "kv_transfer_params" not in d.received[0].body
    assert "--cluster-token" in caplog.text and "HTTP 401" in caplog.text


def test_router_instances_needs_a_proof_of_the_token() -> None:
    path = "/router/instances"
    with (
        FakeInstance("prefill") as p,
        FakeInstance("decode") as d,
        running_router([p], [d], mode="pull", cluster_token=TOKEN) as url,
    ):
        assert httpx.get(f"{url}{path}").status_code == 401
        forged = {CLUSTER_AUTH_HEADER: route_proof("not-the-token", path)}
        assert httpx.get(f"{url}{path}", headers=forged).status_code == 403
        r = httpx.get(f"{url}{path}", headers=route_headers(TOKEN, path))
        assert r.status_code == 200 and {i["url"] for i in r.json()} == {p.url, d.url}
        assert httpx.get(f"{url}/health").status_code == 200
        assert httpx.get(f"{url}/metrics").status_code == 200


@pytest.mark.parametrize(
    "raw", [{"transfer_mode": "\ud800"}, {"\ud800": 1}, {"do_remote_decode": True, "x\udfff": 0}]
)
def test_params_with_lone_surrogates_are_invalid_not_a_crash(raw: dict[str, object]) -> None:
    """Found by the instance fuzzer: msgspec encodes keys and enum values to match them,
    so a lone surrogate raised UnicodeEncodeError (a 500) instead of a 400."""
    with pytest.raises(InvalidKVTransferParams, match="valid Unicode"):
        parse_kv_transfer_params(raw)
