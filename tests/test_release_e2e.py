"""The router's release of P's hold and its admission check, with real processes (tcp).

Clusters run with a cluster token and a 300 s lease on P, so blocks that come back within
a second were freed by the router's release, never by the lease (`kv_lease_expired` stays
0). The pull cluster's P runs its engine in a core process (`--engine-process`), the push
cluster's in a thread, so the release is checked through both `EngineHandle`s.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from contextlib import ExitStack

import httpx
import pytest

from pdserve.faults import Faults
from pdserve.transfer.cluster_auth import LEG_SIGNATURE_HEADER, sign_leg
from pdserve.transfer.release import SIGNATURE_HEADER, release_signature
from tests.procs import PdserveProcess

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

TOKEN = "e2e-cluster-token"
ENV = {"PDSERVE_CLUSTER_TOKEN": TOKEN}
PROMPT = list(range(3, 200))  # 13 blocks of 16 tokens
FREED_WITHIN_S = 1.0


class Cluster:
    """P, D and a router of one mode, all with the cluster token."""

    def __init__(
        self, stack: ExitStack, mode: str, p_args=(), d_faults: Faults | None = None
    ) -> None:
        def serve(role: str, extra, faults: Faults | None = None) -> PdserveProcess:
            args = ["serve", "--role", role, "--kv-transfer", mode, "--threads", "1", *extra]
            return stack.enter_context(PdserveProcess(args, env=ENV, faults=faults))

        self.mode = mode
        self.p = serve("prefill", ("--kv-lease", "300", *p_args))
        self.d = serve("decode", (), d_faults)
        self.router = stack.enter_context(router(mode, self.p, self.d, env=ENV))

    def metric(self, name: str) -> float:
        text = httpx.get(f"{self.p.url}/metrics", timeout=5).text
        match = re.search(rf'^{name}{{mode="{self.mode}"}} (\S+)$', text, re.M)
        assert match, f"{name} not in P's metrics"
        return float(match.group(1))

    def wait_p_free(self, within_s: float) -> float:
        """Seconds until P holds no blocks (polled), failing after `within_s`."""
        t0 = time.monotonic()
        while self.metric("pdserve_kv_blocks_held") > 0:
            assert time.monotonic() - t0 < within_s, "P still holds blocks"
            time.sleep(0.02)
        return time.monotonic() - t0


def router(mode: str, p: PdserveProcess, d: PdserveProcess, env=None) -> PdserveProcess:
    args = ["router", "--prefill", p.url, "--decode", d.url, "--kv-transfer", mode]
    return PdserveProcess([*args, "--local-prefill-below", "0"], env=env)


@pytest.fixture(scope="module")
def pull() -> Iterator[Cluster]:
    with ExitStack() as stack:
        yield Cluster(stack, "pull", p_args=("--engine-process",))


@pytest.fixture(scope="module")
def push() -> Iterator[Cluster]:
    # D registers only after 3 s: time for a client to leave after P finished.
    with ExitStack() as stack:
        yield Cluster(stack, "push", d_faults=Faults(register_delay_s=3.0))


def too_long_for_d(stream: bool = False) -> dict:
    # P gets max_tokens=1 and accepts; D refuses 5,000 (the model's context is 4,096).
    return {"prompt": PROMPT, "max_tokens": 5000, "temperature": 0, "stream": stream}


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_refused_decode_leg_frees_p_within_a_second(request, mode) -> None:
    c: Cluster = request.getfixturevalue(mode)
    before = c.metric("pdserve_kv_released_by_router_total")
    r = httpx.post(f"{c.router.url}/v1/completions", json=too_long_for_d(), timeout=60)
    assert r.status_code == 400 and "max" in r.json()["error"]["message"]
    c.wait_p_free(FREED_WITHIN_S)
    assert c.metric("pdserve_kv_lease_expired_total") == 0
    if mode == "pull":  # sequential: P finished the prompt before D refused, certainly
        assert c.metric("pdserve_kv_released_by_router_total") == before + 1


def test_push_client_gone_before_the_first_token_frees_p(push: Cluster) -> None:
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "stream": True}
    before = push.metric("pdserve_kv_released_by_router_total")
    with pytest.raises(httpx.ReadTimeout):  # D waits 3 s to register: we leave after 1 s
        httpx.post(f"{push.router.url}/v1/completions", json=body, timeout=1.0)
    push.wait_p_free(FREED_WITHIN_S)
    assert push.metric("pdserve_kv_released_by_router_total") == before + 1
    assert push.metric("pdserve_kv_lease_expired_total") == 0


def test_unsigned_or_forged_release_frees_nothing(pull: Cluster) -> None:
    body = {
        "prompt": PROMPT,
        "max_tokens": 1,
        "temperature": 0,
        "kv_transfer_params": {"do_remote_decode": True, "transfer_mode": "pull"},
    }
    leg = {LEG_SIGNATURE_HEADER: sign_leg(TOKEN, body["kv_transfer_params"])}  # as the router
    r = httpx.post(f"{pull.p.url}/v1/completions", json=body, headers=leg, timeout=60)
    assert r.status_code == 200, r.text
    tid = r.json()["kv_transfer_params"]["transfer_id"]
    held = pull.metric("pdserve_kv_blocks_held")
    released = pull.metric("pdserve_kv_released_by_router_total")
    url = f"{pull.p.url}/kv/release"
    forged = {SIGNATURE_HEADER: release_signature("not-the-token", tid)}
    assert httpx.post(url, json={"transfer_id": tid}).status_code == 401
    assert httpx.post(url, json={"transfer_id": tid}, headers=forged).status_code == 403
    assert httpx.post(url, json={"transfer_id": "bad id"}).status_code == 400
    time.sleep(0.2)  # what a wrongly accepted release would take to free the blocks
    assert pull.metric("pdserve_kv_blocks_held") == held > 0
    assert pull.metric("pdserve_kv_released_by_router_total") == released
    signed = {SIGNATURE_HEADER: release_signature(TOKEN, tid)}
    assert httpx.post(url, json={"transfer_id": tid}, headers=signed).status_code == 202
    pull.wait_p_free(FREED_WITHIN_S)
    assert pull.metric("pdserve_kv_released_by_router_total") == released + 1


def test_router_with_the_wrong_mode_refuses_real_instances(push: Cluster) -> None:
    """A pull router in front of push instances: /health 503 listing both with the
    mismatch, a 503 naming it to clients (never a 400), and a warning in its log."""
    wrong = router("pull", push.p, push.d, env=ENV)
    wrong.health_path = "/metrics"  # its /health is 503 by design
    with wrong:
        health = httpx.get(f"{wrong.url}/health", timeout=5)
        r = httpx.post(f"{wrong.url}/v1/completions", json=too_long_for_d(), timeout=30)
        log = wrong.log()
    assert health.status_code == 503
    refused = health.json()["refused"]
    assert {x["url"] for x in refused} == {push.p.url, push.d.url}
    assert {x["mismatch"] for x in refused} == {"transfer_mode"}
    assert r.status_code == 503
    assert (
        "transfer mode is push, the router's --kv-transfer is pull" in r.json()["error"]["message"]
    )
    assert f"prefill instance {push.p.url} refused: its transfer mode is push" in log
