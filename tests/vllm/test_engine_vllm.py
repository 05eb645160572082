"""`pdserve serve --engine vllm` and `pdserve up --engine vllm`, with real vLLM servers.

Run with the .venv-vllm interpreter (`.venv-vllm/bin/python -m pytest -o addopts=
tests/vllm/test_engine_vllm.py`); under an interpreter without vLLM, and without the
checkout's .venv-vllm, every test is skipped with the reason. vLLM's CPU servers take
minutes to start here, so they run one at a time: a monolithic instance (the reference),
then 1P1D clusters behind pdserve's router: vLLM's NixlConnector (pull), and pdserve's
connector in push mode (both legs at once).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdserve.launcher import Cluster, ClusterConfig
from pdserve.ports import free_port
from pdserve.vllm.instance import VllmNotFound, find_vllm_python
from tests.vllm.harness import write_checkpoint

try:
    VLLM_PYTHON: str | None = find_vllm_python(None)
except VllmNotFound as exc:
    VLLM_PYTHON, WHY = None, str(exc)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(1800),
    pytest.mark.skipif(VLLM_PYTHON is None, reason=f"no vLLM: {WHY if not VLLM_PYTHON else ''}"),
]

STARTUP_TIMEOUT_S = 900.0
MAX_MODEL_LEN = "2048"
# Prompts of different lengths (token ids; the byte tokenizer has 259), greedy.
PROMPTS = [[(7 * i + 3) % 250 + 3 for i in range(n)] for n in (24, 150, 700)]
# Push through the router: varied lengths, sent at once, so that P queues some prefills
# while D already registered its blocks for them.
PUSH_LENGTHS = (1, 7, 60, 200, 450, 900, 1400, 2000)
PUSH_PROMPTS = [[(11 * i + 5) % 250 + 3 for i in range(n)] for n in PUSH_LENGTHS]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("vllm-engine") / "ckpt")


def _greedy(url: str, model: str, prompt: list[int]) -> list[int]:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length"
    return list(choice["token_ids"])


def _wait_healthy(proc: subprocess.Popen[bytes], url: str, log: Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"vLLM exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(2)
    pytest.fail(f"vLLM not healthy after {STARTUP_TIMEOUT_S} s:\n{log.read_text()[-3000:]}")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the instance's PID; its own session's group if it does not stop in time
    (it was started in a session of its own, so the group is its engine core and worker)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@dataclass(frozen=True)
class MonolithicRun:
    """What the monolithic `pdserve serve --engine vllm` answered before it was stopped."""

    completion: dict[str, Any]  # its answer to a plain text completion
    reference: list[list[int]]  # its greedy tokens for PROMPTS
    push_reference: list[list[int]]  # and for PUSH_PROMPTS


@pytest.fixture(scope="module")
def monolithic(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> MonolithicRun:
    """Start `pdserve serve --engine vllm` (monolithic) on a free port, ask it everything
    the tests need, and stop it by PID (three vLLM servers on two cores would be too many
    for the cluster that follows)."""
    port = free_port()
    log = tmp_path_factory.mktemp("mono-log") / "mono.log"
    cmd = [sys.executable, "-m", "pdserve", "serve", "--engine", "vllm", "--model",
           str(checkpoint), "--port", str(port), "--max-model-len", MAX_MODEL_LEN,
           "--threads", "1", "--vllm-python", str(VLLM_PYTHON)]  # fmt: skip
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_healthy(proc, url, log)
        body = {"model": str(checkpoint), "prompt": "hello", "max_tokens": 5, "temperature": 0}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
        assert r.status_code == 200, r.text
        reference = [_greedy(url, str(checkpoint), p) for p in PROMPTS]
        push_reference = [_greedy(url, str(checkpoint), p) for p in PUSH_PROMPTS]
        return MonolithicRun(r.json(), reference, push_reference)
    finally:
        _stop(proc)


def test_serve_engine_vllm_answers_a_completion(monolithic: MonolithicRun) -> None:
    assert monolithic.completion["usage"]["completion_tokens"] == 5
    assert monolithic.completion["choices"][0]["finish_reason"] == "length"
    assert all(len(tokens) == MAX_TOKENS for tokens in monolithic.reference)
    assert len({tuple(t) for t in monolithic.reference}) > 1  # outputs depend on the prompt


def test_up_engine_vllm_nixl_pull_equals_monolithic(
    checkpoint: Path, monolithic: MonolithicRun, tmp_path: Path
) -> None:
    config = ClusterConfig(
        kv_transfer="pull",
        engine="vllm",
        connector="nixl",
        vllm_python=VLLM_PYTHON,
        model=str(checkpoint),
        local_prefill_below=0,  # every prompt goes through P and D
        instance_args=("--max-model-len", MAX_MODEL_LEN),
        log_dir=tmp_path / "logs",
        startup_timeout_s=STARTUP_TIMEOUT_S,
        stop_timeout_s=60,
    )
    with Cluster(config) as cluster:
        got = [_greedy(cluster.router_url, str(checkpoint), p) for p in PROMPTS]
        metrics = httpx.get(f"{cluster.router_url}/metrics").text
        d_log = cluster.instance("decode-0").log_path.read_text()
    assert got == monolithic.reference
    assert f'pdserve_router_requests_total{{mode="pull",status="200"}} {len(PROMPTS)}.0' in metrics
    assert "NIXL compatibility check passed" in d_log  # D really read P's KV over NIXL


def test_up_engine_vllm_pdserve_push_legs_at_once_equals_monolithic(
    checkpoint: Path, monolithic: MonolithicRun, tmp_path: Path
) -> None:
    # pdserve's connector, push: the router sends P's and D's legs at once; D registers its
    # blocks at admission and P writes into them once its prefill ends.
    config = ClusterConfig(
        kv_transfer="push",
        engine="vllm",
        connector="pdserve",
        vllm_python=VLLM_PYTHON,
        model=str(checkpoint),
        local_prefill_below=0,  # every prompt goes through P and D
        instance_args=("--max-model-len", MAX_MODEL_LEN),
        log_dir=tmp_path / "logs",
        startup_timeout_s=STARTUP_TIMEOUT_S,
        stop_timeout_s=60,
    )
    with Cluster(config) as cluster:
        url, model = cluster.router_url, str(checkpoint)
        with ThreadPoolExecutor(len(PUSH_PROMPTS)) as pool:  # all at once: P queues them
            got = list(pool.map(lambda p: _greedy(url, model, p), PUSH_PROMPTS))
        metrics = httpx.get(f"{url}/metrics").text
        p_log = cluster.instance("prefill-0").log_path.read_text()
        d_log = cluster.instance("decode-0").log_path.read_text()
    assert got == monolithic.push_reference
    ok = f'pdserve_router_requests_total{{mode="push",status="200"}} {len(PUSH_PROMPTS)}.0'
    assert ok in metrics
    # D's registration reached P while P still computed the prompt (the point of push)
    assert "arrived before its prefill ended" in p_log
    assert "did not arrive" not in d_log  # no receive failed (D would have recomputed)
