"""Routing through a running router against fake instances: local prefill (conditional
disaggregation), load_aware and least_tokens choices, the unreported-burst correction."""

from __future__ import annotations

import argparse
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from test_router_fake_instance import FakeInstance, running_router, wait_for

from pdserve.router.config import DEFAULT_LOCAL_PREFILL_BELOW
from pdserve.router.prompt_size import BYTES_PER_TOKEN_CEILING
from pdserve.router.serve_args import add_arguments, config_from_args

# Slow (a router and fake instances served over real sockets (uvicorn threads)): `make test` runs
# it, the unit tier (`make test-fast`) does not.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(60)]


def _ids(n: int) -> list[int]:
    return [5 + i % 200 for i in range(n)]


def _post(router: str, body: dict) -> httpx.Response:
    return httpx.post(f"{router}/v1/completions", json=body, timeout=30)


def _router_instances(router: str) -> list[dict]:
    return httpx.get(f"{router}/router/instances", timeout=5).json()


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_short_prompts_skip_prefill_long_ones_do_not(mode: str) -> None:
    with (
        FakeInstance("prefill") as p,
        FakeInstance("decode") as d,
        running_router([p], [d], mode, local_prefill_below=64) as r,
    ):
        short = _post(r, {"prompt": _ids(63), "max_tokens": 4, "stream": True})
        assert short.status_code == 200 and "[DONE]" in short.text
        assert p.received == []  # P never saw it
        assert len(d.received) == 1
        assert "kv_transfer_params" not in d.received[0].body  # a plain request: D prefills
        long = _post(r, {"prompt": _ids(64), "max_tokens": 4, "stream": True})
        assert long.status_code == 200
        assert len(p.received) == 1
        assert d.received[1].params["do_remote_prefill"] is True
        metrics = httpx.get(f"{r}/metrics").text
        assert 'pdserve_router_requests_total{mode="local",status="200"} 1.0' in metrics
        assert d.tokenized == 0  # token ids are counted by the router itself


def test_client_kv_params_are_dropped_on_a_local_prefill() -> None:
    with (
        FakeInstance("prefill") as p,
        FakeInstance("decode") as d,
        running_router([p], [d], "push", local_prefill_below=64) as r,
    ):
        body = {"prompt": _ids(3), "kv_transfer_params": {"do_remote_prefill": True}}
        assert _post(r, body).status_code == 200
    assert "kv_transfer_params" not in d.received[0].body


def test_text_prompts_are_measured_by_a_decode_instance() -> None:
    with (
        FakeInstance("prefill") as p,
        FakeInstance("decode") as d,
        running_router([p], [d], "push", local_prefill_below=10) as r,
    ):
        assert _post(r, {"prompt": "short", "max_tokens": 2}).status_code == 200
        assert (len(p.received), d.tokenized) == (0, 1)
        assert _post(r, {"prompt": "a much longer prompt", "max_tokens": 2}).status_code == 200
        # push: the P leg goes out beside D's, so D's stream can end before P has logged it
        wait_for(lambda: len(p.received) == 1)
        assert (len(p.received), d.tokenized) == (1, 2)


def test_no_tokenize_round_trip_when_local_prefill_is_off() -> None:
    with (
        FakeInstance("prefill") as p,
        FakeInstance("decode") as d,
        running_router([p], [d], "push") as r,
    ):
        assert _post(r, {"prompt": "short", "max_tokens": 2}).status_code == 200
        wait_for(lambda: len(p.received) == 1)  # P's leg may trail D's short stream
    assert (len(p.received), d.tokenized) == (1, 0)


def test_no_tokenize_round_trip_for_a_text_far_above_the_threshold() -> None:
    with (
        FakeInstance("prefill") as p,
        FakeInstance("decode") as d,
        running_router([p], [d], "push", local_prefill_below=10) as r,
    ):
        long_text = "word " * (10 * BYTES_PER_TOKEN_CEILING // 5)  # 160 bytes: >= 10 x 16
        assert _post(r, {"prompt": long_text, "max_tokens": 2}).status_code == 200
        wait_for(lambda: len(p.received) == 1)  # P's leg may trail D's short stream
        assert (len(p.received), d.tokenized) == (1, 0)  # disaggregated without asking D
        assert _post(r, {"prompt": long_text[:-1], "max_tokens": 2}).status_code == 200
        assert d.tokenized == 1  # one byte shorter: D is asked


def test_local_prefill_is_on_by_default_from_the_command_line() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--prefill", "a:1", "--decode", "b:2", "--kv-transfer", "push"])
    cfg = config_from_args(args)
    assert cfg.local_prefill_below == DEFAULT_LOCAL_PREFILL_BELOW > 0
    args = parser.parse_args(["--prefill", "a:1", "--decode", "b:2", "--kv-transfer", "push",
                              "--local-prefill-below", "0"])  # fmt: skip
    assert config_from_args(args).local_prefill_below == 0


def _report(steps: float, running: int = 1, left: int = 10) -> dict[str, float]:
    return {
        "num_running": running,
        "num_waiting": 0,
        "num_waiting_for_kv": 0,
        "kv_blocks_used": 0,
        "kv_blocks_total": 100,
        "decode_tokens_left": left,
        "prefill_tokens_left": 0,
        "decode_steps_per_s": steps,
        "prefill_tokens_per_s": 5000.0,
    }


def test_load_aware_sends_work_to_the_faster_decode_instance() -> None:
    with (
        FakeInstance("prefill") as p,
        FakeInstance("decode", load=_report(steps=100.0)) as fast,
        FakeInstance("decode", load=_report(steps=10.0)) as slow,
        running_router([p], [fast, slow], "push", policy="load_aware") as r,
    ):
        wait_for(lambda: all(i["load"] is not None for i in _router_instances(r)))
        for _ in range(4):
            assert _post(r, {"prompt": _ids(8), "max_tokens": 4}).status_code == 200
    assert (len(fast.received), len(slow.received)) == (4, 0)


@pytest.mark.parametrize("policy", ["load_aware", "least_tokens"])
def test_a_burst_between_polls_is_spread(policy: str) -> None:
    """Both D's report idle and reports stop changing: only the router's own count of the
    legs it sent since (unreported) can keep the burst from landing on one instance."""
    hold = threading.Event()
    with (
        FakeInstance("prefill") as p,
        # Both hold every leg until the test releases them (hold_timeout_s: not before).
        FakeInstance(
            "decode", hold=hold, hold_timeout_s=600, load=_report(steps=50.0, running=0, left=0)
        ) as d1,
        # d2 reports a slightly lower rate: without the correction every leg goes to d1.
        FakeInstance(
            "decode", hold=hold, hold_timeout_s=600, load=_report(steps=49.0, running=0, left=0)
        ) as d2,
        # Reports stay as they are during the burst: one poll at start-up and none after it
        # (with a short interval, a poll landing mid-burst on a slow machine would mark the
        # legs sent so far as reported, and the fakes' reports do not count them).
        running_router([p], [d1, d2], "push", policy=policy, load_interval_s=3600.0) as r,
        ThreadPoolExecutor(6) as pool,
    ):
        wait_for(lambda: all(i["load"] is not None for i in _router_instances(r)))
        body = {"prompt": _ids(8), "max_tokens": 32, "stream": True}
        futures = [pool.submit(_post, r, body) for _ in range(6)]
        wait_for(lambda: len(d1.received) + len(d2.received) == 6)
        hold.set()
        assert all(f.result().status_code == 200 for f in futures)
    assert (len(d1.received), len(d2.received)) == (3, 3)
