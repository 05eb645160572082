"""PdserveConnector failure behaviour in real vLLM: nothing hangs, no block leaks.

The session's tcp pair (conftest.py: P's lease and D's heartbeats are short) serves the
module, in this order: a P leg nobody decodes (P's lease frees it), a client that hangs up
mid-stream (both sides free), a client that hangs up while D waits for KV (D aborts with P;
both sides free), then kill -9 of P with push and pull decode legs in flight and waiting
(each ends well within 60 s, the waiting ones with an error; D's KV usage returns to 0) and
a restarted P (same tokens in both modes as before the kill).
"""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest

from tests.vllm.harness import (
    LEASE_S,
    VLLM_MARKS,
    Pair,
    PdError,
    body,
    decode,
    pd_generate,
    prefill,
)

pytestmark = [*VLLM_MARKS, pytest.mark.timeout(1800)]
END_WITHIN_S = 60.0
MODES = ("push", "pull")


@pytest.fixture
def pair(tcp_pair: Pair) -> Pair:
    return tcp_pair


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


Outcomes = dict[str, list[tuple[float, object]]]


async def kill_under_load(pair: Pair, seeds: dict[str, int]) -> tuple[Outcomes, Outcomes]:
    """P killed once, with decode legs of both modes in flight (D legs posted, P writing or
    about to be read) and, after it, waiting (D legs whose P is already gone): each mode's
    outcomes, timed."""
    async with httpx.AsyncClient(timeout=300) as client:
        ps = {m: [prompt(seeds[m] + 10 + i) for i in range(6)] for m in MODES}
        params = {m: [await prefill(client, pair.p, p, m) for p in ps[m][:3]] for m in MODES}
        flying = {
            m: [
                *(timed(pd_generate(client, pair.p, pair.d, p, 8, m)) for p in ps[m][3:]),
                timed(decode(client, pair.d, ps[m][0], 8, params[m][0])),
            ]
            for m in MODES
        }
        tasks = {m: [asyncio.ensure_future(c) for c in flying[m]] for m in MODES}
        await asyncio.sleep(0.3)
        pair.p.kill9()
        done = {m: list(await asyncio.gather(*tasks[m])) for m in MODES}
        waiting = [
            [
                timed(decode(client, pair.d, p, 8, kv))
                for p, kv in zip(ps[m][1:3], params[m][1:3], strict=True)
            ]
            for m in MODES
        ]
        late = await asyncio.gather(*(asyncio.gather(*w) for w in waiting))
        return done, {m: list(outs) for m, outs in zip(MODES, late, strict=True)}


def test_kill_prefill_mid_transfer_then_restart(pair: Pair) -> None:
    """One kill -9 of P, with push and pull legs in flight and waiting at once."""
    seeds = {"push": 10, "pull": 40}
    before = {mode: prompt(seed, 700) for mode, seed in seeds.items()}

    async def generate_before() -> dict[str, list[int]]:
        async with httpx.AsyncClient(timeout=300) as client:
            return {m: await pd_generate(client, pair.p, pair.d, before[m], 8, m) for m in MODES}

    reference = asyncio.run(generate_before())
    flying, late = asyncio.run(kill_under_load(pair, seeds))
    for mode in MODES:
        for elapsed, out in flying[mode] + late[mode]:
            assert elapsed < END_WITHIN_S, (mode, elapsed, out)
            assert isinstance(out, list | PdError | httpx.HTTPError), (mode, out)
        for _, out in late[mode]:  # nobody can serve them: a clear error, not a hang or garbage
            assert isinstance(out, PdError), (mode, out)
            assert '"error"' in str(out)
    assert pair.d.wait_kv_usage_zero() == 0

    pair.p.start()
    pair.p.wait_ready()
    assert asyncio.run(generate_before()) == reference
    assert pair.d.wait_kv_usage_zero() == 0
    assert pair.p.wait_kv_usage_zero() == 0
