"""Metrics math on synthetic timestamps; expected values are worked out by hand."""

from __future__ import annotations

import math

import pytest

from pdserve.bench.metrics import (
    RequestRecord,
    compute_metrics,
    latency_stats,
    parse_goodput,
    peak_concurrency,
    peak_output_rate,
)

approx = pytest.approx


def _ok(start: float, ttft: float, itl: list[float], out: int, prompt: int) -> RequestRecord:
    return RequestRecord(
        success=True,
        prompt_len=prompt,
        output_len=out,
        arrival_time=start,
        start_time=start,
        ttft=ttft,
        itl=itl,
        latency=ttft + sum(itl),
    )


@pytest.fixture
def records() -> list[RequestRecord]:
    return [
        _ok(0.0, 0.1, [0.02, 0.04], out=3, prompt=10),  # e2el .16, tpot .03
        _ok(0.5, 0.2, [], out=1, prompt=20),  # e2el .2, no tpot
        _ok(1.0, 0.3, [0.05] * 4, out=5, prompt=30),  # e2el .5, tpot .05
        _ok(1.2, 0.4, [0.1], out=2, prompt=40),  # e2el .5, tpot .1
        RequestRecord(success=False, error="HTTP 500: boom", prompt_len=50, start_time=1.5),
    ]


def test_counts_and_throughput(records: list[RequestRecord]) -> None:
    m = compute_metrics(records, duration_s=2.0)
    assert (m.completed, m.failed) == (4, 1)
    assert m.total_input_tokens == 100  # the failed request's prompt is not counted
    assert m.total_output_tokens == 11
    assert m.request_throughput == approx(2.0)
    assert m.output_throughput == approx(5.5)
    assert m.total_token_throughput == approx(55.5)
    assert m.request_goodput is None


def test_ttft_stats(records: list[RequestRecord]) -> None:
    m = compute_metrics(records, duration_s=2.0)
    assert m.mean_ttft_ms == approx(250.0)
    assert m.median_ttft_ms == approx(250.0)
    assert m.std_ttft_ms == approx(math.sqrt(0.0125) * 1000)  # population std
    assert m.p90_ttft_ms == approx(370.0)  # linear interpolation at rank 2.7
    assert m.p99_ttft_ms == approx(397.0)


def test_tpot_excludes_single_token_requests(records: list[RequestRecord]) -> None:
    m = compute_metrics(records, duration_s=2.0)
    assert m.mean_tpot_ms == approx(60.0)  # 30, 50, 100
    assert m.median_tpot_ms == approx(50.0)
    assert m.std_tpot_ms == approx(math.sqrt(2600 / 3))
    assert m.p90_tpot_ms == approx(90.0)
    assert m.p99_tpot_ms == approx(99.0)


def test_itl_pools_all_gaps(records: list[RequestRecord]) -> None:
    m = compute_metrics(records, duration_s=2.0)
    assert m.mean_itl_ms == approx(360 / 7)  # 20, 40, 50, 50, 50, 50, 100
    assert m.median_itl_ms == approx(50.0)
    assert m.p90_itl_ms == approx(70.0)
    assert m.p99_itl_ms == approx(97.0)


def test_e2el_stats(records: list[RequestRecord]) -> None:
    m = compute_metrics(records, duration_s=2.0)
    assert m.mean_e2el_ms == approx(340.0)
    assert m.median_e2el_ms == approx(350.0)
    assert m.p99_e2el_ms == approx(500.0)


def test_goodput_counts_requests_meeting_every_slo(records: list[RequestRecord]) -> None:
    # ttft <= 250 and tpot <= 60: A and B (B's single token counts as TPOT 0)
    assert compute_metrics(records, 2.0, {"ttft": 250, "tpot": 60}).request_goodput == approx(1.0)
    # only the tpot SLO binds: A, B, C
    assert compute_metrics(records, 2.0, {"ttft": 1e4, "tpot": 60}).request_goodput == approx(1.5)
    assert compute_metrics(records, 2.0, {"e2el": 200}).request_goodput == approx(1.0)


def test_handoff_only_when_reported(records: list[RequestRecord]) -> None:
    assert compute_metrics(records, 2.0).mean_handoff_ms is None
    records[0].handoff = 0.03
    records[2].handoff = 0.05
    m = compute_metrics(records, 2.0)
    assert m.mean_handoff_ms == approx(40.0)
    assert m.median_handoff_ms == approx(40.0)


def test_peaks(records: list[RequestRecord]) -> None:
    done = [r for r in records if r.success]
    assert peak_concurrency(done) == 2  # C [1.0, 1.5) overlaps D [1.2, 1.7)
    # second 0: A's 3 tokens + B's 1; second 1: C's 5 + D's 2
    assert peak_output_rate(done) == 7.0


def test_back_to_back_requests_do_not_overlap() -> None:
    a = _ok(0.0, 0.5, [0.5], out=2, prompt=1)
    b = _ok(1.0, 0.5, [], out=1, prompt=1)
    assert peak_concurrency([a, b]) == 1


def test_no_success_gives_empty_stats() -> None:
    m = compute_metrics([RequestRecord(success=False, error="x")], duration_s=1.0)
    assert (m.completed, m.failed) == (0, 1)
    assert m.mean_ttft_ms is None and m.p99_itl_ms is None
    assert m.max_concurrent_requests == 0
    assert latency_stats([]) is None


def test_parse_goodput() -> None:
    assert parse_goodput(["ttft:500", "tpot:50"]) == {"ttft": 500.0, "tpot": 50.0}
    assert parse_goodput(["ttft:500,e2el:2000"]) == {"ttft": 500.0, "e2el": 2000.0}
    for bad in (["ttft"], ["itl:5"], ["ttft:fast"], ["ttft:-1"]):
        with pytest.raises(ValueError, match="bad goodput SLO"):
            parse_goodput(bad)
