"""Pull params signed by P: with a cluster token, D reads only what a prefill instance of
the cluster handed out, unchanged and unexpired.

The threat: anyone who can reach D's HTTP API directly could send `kv_transfer_params`
naming P's blocks of another request, and D (which the transport trusts) would read that
KV for them. A prefill and a decode instance with the same cluster token are served in
process by their FastAPI apps (real engines on builtin:tiny, tcp transport). Each test
takes genuine params from P, changes or drops something, and checks that D refuses with
an OpenAI-style 400 before any READ, that P's hold is untouched (no block leaked, the
genuine params still work), and that both pools drain.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from pdserve.config import ModelConfig
from pdserve.model.loader import LoadedModel, load_model
from pdserve.token_logprob import TokenLogprob
from pdserve.transfer.params import (
    InvalidKVTransferParams,
    KVTransferParams,
    lease_ended,
    sign,
    verify,
)
from tests.pd_harness import make_engine
from tests.test_fuzz_kv_params import PD, PROMPT, Served, make_pd, serve

pytestmark = pytest.mark.timeout(300)

TOKEN = "cluster-secret"
# P's lease is long: every test reads its prompts well within it, however slow the machine
# (a 2 s lease could end between a prefill and its read). The lease-end test has its own P.
P_KW = {"lease_s": 300.0, "cluster_token": TOKEN}
SHORT_LEASE_S = 2.0
D_KW = {"handshake_timeout_s": 1.0, "recv_timeout_s": 4.0, "cluster_token": TOKEN}


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    torch.set_num_threads(1)
    return load_model(ModelConfig(cache_dir=tmp_path_factory.mktemp("models")))


@pytest.fixture(scope="module")
def pd(loaded: LoadedModel) -> Iterator[PD]:
    stack: list[Callable[[], None]] = []
    try:
        mono = serve(make_engine(loaded, "both", "pull"), stack)
        r = mono.complete(PROMPT, None, return_token_ids=True)
        reference = r.json()["choices"][0]["token_ids"]
    finally:
        for close in reversed(stack):
            close()
    yield from make_pd(loaded, "pull", reference, P_KW, D_KW)


def held_blocks(s: Served) -> int:
    c = s.llm.connector
    assert c is not None
    return c.num_blocks_held()


def reads(s: Served) -> int:
    c = s.llm.connector
    assert c is not None
    return c.stats.transfers


def assert_refused(pd: PD, params: dict[str, Any], *words: str) -> None:
    """D answers 400 kv_params_rejected, reads nothing, and P still holds what it held."""
    held, before = held_blocks(pd.p), reads(pd.d)
    r = pd.d.complete(PROMPT, params)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "kv_params_rejected" and err["param"] == "kv_transfer_params", err
    for w in words:
        assert w in err["message"], err["message"]
    assert reads(pd.d) == before
    assert held_blocks(pd.p) == held
    assert pd.d.drained()


def test_genuine_signed_params_are_read(pd: PD) -> None:
    params = pd.decode_params()
    assert len(params["signature"]) == 64 and params["expires_at"] > time.time()
    r = pd.d.complete(PROMPT, params, return_token_ids=True)  # its read frees P's hold
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == pd.reference, r.text
    pd.assert_healthy()


@pytest.mark.parametrize(
    ("name", "change"),
    [
        ("remote_block_ids", lambda v: list(reversed(v))),
        ("transfer_id", lambda v: uuid.uuid4().hex),
        ("first_token_id", lambda v: (v + 1) % 100),
        ("remote_incarnation", lambda v: "0" * len(v)),
        ("expires_at", lambda v: v + 3600),
        ("prefill_done_time", lambda v: v - 1),
        ("signature", lambda v: ("0" if v[0] != "0" else "1") + v[1:]),
    ],
)
def test_changed_params_are_refused(pd: PD, name: str, change: Callable[[Any], Any]) -> None:
    genuine = pd.decode_params()
    assert_refused(pd, {**genuine, name: change(genuine[name])}, "signature")
    # The genuine params still read the prompt's KV: nothing was taken from P's hold.
    r = pd.d.complete(PROMPT, genuine, return_token_ids=True)
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == pd.reference, r.text
    pd.assert_healthy()


def test_another_transfers_blocks_under_a_valid_signature_are_refused(pd: PD) -> None:
    """Two genuine params: the first's fields with the second's blocks (what an attacker
    who saw both would try) do not verify; each genuine one still reads its own KV."""
    first, second = pd.decode_params(), pd.decode_params()
    forged = {**first, "remote_block_ids": second["remote_block_ids"]}
    assert_refused(pd, forged, "signature")
    for genuine in (first, second):
        r = pd.d.complete(PROMPT, genuine, return_token_ids=True)
        assert r.json()["choices"][0]["token_ids"] == pd.reference, r.text
    pd.assert_healthy()


@pytest.mark.parametrize("dropped", ["signature", "expires_at"])
def test_unsigned_params_are_refused(pd: PD, dropped: str) -> None:
    genuine = pd.decode_params()
    params = {k: v for k, v in genuine.items() if k != dropped}
    assert_refused(pd, params, "signature")
    r = pd.d.complete(PROMPT, genuine, return_token_ids=True)
    assert r.json()["choices"][0]["token_ids"] == pd.reference, r.text
    pd.assert_healthy()


def test_streamed_request_is_refused_before_the_stream_starts(pd: PD) -> None:
    genuine = pd.decode_params()
    r = pd.d.complete(PROMPT, {**genuine, "remote_block_ids": [0, 1, 2]}, stream=True)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "kv_params_rejected", r.text
    r = pd.d.complete(PROMPT, genuine, return_token_ids=True)
    assert r.json()["choices"][0]["token_ids"] == pd.reference, r.text
    pd.assert_healthy()


def test_params_past_their_lease_are_a_lease_error(loaded: LoadedModel, pd: PD) -> None:
    stack: list[Callable[[], None]] = []
    try:
        p = serve(
            make_engine(loaded, "prefill", "pull", **{**P_KW, "lease_s": SHORT_LEASE_S}), stack
        )
        genuine = PD(p, pd.d, "pull", pd.reference).decode_params()
        assert p.drained(timeout=30.0)  # P's lease (2 s) ended: its hold is gone
        before = reads(pd.d)
        r = pd.d.complete(PROMPT, genuine)
        assert r.status_code == 502, r.text
        err = r.json()["error"]
        assert err["type"] == "kv_transfer_error" and err["code"] == "kv_lease_expired", err
        assert reads(pd.d) == before
    finally:
        for close in reversed(stack):
            close()
    pd.assert_healthy()


def test_sign_and_verify_cover_every_field_d_uses() -> None:
    key = TOKEN.encode()
    base = KVTransferParams(
        transfer_mode="pull",
        transfer_id="t",
        remote_engine_id="p",
        remote_incarnation="i",
        remote_host="127.0.0.1",
        remote_port=5000,
        remote_block_ids=[1, 2],
        remote_num_tokens=20,
        first_token_id=7,
        prefill_done_time=1.5,
        expires_at=time.time() + 60,
    )
    signed = sign(base, key)
    verify(signed, key)
    flipped = {"do_remote_prefill": True}  # the router's flag is not signed
    verify(KVTransferParams(**{**_fields(signed), **flipped}), key)
    changes = {
        "transfer_mode": "push",
        "transfer_id": "u",
        "remote_engine_id": "q",
        "remote_incarnation": "j",
        "remote_host": "127.0.0.2",
        "remote_port": 5001,
        "remote_block_ids": [2, 1],
        "remote_num_tokens": 21,
        "first_token_id": 8,
        "prefill_done_time": 1.25,
        "expires_at": signed.expires_at + 1,
        "first_token_logprobs": TokenLogprob(7, -0.5, 1, [7], [-0.5]),
    }
    for name, value in changes.items():
        with pytest.raises(InvalidKVTransferParams, match="signature"):
            verify(KVTransferParams(**{**_fields(signed), name: value}), key)
    with pytest.raises(InvalidKVTransferParams, match="signature"):
        verify(signed, b"another token")


def _fields(p: KVTransferParams) -> dict[str, Any]:
    return {f: getattr(p, f) for f in p.__struct_fields__}


def test_lease_end_is_read_from_expires_at() -> None:
    p = KVTransferParams(transfer_mode="pull", expires_at=100.0)
    assert lease_ended(p, now=99.0) is None
    assert "ended" in (lease_ended(p, now=101.0) or "")
    assert lease_ended(KVTransferParams(transfer_mode="pull"), now=101.0) is None
