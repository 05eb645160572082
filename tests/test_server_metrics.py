"""An instance's metrics: per-token inter-token latency, the endpoint picker's gauges (the
model server protocol, docs/metrics.md) and the model_name label."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

import pdserve.server.metrics as server_metrics
from pdserve.engine.types import EngineStats
from pdserve.server.metrics import ServerMetrics

MODEL = "org/model-7b"


def _stats(**kw: int) -> EngineStats:
    base = {"num_running": 0, "num_waiting": 0, "kv_blocks_used": 0, "kv_blocks_total": 64}
    return EngineStats(**(base | kw))


def _samples(m: ServerMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = m.render()[0].decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    c = _Clock()
    monkeypatch.setattr(server_metrics.time, "monotonic", c)
    return c


def test_inter_token_latency_is_one_observation_per_token_gap(clock: _Clock) -> None:
    m = ServerMetrics(_stats, MODEL, block_size=16)
    timer = m.timer(num_prompt_tokens=10)
    clock.now += 0.5
    timer.tokens(1)  # first token: TTFT 0.5, no gap
    clock.now += 0.015
    timer.tokens(1)  # gap 0.015
    clock.now += 0.09
    timer.tokens(3)  # three tokens in one output share 0.09: 0.03 each
    timer.finish("length")
    s = _samples(m)
    model = (("model_name", MODEL),)
    assert s[("pdserve_inter_token_latency_seconds_count", model)] == 4
    assert s[("pdserve_inter_token_latency_seconds_sum", model)] == pytest.approx(0.105)
    bucket = "pdserve_inter_token_latency_seconds_bucket"
    assert s[(bucket, (("le", "0.02"), *model))] == 1
    assert s[(bucket, (("le", "0.04"), *model))] == 4
    # The per-request series is kept: one observation, (last - first) / (tokens - 1).
    assert s[("pdserve_time_per_output_token_seconds_count", model)] == 1
    assert s[("pdserve_time_per_output_token_seconds_sum", model)] == pytest.approx(0.105 / 4)
    assert s[("pdserve_time_to_first_token_seconds_sum", model)] == pytest.approx(0.5)
    assert s[("pdserve_generation_tokens_total", model)] == 5
    assert s[("pdserve_request_finish_total", (("model_name", MODEL), ("reason", "length")))] == 1


def test_protocol_gauges_count_kv_waiters_as_queued() -> None:
    stats = _stats(num_running=3, num_waiting=2, num_waiting_for_kv=5, kv_blocks_used=16)
    s = _samples(ServerMetrics(lambda: stats, MODEL, block_size=16))
    model = (("model_name", MODEL),)
    assert s[("pdserve:num_requests_waiting", model)] == 2 + 5  # as vLLM's waiting queue
    assert s[("pdserve:num_requests_running", model)] == 3
    assert s[("pdserve:kv_cache_usage_perc", model)] == 0.25  # a fraction of 1
    info = (("block_size", "16"), ("model_name", MODEL), ("num_gpu_blocks", "64"))
    assert s[("pdserve:cache_config_info", info)] == 1
    # The engine's own breakdown stays, unlabelled as before.
    assert s[("pdserve_num_requests_waiting", ())] == 2
    assert s[("pdserve_num_requests_waiting_for_kv", ())] == 5


def test_protocol_gauges_are_gauges() -> None:
    """The endpoint picker reads a gauge's value; a counter there would read as 0."""
    m = ServerMetrics(_stats, MODEL, block_size=16)
    types = {f.name: f.type for f in text_string_to_metric_families(m.render()[0].decode())}
    for name in ("num_requests_waiting", "num_requests_running", "kv_cache_usage_perc"):
        assert types[f"pdserve:{name}"] == "gauge"


def test_empty_pool_reports_zero_usage() -> None:
    s = _samples(ServerMetrics(lambda: _stats(kv_blocks_total=0), MODEL, block_size=16))
    assert s[("pdserve:kv_cache_usage_perc", (("model_name", MODEL),))] == 0


def test_prefix_cache_counters_are_token_counters() -> None:
    m = ServerMetrics(lambda: _stats(prefix_cache_queries=120, prefix_cache_hits=48), MODEL, 16)
    samples = _samples(m)
    assert samples[("pdserve_prefix_cache_queries_total", ())] == 120
    assert samples[("pdserve_prefix_cache_hits_total", ())] == 48
