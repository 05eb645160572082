"""`pdserve serve --engine vllm` and `pdserve up --engine vllm`, with real vLLM servers.

Run with the .venv-vllm interpreter (`.venv-vllm/bin/python -m pytest -o addopts=
tests/vllm/test_engine_vllm.py`); under an interpreter without vLLM every test is skipped
with the reason. The reference is the session's monolithic `pdserve serve --engine vllm`
(conftest.py); each test then starts a 1P1D cluster behind pdserve's router: vLLM's
NixlConnector (pull), and pdserve's connector in push mode (both legs at once). Every
instance runs eager (`EAGER`) in float32, like the reference (vLLM would pick bfloat16).
"""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from pdserve.launcher import Cluster, ClusterConfig
from tests.vllm.harness import EAGER, VLLM_MARKS, VllmServer

pytestmark = [*VLLM_MARKS, pytest.mark.timeout(1800)]

STARTUP_TIMEOUT_S = 900.0
MAX_MODEL_LEN = "2048"
# Prompts of different lengths (token ids; the byte tokenizer has 259), greedy.
PROMPTS = [[(7 * i + 3) % 250 + 3 for i in range(n)] for n in (24, 150, 700)]
# Push through the router: varied lengths, sent at once, so that P queues some prefills
# while D already registered its blocks for them.
PUSH_LENGTHS = (1, 7, 60, 200, 450, 900, 1400, 2000)
PUSH_PROMPTS = [[(11 * i + 5) % 250 + 3 for i in range(n)] for n in PUSH_LENGTHS]
MAX_TOKENS = 12


def _greedy(url: str, model: str, prompt: list[int], cluster: Cluster | None = None) -> list[int]:
    """Greedy token ids; a failure through `cluster` carries every process's log tail."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=600)
    assert r.status_code == 200, r.text + (_tails(cluster) if cluster else "")
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length"
    return list(choice["token_ids"])


def _tails(cluster: Cluster) -> str:
    return "".join(f"\n--- {p.name} ({p.log_path}):\n{p.log_tail()}" for p in cluster.processes)


def test_serve_engine_vllm_answers_a_completion(mono: VllmServer) -> None:
    body = {"model": mono.model, "prompt": "hello", "max_tokens": 5, "temperature": 0}
    r = httpx.post(f"{mono.url}/v1/completions", json=body, timeout=600)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 5
    assert r.json()["choices"][0]["finish_reason"] == "length"
    reference = [_greedy(mono.url, mono.model, p) for p in PROMPTS]
    assert all(len(tokens) == MAX_TOKENS for tokens in reference)
    assert len({tuple(t) for t in reference}) > 1  # outputs depend on the prompt


def test_up_engine_vllm_nixl_pull_equals_monolithic(
    checkpoint: Path, mono: VllmServer, tmp_path: Path
) -> None:
    reference = [_greedy(mono.url, mono.model, p) for p in PROMPTS]
    config = ClusterConfig(
        kv_transfer="pull",
        engine="vllm",
        connector="nixl",
        vllm_python=sys.executable,
        model=str(checkpoint),
        local_prefill_below=0,  # every prompt goes through P and D
        instance_args=("--max-model-len", MAX_MODEL_LEN, "--dtype", "float32", EAGER),
        log_dir=tmp_path / "logs",
        startup_timeout_s=STARTUP_TIMEOUT_S,
        stop_timeout_s=60,
    )
    with Cluster(config) as cluster:
        got = [_greedy(cluster.router_url, str(checkpoint), p, cluster) for p in PROMPTS]
        metrics = httpx.get(f"{cluster.router_url}/metrics").text
        d_log = cluster.instance("decode-0").log_path.read_text()
    assert got == reference
    assert f'pdserve_router_requests_total{{mode="pull",status="200"}} {len(PROMPTS)}.0' in metrics
    assert "NIXL compatibility check passed" in d_log  # D really read P's KV over NIXL


def test_up_engine_vllm_pdserve_push_legs_at_once_equals_monolithic(
    checkpoint: Path, mono: VllmServer, tmp_path: Path
) -> None:
    reference = [_greedy(mono.url, mono.model, p) for p in PUSH_PROMPTS]
    # pdserve's connector, push: the router sends P's and D's legs at once; D registers its
    # blocks at admission and P writes into them once its prefill ends.
    config = ClusterConfig(
        kv_transfer="push",
        engine="vllm",
        connector="pdserve",
        vllm_python=sys.executable,
        model=str(checkpoint),
        local_prefill_below=0,  # every prompt goes through P and D
        instance_args=("--max-model-len", MAX_MODEL_LEN, "--dtype", "float32", EAGER),
        log_dir=tmp_path / "logs",
        startup_timeout_s=STARTUP_TIMEOUT_S,
        stop_timeout_s=60,
    )
    with Cluster(config) as cluster:
        url, model = cluster.router_url, str(checkpoint)
        with ThreadPoolExecutor(len(PUSH_PROMPTS)) as pool:  # all at once: P queues them
            got = list(pool.map(lambda p: _greedy(url, model, p, cluster), PUSH_PROMPTS))
        metrics = httpx.get(f"{url}/metrics").text
        p_log = cluster.instance("prefill-0").log_path.read_text()
        d_log = cluster.instance("decode-0").log_path.read_text()
    assert got == reference
    ok = f'pdserve_router_requests_total{{mode="push",status="200"}} {len(PUSH_PROMPTS)}.0'
    assert ok in metrics
    # D's registration reached P while P still computed the prompt (the point of push)
    assert "arrived before its prefill ended" in p_log
    assert "did not arrive" not in d_log  # no receive failed (D would have recomputed)
