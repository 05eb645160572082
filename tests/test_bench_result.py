"""The result JSON: vLLM's keys, strict JSON, and a lossless round trip."""

from __future__ import annotations

import json
import math
from pathlib import Path

import msgspec
import pytest

from pdserve.bench.metrics import (
    BenchResult,
    RequestRecord,
    compute_metrics,
    extra_percentiles,
    json_number,
    load_result,
    per_request_arrays,
    save_result,
)

VLLM_KEYS = {
    "date", "backend", "label", "model_id", "tokenizer_id", "num_prompts", "request_rate",
    "burstiness", "max_concurrency", "duration", "completed", "failed", "total_input_tokens",
    "total_output_tokens", "request_throughput", "request_goodput", "output_throughput",
    "total_token_throughput", "max_output_tokens_per_s", "max_concurrent_requests",
    "input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times", "queue_times",
    "generated_texts", "errors",
}  # fmt: skip
PDSERVE_KEYS = {"arrival_times", "handoffs", "metadata", "start_time_unix", "input_len"}
METRICS = ("ttft", "tpot", "itl", "e2el", "handoff")
STATS = ("mean", "median", "std", "p90", "p99")


def _records() -> list[RequestRecord]:
    ok = RequestRecord(
        success=True,
        prompt_len=16,
        output_len=3,
        arrival_time=0.1,
        start_time=0.2,
        ttft=0.05,
        itl=[0.01, 0.02],
        latency=0.08,
        handoff=0.004,
        generated_text="abc",
    )
    bad = RequestRecord(success=False, error="HTTP 503: busy", prompt_len=16, start_time=0.3)
    return [ok, bad]


def _result(rate: float = math.inf, burstiness: float = 1.0) -> BenchResult:
    records = _records()
    return BenchResult(
        **msgspec.structs.asdict(compute_metrics(records, 1.0, {"ttft": 100.0})),
        **per_request_arrays(records),
        date="20260101-120000",
        model_id="m",
        base_url="http://127.0.0.1:8000",
        endpoint="/v1/completions",
        dataset_name="random",
        num_prompts=2,
        input_len=16,
        output_len=3,
        request_rate=json_number(rate),
        burstiness=json_number(burstiness),
        seed=0,
        metadata={"mode": "push"},
        start_time_unix=1.7e9,
    )


def _strict_json(path: Path) -> dict:
    def reject(const: str) -> None:
        raise AssertionError(f"non-standard JSON constant {const}")

    return json.loads(path.read_text(), parse_constant=reject)


def test_keys_follow_vllm_plus_pdserve(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    save_result(_result(), path)
    data = _strict_json(path)
    stat_keys = {f"{s}_{m}_ms" for s in STATS for m in METRICS}
    missing = (VLLM_KEYS | PDSERVE_KEYS | stat_keys) - data.keys()
    assert not missing
    assert data["request_rate"] == "inf" and data["burstiness"] == 1.0
    assert data["errors"] == [None, "HTTP 503: busy"]
    assert data["output_lens"] == [3, 0]
    assert data["queue_times"] == pytest.approx([0.1, 0.3])
    assert data["mean_handoff_ms"] == pytest.approx(4.0)
    assert data["request_goodput"] == pytest.approx(1.0)


def test_infinite_burstiness_is_a_string(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    save_result(_result(rate=2.0, burstiness=math.inf), path)
    data = _strict_json(path)
    assert (data["request_rate"], data["burstiness"]) == (2.0, "inf")


def test_round_trip(tmp_path: Path) -> None:
    original = _result(rate=4.0)
    path = tmp_path / "sub" / "r.json"
    save_result(original, path)
    loaded = load_result(path)
    assert loaded == original
    assert loaded.rate == 4.0 and _result().rate == math.inf


def test_empty_stats_are_null(tmp_path: Path) -> None:
    records = [RequestRecord(success=False, error="x")]
    result = msgspec.structs.replace(
        _result(), **msgspec.structs.asdict(compute_metrics(records, 1.0))
    )
    path = tmp_path / "r.json"
    save_result(result, path)
    data = _strict_json(path)
    assert data["median_ttft_ms"] is None and data["completed"] == 0


def test_asked_percentiles_are_top_level_keys_named_as_vllm(tmp_path: Path) -> None:
    records = [
        RequestRecord(success=True, output_len=2, ttft=t / 1000, itl=[0.001], latency=0.5)
        for t in range(1, 101)
    ]
    extra = extra_percentiles(records, ["ttft", "itl", "handoff"], [50, 90, 99.9])
    assert extra.keys() == {
        "p50_ttft_ms",
        "p99.9_ttft_ms",
        "p50_itl_ms",
        "p99.9_itl_ms",
        "p50_handoff_ms",
        "p99.9_handoff_ms",
    }  # fmt: skip  (p90 has its own field; no handoff samples: None)
    assert extra["p50_ttft_ms"] == pytest.approx(50.5)
    assert extra["p99.9_ttft_ms"] == pytest.approx(99.901)
    assert extra["p50_handoff_ms"] is None
    result = msgspec.structs.replace(
        _result(), percentiles=extra, metric_percentiles=[50, 90, 99.9]
    )
    path = tmp_path / "r.json"
    save_result(result, path)
    data = _strict_json(path)
    assert "percentiles" not in data and data["p50_ttft_ms"] == pytest.approx(50.5)
    assert data["p90_ttft_ms"] == result.p90_ttft_ms  # the fixed key is kept as it was
    loaded = load_result(path)
    assert loaded == result
    assert loaded.percentile("ttft", 50) == pytest.approx(50.5)
    assert loaded.percentile("ttft", 90) == loaded.p90_ttft_ms
    assert loaded.percentile("ttft", 75) is None  # not asked for
