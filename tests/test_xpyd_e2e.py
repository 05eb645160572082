"""A 2P2D cluster of real processes, push and pull: an instance that stops answering
(SIGSTOP) is ejected, requests caught on it end with a clear error instead of hanging, the
others keep serving, and after SIGCONT it is re-admitted and serves again.

The router runs with its default 300 s `--request-timeout`: a request caught on the frozen
instance must end when the health monitor ejects it (a 502 naming the instance, or an
error event in a stream that had started), seconds after the freeze. The client's own
timeout is far shorter than the router's: reaching it would be the hang this test exists
to catch.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import freeze
import httpx
import pytest

from pdserve.launcher import Cluster, ClusterConfig, ManagedProcess
from pdserve.transfer.cluster_auth import route_headers

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

# Ejection takes a few health rounds (1 s interval, 2 s probe timeout, 2 failures) plus a
# busy CPU's slack; reaching this means the router waited for something else than ejection.
CLIENT_TIMEOUT_S = 60.0
EJECTED = "ejected: not answering health checks"
MODEL = "builtin:tiny"
TOKEN = "xpyd-cluster-token"  # /router/instances and /load need a proof of it


def _body(n_prompt: int, max_tokens: int, stream: bool = False) -> dict:
    return {
        "prompt": [3 + i % 240 for i in range(n_prompt)],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": stream,
    }


def wait_for(pred: Callable[[], bool], timeout_s: float = 60.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.2)
    raise AssertionError(f"not within {timeout_s:g} s: {what}")


@pytest.fixture(scope="module", params=["push", "pull"])
def cluster(request, tmp_path_factory) -> Iterator[Cluster]:
    cfg = ClusterConfig(
        kv_transfer=request.param,
        num_prefill=2,
        num_decode=2,
        model=MODEL,
        policy="round_robin",
        pin_cores=False,
        instance_args=("--threads", "1"),
        local_prefill_below=0,  # the 40-token test prompts must reach the prefill instances
        log_dir=tmp_path_factory.mktemp("xpyd"),
        cluster_token=TOKEN,
    )
    with Cluster(cfg) as c:
        yield c


def _admitted(cluster: Cluster, inst: ManagedProcess) -> bool:
    proof = route_headers(TOKEN, "/router/instances")
    rows = httpx.get(f"{cluster.router_url}/router/instances", headers=proof, timeout=10).json()
    return next(r["admitted"] for r in rows if r["url"] == inst.url)


def _of_role(cluster: Cluster, role: str) -> list[ManagedProcess]:
    return [p for p in cluster.instances if p.role == role]


def _received(inst: ManagedProcess) -> float:
    text = httpx.get(f"{inst.url}/metrics", timeout=10).text
    line = next(x for x in text.splitlines() if x.startswith("pdserve_kv_received_total{"))
    return float(line.rsplit(" ", 1)[1])


def _load(inst: ManagedProcess) -> dict:
    proof = route_headers(TOKEN, "/load")
    return httpx.get(f"{inst.url}/load", headers=proof, timeout=10).json()


def _blocks_used(inst: ManagedProcess) -> int:
    return _load(inst)["kv_blocks_used"]


@contextlib.contextmanager
def frozen(inst: ManagedProcess) -> Iterator[None]:
    """SIGSTOP the instance (by PID) for the block; SIGCONT afterwards, even on failure."""
    with freeze.frozen(inst.pid):
        yield


def _assert_clear_error(r: httpx.Response, inst: ManagedProcess) -> None:
    """A 502 from the router ejecting `inst`, or (push) from D, whose transfer noticed the
    frozen P first."""
    assert r.status_code == 502, r.text
    err = r.json()["error"]
    ejected = inst.url in err["message"] and EJECTED in err["message"]
    assert ejected or err.get("code") == "kv_peer_down", err


def _serve_ok(cluster: Cluster, n: int) -> None:
    with httpx.Client(timeout=CLIENT_TIMEOUT_S) as client:
        for _ in range(n):
            r = client.post(f"{cluster.router_url}/v1/completions", json=_body(40, 4))
            assert r.status_code == 200, r.text


def _back_to_normal(cluster: Cluster, inst: ManagedProcess) -> None:
    wait_for(lambda: _admitted(cluster, inst), what=f"{inst.name} re-admitted")
    wait_for(
        lambda: not any(_blocks_used(p) for p in cluster.instances),
        timeout_s=60,
        what="every KV block free",
    )


def test_frozen_prefill_is_ejected_requests_on_it_fail_cleanly_and_it_comes_back(
    cluster: Cluster,
) -> None:
    p0, p1 = _of_role(cluster, "prefill")
    _serve_ok(cluster, 2)
    with frozen(p0), httpx.Client(timeout=CLIENT_TIMEOUT_S) as client:
        # Both sent at once, before the router can have noticed (ejection takes at least
        # two failed probes): round robin puts one of the two on p0. Sent one after the
        # other, the second could leave after the ejection on a slow machine.
        def post(_: int) -> httpx.Response:
            return client.post(f"{cluster.router_url}/v1/completions", json=_body(40, 4))

        with ThreadPoolExecutor(2) as pool:
            responses = list(pool.map(post, range(2)))
        for r in responses:
            if r.status_code != 200:
                _assert_clear_error(r, p0)
        statuses = [r.status_code for r in responses]
        assert statuses.count(200) < 2, "neither request reached the frozen prefill"
        wait_for(lambda: not _admitted(cluster, p0), what="frozen prefill ejected")
        _serve_ok(cluster, 4)  # all on p1 now
    _back_to_normal(cluster, p0)
    before = httpx.get(f"{p0.url}/metrics", timeout=10).text
    _serve_ok(cluster, 4)  # round robin reaches p0 again
    after = httpx.get(f"{p0.url}/metrics", timeout=10).text
    assert before != after and _admitted(cluster, p1)


def test_frozen_decode_mid_stream_ends_the_stream_with_an_error_and_comes_back(
    cluster: Cluster,
) -> None:
    decodes = _of_role(cluster, "decode")
    url = f"{cluster.router_url}/v1/completions"
    with (
        httpx.Client(timeout=CLIENT_TIMEOUT_S) as client,
        client.stream("POST", url, json=_body(64, 4000, stream=True)) as r,
    ):
        assert r.status_code == 200
        lines = r.iter_lines()
        head = [next(lines) for _ in range(4)]
        assert any(x.startswith("data: {") for x in head)
        busy = [d for d in decodes if _load(d)["num_running"]]
        assert len(busy) == 1, "exactly one decode instance runs the stream"
        (victim,) = busy
        with frozen(victim):
            rest = list(lines)  # must end: the router ends it when it ejects the victim
            errors = [x for x in rest if x.startswith("data: ") and '"error"' in x]
            assert errors and EJECTED in errors[-1] and victim.url in errors[-1], rest[-3:]
            wait_for(lambda: not _admitted(cluster, victim), what="frozen decode ejected")
            (other,) = [d for d in decodes if d is not victim]
            got = _received(other)
            _serve_ok(cluster, 3)
            assert _received(other) == got + 3  # every request went to the live one
    _back_to_normal(cluster, victim)
    got = _received(victim)
    _serve_ok(cluster, 4)
    assert _received(victim) > got  # re-admitted and used again
