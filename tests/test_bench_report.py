"""The report: Markdown table, ratio table, PNG plots, and the one-run summary."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import msgspec
import pytest

from pdserve.bench import report, report_args
from pdserve.bench.metrics import (
    BenchResult,
    RequestRecord,
    compute_metrics,
    json_number,
    per_request_arrays,
    save_result,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
RATES = (1.0, 4.0, math.inf)
INPUTS = (128, 1024)


def _base() -> BenchResult:
    rec = RequestRecord(
        success=True, prompt_len=128, output_len=4, ttft=0.1, itl=[0.01] * 3, latency=0.13
    )
    return BenchResult(
        **msgspec.structs.asdict(compute_metrics([rec], 1.0)),
        **per_request_arrays([rec]),
        date="20260101-120000",
        model_id="m",
        base_url="http://127.0.0.1:8000",
        endpoint="/v1/completions",
        dataset_name="random",
        num_prompts=1,
        output_len=4,
        request_rate=1.0,
        burstiness=1.0,
        seed=0,
        start_time_unix=0.0,
    )


def _point(mode: str, input_len: int, rate: float) -> BenchResult:
    """A run whose latencies encode its point: push is exactly half of pull's TTFT."""
    ttft = input_len * rate if math.isfinite(rate) else input_len * 10.0
    ttft *= 0.5 if mode == "push" else 1.0
    return msgspec.structs.replace(
        _base(),
        metadata={"mode": mode},
        input_len=input_len,
        request_rate=json_number(rate),
        median_ttft_ms=ttft,
        p99_ttft_ms=2 * ttft,
        median_tpot_ms=5.0,
        median_handoff_ms=3.0 if mode == "push" else None,
    )


@pytest.fixture
def sweep() -> list[BenchResult]:
    return [_point(m, n, r) for m in ("pull", "push") for n in INPUTS for r in RATES]


def test_markdown_table_has_one_sorted_row_per_run(sweep: list[BenchResult]) -> None:
    lines = report.markdown_table(sweep[::-1]).splitlines()
    header, rows = lines[0], lines[2:]
    assert "TTFT p50 (ms)" in header and "handoff p50 (ms)" in header
    assert len(rows) == len(sweep)
    cells = [[c.strip() for c in row.strip("|").split("|")] for row in rows]
    assert [(c[0], c[1], c[3]) for c in cells[:3]] == [
        ("pull", "128", "1"),
        ("pull", "128", "4"),
        ("pull", "128", "inf"),
    ]
    assert cells[0][7] == "128.0"  # pull, 128 tokens, 1 req/s: TTFT p50


def test_ratio_rows_pair_modes_at_equal_points(sweep: list[BenchResult]) -> None:
    rows = report.ratio_rows(sweep)
    assert [(n, r) for n, r, _ in rows] == [(n, r) for n in INPUTS for r in RATES]
    for _, _, ratios in rows:
        assert ratios["median_ttft_ms"] == pytest.approx(0.5)
        assert ratios["p99_ttft_ms"] == pytest.approx(0.5)
        assert ratios["median_tpot_ms"] == pytest.approx(1.0)
    assert report.ratio_rows(sweep, mode="pull", baseline="push")[0][2][
        "median_ttft_ms"
    ] == pytest.approx(2.0)


def test_ratio_table_has_handoff_and_p99_ratios(sweep: list[BenchResult]) -> None:
    """Handoff p50/p99 ratios when both modes report handoffs; '-' when the baseline has none."""
    with_pull_handoff = [
        msgspec.structs.replace(r, median_handoff_ms=12.0, p99_handoff_ms=40.0, p99_tpot_ms=8.0)
        if r.metadata["mode"] == "pull"
        else msgspec.structs.replace(r, p99_handoff_ms=4.0, p99_tpot_ms=6.0)
        for r in sweep
    ]
    lines = report.ratio_table(with_pull_handoff).splitlines()
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    row = dict(zip(head, (c.strip() for c in lines[2].strip("|").split("|")), strict=True))
    assert row["handoff p50 push/pull"] == "0.25"
    assert row["handoff p99 push/pull"] == "0.10"
    assert row["TPOT p99 push/pull"] == "0.75"
    plain = report.ratio_table(sweep).splitlines()[2]  # pull has no handoff there
    assert plain.rstrip(" |").endswith("| - | -")


def test_markdown_table_has_handoff_p99(sweep: list[BenchResult]) -> None:
    runs = [msgspec.structs.replace(r, p99_handoff_ms=7.5) for r in sweep]
    lines = report.markdown_table(runs).splitlines()
    assert lines[0].rstrip(" |").endswith("handoff p50 (ms) | handoff p99 (ms)")
    assert lines[2].rstrip(" |").endswith("| 7.5")


def test_write_report(sweep: list[BenchResult], tmp_path: Path) -> None:
    files = report.write_report(sweep, tmp_path / "out")
    assert files.markdown.read_text().count("| pu") == len(sweep)
    names = [p.name for p in files.plots]
    assert names == ["report_ttft.png", "report_tpot.png", "report_handoff.png", "report_ratio.png"]
    for plot in files.plots:
        assert plot.read_bytes().startswith(PNG_MAGIC)
        assert f"]({plot.name})" in files.markdown.read_text()
    assert "0.50" in files.markdown.read_text()  # the TTFT push/pull ratio


def test_single_mode_has_no_ratio(tmp_path: Path) -> None:
    runs = [_point("pull", 128, r) for r in RATES]
    assert report.ratio_table(runs) == ""
    files = report.write_report(runs, tmp_path)
    assert [p.name for p in files.plots] == ["report_ttft.png", "report_tpot.png"]


def test_empty_report_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        report.write_report([], tmp_path)


def test_failed_run_reports_dashes(tmp_path: Path) -> None:
    failed = msgspec.structs.replace(
        _point("pull", 128, 1.0),
        **msgspec.structs.asdict(compute_metrics([RequestRecord(success=False, error="x")], 1.0)),
    )
    assert "| - |" in report.markdown_table([failed])
    assert report.write_report([failed], tmp_path).markdown.exists()


def test_series_falls_back_to_label_and_measured_length() -> None:
    run = msgspec.structs.replace(_base(), label="vllm", input_len=None, input_lens=[100, 201])
    assert report.series_key(run) == ("vllm", 150)
    assert report.series_key(msgspec.structs.replace(run, label=None))[0] == "openai"


def test_format_run_lists_failures() -> None:
    records = [RequestRecord(success=False, error="HTTP 500: x")] * 2
    records += [RequestRecord(success=True, prompt_len=4, output_len=1, ttft=0.1, latency=0.1)]
    run = msgspec.structs.replace(
        _base(),
        **msgspec.structs.asdict(compute_metrics(records, 1.0)),
        **per_request_arrays(records),
    )
    text = report.format_run(run)
    assert "Successful requests:" in text and "Mean TTFT (ms):" in text
    assert "2 x HTTP 500: x" in text
    assert "TPOT" not in text  # one-token outputs have no TPOT


def test_main_reads_json_files(
    sweep: list[BenchResult], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    paths = []
    for i, run in enumerate(sweep):
        paths.append(tmp_path / f"run{i}.json")
        save_result(run, paths[-1])
    parser = argparse.ArgumentParser()
    report.add_arguments(parser)
    assert report_args.main_from_args(parser.parse_args([str(p) for p in paths])) == 0
    assert (tmp_path / "report.md").exists() and (tmp_path / "report_ratio.png").exists()
    assert "TTFT p50 push/pull" in capsys.readouterr().out
