"""Greedy vLLM P/D through PdserveConnector equals one monolithic vLLM, token for token.

The reference is the session's monolithic `pdserve serve --engine vllm` (conftest.py). Each
transport gets one P and one D for the module (tcp: the session's pair, which
test_pd_failures uses next); the transfer mode is chosen per request (the P leg's
`transfer_mode`), so push and pull run on the same pair.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pdserve.ports import free_port
from pdserve.transfer.transport import BackendUnavailableError
from pdserve.transfer.transport.nixl_peer import load_nixl
from tests.vllm.harness import (
    VLLM_MARKS,
    Pair,
    VllmServer,
    connector_config,
    gather_limited,
    mono_generate,
    pd_generate,
    start_all,
)

pytestmark = [*VLLM_MARKS, pytest.mark.timeout(2400)]
NUM_PROMPTS = 24
MAX_TOKENS = 12
CONCURRENCY = 4
SEEDS = {"push": 1, "pull": 2}


def prompts(seed: int) -> list[list[int]]:
    """Random token ids, lengths 1..2000 (both ends included)."""
    rng = random.Random(seed)
    lengths = [1, 2000] + [rng.randint(2, 1999) for _ in range(NUM_PROMPTS - 2)]
    return [[rng.randrange(3, 250) for _ in range(n)] for n in lengths]


def _nixl_available() -> bool:
    try:
        load_nixl()
    except BackendUnavailableError:
        return False
    return True


# nixl first: its pair is stopped before the session's tcp pair starts (which stays up
# for test_pd_failures), so at most two P/D servers run at once.
TRANSPORTS = [
    pytest.param(
        "nixl",
        marks=[
            pytest.mark.nixl,
            pytest.mark.skipif(not _nixl_available(), reason="nixl not installed"),
        ],
    ),
    "tcp",
]


class Cluster:
    def __init__(self, pair: Pair, expected: dict[str, list]) -> None:
        self.p, self.d, self.expected = pair.p, pair.d, expected


async def run_mono(mono: VllmServer, ps: list[list[int]]) -> list:
    async with httpx.AsyncClient(timeout=600) as client:
        return await gather_limited(
            [mono_generate(client, mono, p, MAX_TOKENS) for p in ps], CONCURRENCY
        )


async def run_pd(c: Cluster, ps: list[list[int]], mode: str) -> list:
    async with httpx.AsyncClient(timeout=600) as client:
        return await gather_limited(
            [pd_generate(client, c.p, c.d, p, MAX_TOKENS, mode) for p in ps], CONCURRENCY
        )


@pytest.fixture(scope="module")
def expected(mono: VllmServer) -> dict[str, list]:
    """The monolithic instance's answers to every prompt set."""
    return {mode: asyncio.run(run_mono(mono, prompts(s))) for mode, s in SEEDS.items()}


@pytest.fixture(scope="module", params=TRANSPORTS)
def cluster(
    request: pytest.FixtureRequest,
    checkpoint: Path,
    expected: dict[str, list],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Cluster]:
    if request.param == "tcp":
        yield Cluster(request.getfixturevalue("tcp_pair"), expected)
        return
    logs = tmp_path_factory.mktemp(f"pair-{request.param}")
    conf = {"transport": request.param}
    p = VllmServer("prefill", checkpoint, logs, connector_config("push", free_port(), **conf))
    d = VllmServer("decode", checkpoint, logs, connector_config("push", free_port(), **conf))
    pair = Pair(p, d)
    start_all([p, d])
    try:
        yield Cluster(pair, expected)
    finally:
        pair.stop()


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_pd_equals_monolithic(cluster: Cluster, mode: str) -> None:
    ps = prompts(SEEDS[mode])
    mono = cluster.expected[mode]
    assert not [r for r in mono if isinstance(r, BaseException)], mono
    before = cluster.d.metric("vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    pd = asyncio.run(run_pd(cluster, ps, mode))
    errors = [r for r in pd if isinstance(r, BaseException)]
    assert not errors, errors[:3]
    mismatched = [i for i, (a, b) in enumerate(zip(pd, mono, strict=True)) if a != b]
    assert not mismatched, [(len(ps[i]), pd[i], mono[i]) for i in mismatched[:3]]
    assert all(len(t) == MAX_TOKENS for t in pd)
    # Every prompt token reached D through the connector (random prompts share no prefix),
    # except a one-token prompt's: vLLM recomputes a prompt's last token anyway, so it loads
    # nothing for it (and the connector tells P to free its blocks at once).
    after = cluster.d.metric("vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    assert after - before == sum(len(p) for p in ps if len(p) > 1)
    # Nothing leaked: both sides give every block back
    assert cluster.p.wait_kv_usage_zero() == 0
    assert cluster.d.wait_kv_usage_zero() == 0
