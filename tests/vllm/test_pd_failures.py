"""PdserveConnector failure behaviour in real vLLM: nothing hangs, no block leaks.

One P and one D serve the module, in this order: a P leg nobody decodes (P's lease frees
it), a client that hangs up mid-stream (both sides free), a client that hangs up while D
waits for KV (D aborts with P; both sides free), then, in push and in pull mode, kill -9 of
P with decode legs in flight and waiting (each ends well within 60 s, the waiting ones with
an error; D's KV usage returns to 0) and a restarted P (same tokens as before the kill).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator

import httpx
import pytest

from pdserve.ports import free_port
from tests.vllm.harness import (
    VLLM_MARKS,
    PdError,
    VllmServer,
    body,
    connector_config,
    decode,
    pd_generate,
    prefill,
    start_all,
    write_checkpoint,
)

pytestmark = [*VLLM_MARKS, pytest.mark.timeout(1800)]
LEASE_S = 8.0
END_WITHIN_S = 60.0


class Pair:
    def __init__(self, p: VllmServer, d: VllmServer) -> None:
        self.p, self.d = p, d


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    tmp = tmp_path_factory.mktemp("vllm-fail")
    model = write_checkpoint(tmp / "ckpt")
    p = VllmServer("prefill", model, tmp, connector_config("push", free_port(), lease_s=LEASE_S))
    quick = {"heartbeat_s": 1.0, "heartbeat_misses": 10, "handshake_timeout_s": 15.0}
    d = VllmServer("decode", model, tmp, connector_config("push", free_port(), **quick))
    start_all([p, d])
    try:
        yield Pair(p, d)
    finally:
        p.stop()
        d.stop()


def prompt(seed: int, n: int = 1500) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 250) for _ in range(n)]


def test_lease_frees_prefill_blocks_nobody_decodes(pair: Pair) -> None:
    async def run() -> None:
        async with httpx.AsyncClient(timeout=300) as client:
            await prefill(client, pair.p, prompt(1), "push")

    asyncio.run(run())
    assert pair.p.metric("vllm:kv_cache_usage_perc") > 0  # held for a D that never comes
    assert pair.p.wait_kv_usage_zero(LEASE_S + 60) == 0


def test_client_disconnect_mid_stream_frees_both_sides(pair: Pair) -> None:
    async def run() -> list[str]:
        async with httpx.AsyncClient(timeout=300) as client:
            kv = await prefill(client, pair.p, prompt(2), "push")
            req = body(pair.d.model, prompt(2), 2000, kv_transfer_params=kv, stream=True)
            lines: list[str] = []
            async with client.stream("POST", f"{pair.d.url}/v1/completions", json=req) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data:"):
                        lines.append(line[:300])
                    if len(lines) >= 3:
                        break  # hang up mid-stream
            return lines

    lines = asyncio.run(run())
    assert len(lines) == 3, lines  # what D sent instead of 2,000 tokens, if it ended early
    assert pair.d.wait_kv_usage_zero() == 0
    assert pair.p.wait_kv_usage_zero() == 0


def test_client_disconnect_while_waiting_for_kv_frees_both_sides(pair: Pair) -> None:
    """D waits on a transfer P cannot serve yet (P keeps the registration for its grace);
    the client hangs up: D aborts it with P, and vLLM gets D's blocks back."""

    async def run() -> None:
        async with httpx.AsyncClient(timeout=300) as client:
            kv = await prefill(client, pair.p, prompt(3), "push")
            kv = {**kv, "remote_request_id": "no-such-request"}  # P will not write it soon
            req = body(pair.d.model, prompt(3), 8, kv_transfer_params=kv)
            with pytest.raises(httpx.ReadTimeout):
                await client.post(f"{pair.d.url}/v1/completions", json=req, timeout=5)

    asyncio.run(run())
    assert pair.d.wait_kv_usage_zero() == 0
    assert pair.p.wait_kv_usage_zero(LEASE_S + 60) == 0


async def timed(coro) -> tuple[float, object]:
    t = time.monotonic()
    try:
        out = await asyncio.wait_for(coro, END_WITHIN_S + 30)
    except Exception as exc:  # the outcome under test: kept, not raised
        out = exc
    return time.monotonic() - t, out


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_kill_prefill_mid_transfer_then_restart(pair: Pair, mode: str) -> None:
    seed = {"push": 10, "pull": 40}[mode]
    before = prompt(seed, 700)

    async def run_before() -> list[int]:
        async with httpx.AsyncClient(timeout=300) as client:
            return await pd_generate(client, pair.p, pair.d, before, 8, mode)

    reference = asyncio.run(run_before())

    async def kill_under_load() -> tuple[list, list]:
        async with httpx.AsyncClient(timeout=300) as client:
            ps = [prompt(seed + 10 + i) for i in range(6)]
            params = [await prefill(client, pair.p, p, mode) for p in ps[:3]]
            # in flight: D legs posted, P killed while they register and P writes
            flying = [
                asyncio.ensure_future(timed(pd_generate(client, pair.p, pair.d, p, 8, mode)))
                for p in ps[3:]
            ]
            flying += [
                asyncio.ensure_future(timed(decode(client, pair.d, p, 8, kv)))
                for p, kv in zip(ps[:1], params[:1], strict=True)
            ]
            await asyncio.sleep(0.3)
            pair.p.kill9()
            # waiting: D legs whose P is already gone (P held their blocks)
            late = [
                timed(decode(client, pair.d, p, 8, kv))
                for p, kv in zip(ps[1:3], params[1:3], strict=True)
            ]
            return list(await asyncio.gather(*flying)), list(await asyncio.gather(*late))

    flying, late = asyncio.run(kill_under_load())
    for elapsed, out in flying + late:
        assert elapsed < END_WITHIN_S, (elapsed, out)
        assert isinstance(out, list | PdError | httpx.HTTPError), out
    for _, out in late:  # nobody can serve them: a clear error, not a hang or garbage
        assert isinstance(out, PdError), out
        assert '"error"' in str(out)
    assert pair.d.wait_kv_usage_zero() == 0

    pair.p.start()
    pair.p.wait_ready()

    async def run_after() -> list[int]:
        async with httpx.AsyncClient(timeout=300) as client:
            return await pd_generate(client, pair.p, pair.d, before, 8, mode)

    assert asyncio.run(run_after()) == reference
    assert pair.d.wait_kv_usage_zero() == 0
    assert pair.p.wait_kv_usage_zero() == 0
