"""tests/vllm: PdserveConnector inside real vLLM servers. Needs the .venv-vllm interpreter.

Run with `make test` (it builds .venv-vllm when missing) or
`.venv-vllm/bin/python -m pytest -o addopts= tests/vllm`. Under an interpreter without vLLM
every test here is skipped with that reason (`harness.VLLM_MARKS`, on every module).

vLLM's CPU servers take close to a minute each to start here, so the session shares them:
one checkpoint, one monolithic reference (an idle vLLM server uses no CPU, so it stays up),
and one tcp P/D pair (test_pd_equality's, then test_pd_failures').
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.ports import free_port
from tests.vllm.harness import (
    LEASE_S,
    QUICK_HEARTBEATS,
    Pair,
    PdserveServeMono,
    VllmServer,
    connector_config,
    start_all,
    write_checkpoint,
)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("vllm") / "ckpt")


@pytest.fixture(scope="session")
def mono(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    """The monolithic `pdserve serve --engine vllm` every P/D answer is compared with."""
    server = PdserveServeMono("mono", checkpoint, tmp_path_factory.mktemp("mono"), None)
    start_all([server])
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def tcp_pair(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    """P and D with PdserveConnector over tcp; push or pull is chosen per request."""
    logs = tmp_path_factory.mktemp("tcp-pair")
    p_conf = connector_config("push", free_port(), lease_s=LEASE_S)
    d_conf = connector_config("push", free_port(), **QUICK_HEARTBEATS)
    pair = Pair(
        VllmServer("prefill", checkpoint, logs, p_conf),
        VllmServer("decode", checkpoint, logs, d_conf),
    )
    start_all([pair.p, pair.d])
    try:
        yield pair
    finally:
        pair.stop()
