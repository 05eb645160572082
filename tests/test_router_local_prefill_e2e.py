"""Conditional disaggregation with real processes: a monolithic oracle, a push P/D pair and
a router with `--local-prefill-below`. Short prompts are prefilled on D (P's counters stay
at zero), long ones go through P; greedy output equals the monolithic instance's either
way. Also: a decode instance's `/tokenize` and its extended `/load` report."""

from __future__ import annotations

import random
import time
from contextlib import ExitStack

import httpx
import pytest
from procs import PdserveProcess, free_port, greedy_body

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

THRESHOLD = 64
MAX_TOKENS = 12


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    lengths = [1, 5, 63, 64, 65, 300, 17, 40]
    return [[rng.randrange(3, 250) for _ in range(n)] for n in lengths]


def _complete(url: str, ids: list[int]) -> list[int]:
    r = httpx.post(f"{url}/v1/completions", json=greedy_body(ids, MAX_TOKENS), timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def _finished_requests(url: str) -> float:
    """Completion requests the instance has answered (its own Prometheus counter)."""
    total = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith("pdserve_requests_total{") and "completions" in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def _counts_reach(url: str, n: int, timeout_s: float = 30.0) -> None:
    """Until the instance has counted `n` answered requests (the counter moves once the
    response is sent, which may be after the client has read it); fails if it exceeds n."""
    deadline = time.monotonic() + timeout_s
    while (count := _finished_requests(url)) < n and time.monotonic() < deadline:
        time.sleep(0.05)
    assert count == n, f"{url} answered {count} requests, expected {n}"


def test_short_prompts_are_prefilled_on_decode_with_monolithic_output() -> None:
    instance = ["--threads", "1", "--model", "builtin:tiny"]
    p_args = ["serve", "--role", "prefill", "--kv-transfer", "push", *instance]
    router_args = ["router", "--kv-transfer", "push", "--local-prefill-below", str(THRESHOLD)]
    with ExitStack() as stack:
        mono = stack.enter_context(PdserveProcess(["serve", *instance]))
        p = stack.enter_context(PdserveProcess([*p_args, "--side-channel-port", str(free_port())]))
        d = stack.enter_context(
            PdserveProcess(["serve", "--role", "decode", "--kv-transfer", "push", *instance])
        )
        router = stack.enter_context(
            PdserveProcess([*router_args, "--prefill", p.url, "--decode", d.url])
        )
        # A decode instance counts text the way it would prefill it (byte-level tokenizer).
        r = httpx.post(f"{d.url}/tokenize", json={"prompt": "hello"}, timeout=10)
        assert r.status_code == 200 and r.json()["count"] >= 5
        prompts = _prompts()
        short = [ids for ids in prompts if len(ids) < THRESHOLD]
        long = [ids for ids in prompts if len(ids) >= THRESHOLD]
        expected = {tuple(ids): _complete(mono.url, ids) for ids in prompts}

        for ids in short:
            assert _complete(router.url, ids) == expected[tuple(ids)], f"{len(ids)} tokens"
        _counts_reach(d.url, len(short))
        assert _finished_requests(p.url) == 0  # P never saw a short prompt

        for ids in long:
            assert _complete(router.url, ids) == expected[tuple(ids)], f"{len(ids)} tokens"
        _counts_reach(p.url, len(long))  # P's answer may be counted after D's reply

        load = httpx.get(f"{d.url}/load", timeout=5).json()
        assert load["kv_blocks_used"] == 0 and load["decode_tokens_left"] == 0
        assert "decode_steps_per_s" in load and "prefill_tokens_per_s" in load
