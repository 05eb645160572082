"""vLLM servers for the connector tests: start, wait, stop or kill -9 by PID; a P/D driver.

Each server is `python -m vllm.entrypoints.openai.api_server` from this interpreter (the
.venv-vllm one), in its own session, so that stopping its PID's process group stops its
engine core and worker too and nothing else. Every port is a free one on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdserve.ports import free_port

REPO = Path(__file__).resolve().parents[2]


def _has_vllm() -> bool:
    """vLLM's server module is importable (a bare `vllm` could be this tests folder, which
    pytest's path insertion makes look like a namespace package)."""
    try:
        return importlib.util.find_spec("vllm.entrypoints.openai.api_server") is not None
    except ImportError:
        return False


HAS_VLLM = _has_vllm()
# Every module here carries these: the vllm marker, and a clear skip where vLLM is missing
VLLM_MARKS = [
    pytest.mark.vllm,
    pytest.mark.slow,
    pytest.mark.skipif(
        not HAS_VLLM,
        reason="vLLM is not installed in this interpreter: build it with `make venv-vllm` "
        "and run `.venv-vllm/bin/python -m pytest -o addopts= tests/vllm`",
    ),
]
STARTUP_TIMEOUT_S = 600.0
# The session's tcp pair's connector settings (conftest.py), short enough for the failure
# tests to wait them out: P frees blocks nobody decodes after LEASE_S; D gives up on a
# silent P within about 10 s.
LEASE_S = 8.0
QUICK_HEARTBEATS = {"heartbeat_s": 1.0, "heartbeat_misses": 10, "handshake_timeout_s": 15.0}
# vLLM's CPU backend otherwise compiles the model at every start (about 35 s of CPU here);
# what the tests check does not depend on it. `pdserve serve` passes it through.
EAGER = "--vllm-arg=--enforce-eager"
# Small KV pool; one unpinned compute thread per server: several servers share a few cores
# in CI, and vLLM's default binding puts every server's threads on the same cores.
QUIET_ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
}


def write_checkpoint(out: Path) -> Path:
    """A random Qwen3 small enough for CPU, with weights scaled up so that greedy output
    depends on the whole prompt (the default init makes every prompt decode one token)."""
    import torch
    from safetensors.torch import load_file, save_file

    from pdserve.bench.make_checkpoint import CheckpointShape
    from pdserve.bench.make_checkpoint import write_checkpoint as write

    shape = CheckpointShape(
        layers=2,
        hidden=256,
        intermediate=512,
        heads=4,
        kv_heads=2,
        head_dim=64,
        vocab_size=None,
        max_positions=4096,
        dtype="float32",
        seed=0,
    )
    write(shape, out)
    weights = load_file(out / "model.safetensors")
    scaled = {k: (v * 6 if v.dim() == 2 else v).contiguous() for k, v in weights.items()}
    save_file(scaled, out / "model.safetensors", metadata={"format": "pt"})
    del torch
    return out


def connector_config(mode: str, side_port: int, **extra: Any) -> str:
    return json.dumps(
        {
            "kv_connector": "PdserveConnector",
            "kv_connector_module_path": "pdserve.vllm.connector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"mode": mode, "side_port": side_port, **extra},
        }
    )


class VllmServer:
    """One vLLM OpenAI server (api server + engine core + worker), owned by the test."""

    def __init__(self, name: str, model: Path, logs: Path, kv_config: str | None) -> None:
        self.name = name
        self.model = str(model)
        self.log = logs / f"{name}.log"
        self.kv_config = kv_config
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32"]
        cmd += ["--max-model-len", "4096", "--enforce-eager", "--seed", "0"]
        if self.kv_config:
            cmd += ["--kv-transfer-config", self.kv_config]
        return cmd

    def start(self) -> VllmServer:
        env = {**os.environ, **QUIET_ENV, "PYTHONPATH": str(REPO)}
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                self.command(),
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return self

    def wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        assert self.proc is not None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited {self.proc.returncode}: {self.tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise RuntimeError(f"{self.name} not healthy in {STARTUP_TIMEOUT_S} s: {self.tail()}")

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def kill9(self) -> None:
        """SIGKILL the server's whole process group (its engine core and worker)."""
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of `name` whose labels include `labels`."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        total = 0.0
        for line in text.splitlines():
            m = re.match(rf"^{re.escape(name)}\{{(.*)\}} (\S+)$", line)
            if m and all(f'{k}="{v}"' in m.group(1) for k, v in labels.items()):
                total += float(m.group(2))
        return total

    def wait_kv_usage_zero(self, timeout_s: float = 60.0) -> float:
        """Poll `vllm:kv_cache_usage_perc` until 0; the last value read."""
        deadline = time.monotonic() + timeout_s
        while True:
            usage = self.metric("vllm:kv_cache_usage_perc")
            if usage == 0 or time.monotonic() > deadline:
                return usage
            time.sleep(0.5)


class PdserveServeMono(VllmServer):
    """A monolithic `pdserve serve --engine vllm` (it execs vLLM's server in its own PID),
    eager like the harness's servers: the reference the tests compare P/D with. Prefix
    caching stays off there (pdserve turns it off): prompts of the engine tests share
    prefixes, and a prefix hit computes a prompt in other chunks than P/D does."""

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "pdserve", "serve", "--engine", "vllm", "--model", self.model]
        cmd += ["--port", str(self.port), "--dtype", "float32", "--max-model-len", "4096"]
        return [*cmd, "--threads", "1", "--vllm-python", sys.executable, EAGER]


class Pair:
    """One P and one D vLLM server with PdserveConnector, owned by the fixture that made it."""

    def __init__(self, p: VllmServer, d: VllmServer) -> None:
        self.p, self.d = p, d

    def stop(self) -> None:
        self.p.stop()
        self.d.stop()


def start_all(servers: list[VllmServer]) -> None:
    """Start every server, then wait for each (they boot in parallel)."""
    for s in servers:
        s.start()
    try:
        for s in servers:
            s.wait_ready()
    except BaseException:
        for s in servers:
            s.stop()
        raise


def body(model: str, prompt: list[int], max_tokens: int, **extra: Any) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
        **extra,
    }


class PdError(RuntimeError):
    """A leg answered with an error (status and body in the message)."""


async def prefill(client: httpx.AsyncClient, p: VllmServer, prompt: list[int], mode: str) -> dict:
    """P leg: prefill with max_tokens=1; the params D needs."""
    params = {"do_remote_decode": True, "transfer_mode": mode}
    r = await client.post(
        f"{p.url}/v1/completions", json=body(p.model, prompt, 1, kv_transfer_params=params)
    )
    if r.status_code != 200:
        raise PdError(f"P {r.status_code}: {r.text[:300]}")
    return r.json()["kv_transfer_params"]


async def decode(
    client: httpx.AsyncClient, d: VllmServer, prompt: list[int], max_tokens: int, kv: dict
) -> list[int]:
    r = await client.post(
        f"{d.url}/v1/completions", json=body(d.model, prompt, max_tokens, kv_transfer_params=kv)
    )
    if r.status_code != 200:
        raise PdError(f"D {r.status_code}: {r.text[:300]}")
    choice = r.json()["choices"][0]
    if choice.get("finish_reason") not in ("length", "stop"):
        raise PdError(f"D finished with {choice.get('finish_reason')!r}")
    return choice["token_ids"]


async def pd_generate(
    client: httpx.AsyncClient,
    p: VllmServer,
    d: VllmServer,
    prompt: list[int],
    max_tokens: int,
    mode: str,
) -> list[int]:
    """What a router does: P leg, then D leg with P's kv_transfer_params."""
    kv = await prefill(client, p, prompt, mode)
    return await decode(client, d, prompt, max_tokens, kv)


async def mono_generate(
    client: httpx.AsyncClient, m: VllmServer, prompt: list[int], max_tokens: int
) -> list[int]:
    r = await client.post(f"{m.url}/v1/completions", json=body(m.model, prompt, max_tokens))
    r.raise_for_status()
    return r.json()["choices"][0]["token_ids"]


async def gather_limited(coros: list, limit: int) -> list:
    """Run `coros` at most `limit` at a time; results (or exceptions) in order."""
    sem = asyncio.Semaphore(limit)

    async def one(c):
        async with sem:
            return await c

    return await asyncio.gather(*(one(c) for c in coros), return_exceptions=True)
