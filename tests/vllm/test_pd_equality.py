"""Greedy vLLM P/D through PdserveConnector equals one monolithic vLLM, token for token.

One P, one D and one monolithic instance serve the whole module; the transfer mode is
chosen per request (the P leg's `transfer_mode`), so push and pull run on the same pair.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator

import httpx
import pytest

from pdserve.ports import free_port
from tests.vllm.harness import (
    VllmServer,
    connector_config,
    gather_limited,
    mono_generate,
    pd_generate,
    start_all,
    write_checkpoint,
)

NUM_PROMPTS = 24
MAX_TOKENS = 12
CONCURRENCY = 4
TRANSPORT = "tcp"
pytestmark = pytest.mark.timeout(1800)


class Cluster:
    def __init__(self, p: VllmServer, d: VllmServer, mono: VllmServer) -> None:
        self.p, self.d, self.mono = p, d, mono


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("vllm-eq")
    model = write_checkpoint(tmp / "ckpt")
    p = VllmServer(
        "prefill", model, tmp, connector_config("push", free_port(), transport=TRANSPORT)
    )
    d = VllmServer("decode", model, tmp, connector_config("push", free_port(), transport=TRANSPORT))
    mono = VllmServer("mono", model, tmp, None)
    start_all([p, d, mono])
    try:
        yield Cluster(p, d, mono)
    finally:
        for s in (p, d, mono):
            s.stop()


def prompts(seed: int) -> list[list[int]]:
    """Random token ids, lengths 1..2000 (both ends included)."""
    rng = random.Random(seed)
    lengths = [1, 2000] + [rng.randint(2, 1999) for _ in range(NUM_PROMPTS - 2)]
    return [[rng.randrange(3, 250) for _ in range(n)] for n in lengths]


async def run_both(c: Cluster, ps: list[list[int]], mode: str) -> tuple[list, list]:
    async with httpx.AsyncClient(timeout=300) as client:
        pd = await gather_limited(
            [pd_generate(client, c.p, c.d, p, MAX_TOKENS, mode) for p in ps], CONCURRENCY
        )
        mono = await gather_limited(
            [mono_generate(client, c.mono, p, MAX_TOKENS) for p in ps], CONCURRENCY
        )
    return pd, mono


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_pd_equals_monolithic(cluster: Cluster, mode: str) -> None:
    ps = prompts(seed={"push": 1, "pull": 2}[mode])
    before = cluster.d.metric("vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    pd, mono = asyncio.run(run_both(cluster, ps, mode))
    errors = [r for r in pd + mono if isinstance(r, BaseException)]
    assert not errors, errors[:3]
    mismatched = [i for i, (a, b) in enumerate(zip(pd, mono, strict=True)) if a != b]
    assert not mismatched, [(len(ps[i]), pd[i], mono[i]) for i in mismatched[:3]]
    assert all(len(t) == MAX_TOKENS for t in pd)
    # Every prompt token reached D through the connector (random prompts share no prefix)
    after = cluster.d.metric("vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    assert after - before == sum(len(p) for p in ps)
    # Nothing leaked: both sides give every block back
    assert cluster.p.wait_kv_usage_zero() == 0
    assert cluster.d.wait_kv_usage_zero() == 0
