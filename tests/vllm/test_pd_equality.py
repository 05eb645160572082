"""Greedy vLLM P/D through PdserveConnector equals one monolithic vLLM, token for token.

The monolithic instance answers every prompt of the module first and is stopped (fewer
servers at once on a small CI host); then one P and one D serve the whole module. The
transfer mode is chosen per request (the P leg's `transfer_mode`), so push and pull run on
the same pair.
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
    VllmServer,
    connector_config,
    gather_limited,
    mono_generate,
    pd_generate,
    start_all,
    write_checkpoint,
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


TRANSPORTS = [
    "tcp",
    pytest.param(
        "nixl",
        marks=[
            pytest.mark.nixl,
            pytest.mark.skipif(not _nixl_available(), reason="nixl not installed"),
        ],
    ),
]


class Cluster:
    def __init__(self, p: VllmServer, d: VllmServer, expected: dict[str, list]) -> None:
        self.p, self.d, self.expected = p, d, expected


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
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, list]]:
    """The checkpoint, and the monolithic instance's answers to every prompt set."""
    tmp = tmp_path_factory.mktemp("vllm-eq")
    model = write_checkpoint(tmp / "ckpt")
    mono = VllmServer("mono", model, tmp, None)
    start_all([mono])
    try:
        expected = {mode: asyncio.run(run_mono(mono, prompts(s))) for mode, s in SEEDS.items()}
    finally:
        mono.stop()
    return model, expected


@pytest.fixture(scope="module", params=TRANSPORTS)
def cluster(
    request: pytest.FixtureRequest, reference: tuple[Path, dict[str, list]]
) -> Iterator[Cluster]:
    model, expected = reference
    tmp = model.parent
    conf = {"transport": request.param}
    name = request.param
    p = VllmServer(f"prefill-{name}", model, tmp, connector_config("push", free_port(), **conf))
    d = VllmServer(f"decode-{name}", model, tmp, connector_config("push", free_port(), **conf))
    start_all([p, d])
    try:
        yield Cluster(p, d, expected)
    finally:
        p.stop()
        d.stop()


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
