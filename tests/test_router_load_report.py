"""The instance's load report (`GET /load`): tokens left and measured rates (`LoadMeter`)."""

from __future__ import annotations

import msgspec
from hypothesis import given
from hypothesis import strategies as st

from pdserve.engine.types import EngineStats, LiveRequest
from pdserve.server.load_report import LoadMeter, LoadReport
from pdserve.transfer.params import InstanceLoad

STATS = EngineStats(num_running=1, num_waiting=0, kv_blocks_used=3, kv_blocks_total=50)


def req(
    rid: str, prompt: int, outputs: int, computed: int, max_tokens: int, remote=False
) -> LiveRequest:
    """A live request as the engine reports it (`LLMEngine.live_requests`)."""
    prompt = 0 if remote else prompt  # KV from a prefill instance: nothing to compute here
    return LiveRequest(
        request_id=rid,
        outputs=outputs,
        computed=min(computed, prompt),
        prompt=prompt,
        decode_left=max(0, max_tokens - outputs),
    )


def test_tokens_left_count_outputs_owed_and_local_prompts_only() -> None:
    meter = LoadMeter()
    requests = [
        req("a", prompt=100, outputs=10, computed=100, max_tokens=64),  # decoding
        req("b", prompt=50, outputs=0, computed=20, max_tokens=8),  # prefilling
        req("c", prompt=500, outputs=0, computed=0, max_tokens=16, remote=True),  # KV coming
    ]
    r = meter.report(STATS, requests, now=10.0)
    assert r.decode_tokens_left == 54 + 8 + 16
    assert r.prefill_tokens_left == 30
    assert (r.decode_steps_per_s, r.prefill_tokens_per_s) == (None, None)  # one sample only
    assert (r.kv_blocks_used, r.num_running) == (3, 1)


@given(st.integers(1, 50), st.floats(0.05, 2.0))
def test_step_rate_is_the_largest_output_growth_per_second(steps: int, dt: float) -> None:
    meter = LoadMeter()
    meter.report(STATS, [req("a", 10, 5, 10, 500), req("b", 10, 0, 10, 500)], now=1.0)
    # "a" ran all along; "b" was queued part of the time and grew less; "c" is new.
    later = [req("a", 10, 5 + steps, 10, 500), req("b", 10, steps // 2, 10, 500)]
    r = meter.report(STATS, [*later, req("c", 10, 3, 10, 500)], now=1.0 + dt)
    assert r.decode_steps_per_s is not None
    assert abs(r.decode_steps_per_s - steps / dt) <= 1e-3 * (1 + steps / dt)


def test_an_idle_interval_keeps_the_last_rate() -> None:
    meter = LoadMeter()
    meter.report(STATS, [req("a", 10, 0, 10, 100)], now=0.0)
    assert meter.report(STATS, [req("a", 10, 20, 10, 100)], now=1.0).decode_steps_per_s == 20.0
    assert meter.report(STATS, [], now=2.0).decode_steps_per_s == 20.0
    assert meter.report(STATS, [], now=3.0).decode_steps_per_s == 20.0


def test_prefill_rate_counts_finished_and_new_prompts() -> None:
    meter = LoadMeter()
    meter.report(STATS, [req("a", 300, 0, 100, 1), req("b", 400, 0, 0, 1)], now=0.0)
    # In 0.5 s: "a" finished (200 more), "b" computed 300, "c" arrived and computed 100.
    r = meter.report(STATS, [req("b", 400, 0, 300, 1), req("c", 900, 0, 100, 1)], now=0.5)
    assert r.prefill_tokens_per_s == (200 + 300 + 100) / 0.5


def test_the_report_extends_instance_load_both_ways() -> None:
    """Old routers decode the new report; the router decodes an old report with defaults."""
    r = LoadMeter().report(STATS, [req("a", 10, 1, 10, 5)], now=0.0)
    old = msgspec.json.decode(msgspec.json.encode(r), type=InstanceLoad)
    assert old.kv_blocks_total == 50
    new = msgspec.json.decode(msgspec.json.encode(old), type=LoadReport)
    assert (new.decode_tokens_left, new.decode_steps_per_s) == (0, None)
