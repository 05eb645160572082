"""P/D end to end with real processes: `pdserve up` (router + prefill + decode instances).

The oracle: greedy output through a P/D cluster, in pull and in push mode, over each
transport, is token-for-token the monolithic instance's. After every scenario both
instances report zero KV blocks in use.
"""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path

import httpx
import procs
import pytest
from fault_serve import instance_command

from pdserve.faults import Faults
from pdserve.launcher import Cluster, ClusterConfig
from pdserve.transfer.cluster_auth import LEG_SIGNATURE_HEADER, route_headers, sign_leg
from pdserve.transfer.transport import BackendUnavailableError

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

NUM_PROMPTS = 30
MAX_TOKENS = 16


def nixl_available() -> bool:
    try:
        from pdserve.config import TransportConfig
        from pdserve.transfer.transport import create_transport

        create_transport(TransportConfig(kind="nixl"), "probe").close()
        return True
    except (BackendUnavailableError, ImportError):
        return False


TRANSPORTS = [
    "tcp",
    pytest.param("nixl", marks=pytest.mark.skipif(not nixl_available(), reason="no nixl")),
]


def prompts() -> list[list[int]]:
    """30 prompts of 1 to 2,000 tokens (byte-level ids, no special tokens)."""
    rng = random.Random(1234)
    lengths = [1, 2, 17, 2000, 1999, 512] + [rng.randrange(1, 2001) for _ in range(24)]
    return [[rng.randrange(3, 250) for _ in range(n)] for n in lengths]


async def complete_all(url: str, batch: list[list[int]]) -> list[list[int]]:
    return await procs.complete_all(url, batch, MAX_TOKENS)


def instance_urls(cluster: Cluster) -> list[str]:
    return [inst.url for inst in cluster.instances]


def blocks_used(cluster: Cluster, url: str) -> int:
    """An instance's KV blocks in use (`/load`, which needs a proof of the cluster token)."""
    headers = route_headers(cluster.cluster_token, "/load")
    return httpx.get(f"{url}/load", headers=headers, timeout=5).json()["kv_blocks_used"]


def wait_blocks_free(cluster: Cluster, timeout: float = 60.0) -> None:
    """Every instance's pool returns to full (leases, writes and quarantines end)."""
    deadline = time.monotonic() + timeout
    used: dict[str, int] = {}
    while time.monotonic() < deadline:
        used = {u: blocks_used(cluster, u) for u in instance_urls(cluster)}
        if not any(used.values()):
            return
        time.sleep(0.2)
    raise AssertionError(f"KV blocks still in use: {used}")


@pytest.fixture(scope="module")
def expected(tmp_path_factory) -> list[list[int]]:
    log_dir = tmp_path_factory.mktemp("mono")
    with Cluster(ClusterConfig(kv_transfer=None, log_dir=log_dir)) as mono:
        out = asyncio.run(complete_all(mono.router_url, prompts()))
        wait_blocks_free(mono)
    assert all(len(o) == MAX_TOKENS for o in out)
    return out


def start(
    tmp_path: Path,
    mode: str,
    transport: str = "tcp",
    extra: tuple[str, ...] = (),
    faults: Faults | None = None,
):
    # Local prefill off: every test prompt (1-17 tokens) must go through P and a transfer.
    cfg = ClusterConfig(
        kv_transfer=mode,
        transport=transport,
        log_dir=tmp_path,
        instance_args=extra,
        local_prefill_below=0,
    )
    return Cluster(cfg, instance_command=None if faults is None else instance_command(faults))


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("mode", ["pull", "push"])
def test_pd_greedy_output_equals_monolithic(tmp_path, expected, mode, transport) -> None:
    with start(tmp_path, mode, transport) as cluster:
        assert cluster.check_pinning() == []  # P and D on their own cores, every thread
        got = asyncio.run(complete_all(cluster.router_url, prompts()))
        for i, (g, e) in enumerate(zip(got, expected, strict=True)):
            assert g == e, f"prompt {i} ({len(prompts()[i])} tokens) differs in {mode}/{transport}"
        wait_blocks_free(cluster)
        assert_every_kv_received(cluster, mode, NUM_PROMPTS)


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_engine_core_processes_give_monolithic_output(tmp_path, expected, mode) -> None:
    """`--engine-process` on P and D: every engine runs in its own child process, and the
    oracle still holds; a client that hangs up mid-stream still frees both sides."""
    with start(tmp_path, mode, extra=("--engine-process",)) as cluster:
        got = asyncio.run(complete_all(cluster.router_url, prompts()))
        for i, (g, e) in enumerate(zip(got, expected, strict=True)):
            assert g == e, f"prompt {i} ({len(prompts()[i])} tokens) differs in {mode}"
        _hang_up_mid_stream(cluster)
        wait_blocks_free(cluster)
        assert_every_kv_received(cluster, mode, NUM_PROMPTS + 1)


def assert_every_kv_received(cluster: Cluster, mode: str, requests: int) -> None:
    """D received the KV of every request the router disaggregated, and those are nearly all
    of `requests`: on a loaded machine P may miss two health checks in a row, and the router
    then prefills a request or two on D (mode local_fallback) instead of failing them."""
    d = _samples(httpx.get(f"{cluster.instances[1].url}/metrics", timeout=5).text)
    r = _samples(httpx.get(f"{cluster.router_url}/metrics", timeout=5).text)
    sent = sum(
        v
        for (name, labels), v in r.items()
        if name == "pdserve_router_requests_total" and ("mode", mode) in labels
    )
    fallback = sum(
        v
        for (name, labels), v in r.items()
        if name == "pdserve_router_requests_total" and ("mode", "local_fallback") in labels
    )
    assert d[("pdserve_kv_received_total", (("mode", mode),))] == sent
    assert sent + fallback == requests and fallback <= requests // 10, (sent, fallback)


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_client_disconnect_mid_stream_frees_both_sides(tmp_path, mode) -> None:
    with start(tmp_path, mode) as cluster:
        _hang_up_mid_stream(cluster)
        wait_blocks_free(cluster)


def _hang_up_mid_stream(cluster: Cluster) -> None:
    """Stream a long reply through the router, read a few tokens, then hang up."""
    body = {
        "prompt": list(range(3, 250)),
        "max_tokens": 2000,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{cluster.router_url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]  # a few tokens, then hang up
    assert any(line.startswith("data: {") for line in got)


def test_push_200_requests_with_random_aborts_leave_no_blocks(tmp_path) -> None:
    rng = random.Random(7)

    async def scenario(url: str) -> tuple[int, int]:
        done = aborted = 0
        sem = asyncio.Semaphore(16)
        async with httpx.AsyncClient(timeout=120) as client:

            async def one(i: int) -> None:
                nonlocal done, aborted
                body = {
                    "prompt": [rng.randrange(3, 250) for _ in range(rng.randrange(1, 600))],
                    "max_tokens": rng.randrange(1, 40),
                    "temperature": 0,
                    "stream": True,
                }
                abort_after = rng.random() * 0.3 if rng.random() < 0.4 else None
                async with sem:
                    task = asyncio.ensure_future(_consume(client, url, body))
                    try:
                        await asyncio.wait_for(task, abort_after)
                        done += 1
                    except asyncio.TimeoutError:
                        aborted += 1  # wait_for cancelled the stream: the client went away

            await asyncio.gather(*(one(i) for i in range(200)))
        return done, aborted

    # Slowed steps (2 ms each) keep `aborted > 0` certain however fast the machine: the
    # shortest abort point is 11 ms, and its reply of 24 tokens takes at least 48 ms.
    with start(tmp_path, "push", faults=Faults(step_delay_s=0.002)) as cluster:
        done, aborted = asyncio.run(scenario(cluster.router_url))
        assert done + aborted == 200 and aborted > 0 and done > 0
        wait_blocks_free(cluster)
        # The instances still serve after the storm.
        assert len(asyncio.run(complete_all(cluster.router_url, prompts()[:2]))[0]) == MAX_TOKENS


async def _consume(client: httpx.AsyncClient, url: str, body: dict) -> None:
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for _ in r.aiter_lines():
            pass


def test_pull_lease_expiry_frees_prefill_blocks(tmp_path) -> None:
    with start(tmp_path, "pull", extra=("--kv-lease", "1")) as cluster:
        prefill = cluster.instances[0].url
        body = {
            "prompt": list(range(3, 200)),
            "max_tokens": 1,
            "temperature": 0,
            "kv_transfer_params": {"do_remote_decode": True, "transfer_mode": "pull"},
        }
        # Sent as the router sends a P leg: signed with the cluster token.
        signed = {LEG_SIGNATURE_HEADER: sign_leg(cluster.cluster_token, body["kv_transfer_params"])}
        r = httpx.post(f"{prefill}/v1/completions", json=body, headers=signed, timeout=60)
        assert r.status_code == 200, r.text
        params = r.json()["kv_transfer_params"]
        assert params["remote_block_ids"]
        used = blocks_used(cluster, prefill)
        # Held for D while the lease runs. Only checked if the answer came well inside the
        # lease: a loaded machine may be slower than the 1 s lease between the two calls.
        if time.time() < params["expires_at"] - 0.1:
            assert used > 0
        wait_blocks_free(cluster)  # nobody read it: the lease frees it
        m = httpx.get(f"{prefill}/metrics").text
        assert 'pdserve_kv_lease_expired_total{mode="pull"} 1.0' in m
