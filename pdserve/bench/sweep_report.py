"""The report of a sweep: `sweep.md`, `sweep.json`, and the generic report with plots.

`sweep.md` is the sweep's own table: one row per point of the grid, failed ones included,
ordered so that the modes of one (input length, rate) point sit on adjacent rows, with the
prefill utilisation of the point as a column; then the push / pull ratio table of
`pdserve.bench.report`, push over each monolithic floor that ran (`mono1`, `monolithic`:
TTFT and TPOT ratios), the points that could not run, and links to the plots.
`report.write_report` draws the plots (and its own `report.md`) from the same results.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec

from pdserve.bench import report
from pdserve.bench.capacity import PrefillCapacity
from pdserve.bench.metrics import BenchResult, load_result
from pdserve.bench.report import rate_label

PointKey = tuple[str, int, str]  # (mode, input length, rate label)


@dataclass(frozen=True)
class SweepReportFiles:
    """What `write_sweep_report` wrote (`report` None when no point produced a result)."""

    markdown: Path
    manifest: Path
    report: report.ReportFiles | None

    @property
    def plots(self) -> tuple[Path, ...]:
        return self.report.plots if self.report else ()


class PointOutcome(msgspec.Struct, kw_only=True):
    """What became of one point: its result file, or why it has none."""

    mode: str
    input_len: int
    rate: float | str  # "inf" for an infinite rate, as in the result JSON
    prefill_util: float | str | None = None
    result_file: str | None = None  # relative to the sweep's folder
    completed: int = 0
    failed: int = 0
    error: str | None = None  # set when the point could not run at all


class SweepManifest(msgspec.Struct, kw_only=True):
    """`sweep.json`: how the sweep was run and what became of every point."""

    date: str
    command: str
    model: str
    transport: str
    modes: list[str]
    input_lens: list[int]
    rates: list[float | str]
    output_len: int
    num_prompts: int
    seed: int
    burstiness: float | str
    base_urls: dict[str, str]
    capacity: PrefillCapacity | None = None
    capacity_error: str | None = None
    points: list[PointOutcome] = msgspec.field(default_factory=list)
    interrupted: bool = False


def result_key(result: BenchResult) -> PointKey:
    """A result's grid point, from the metadata the sweep saved with it."""
    meta = result.metadata
    return meta.get("mode", ""), int(meta.get("input_len", -1)), meta.get("rate", "")


def _fmt(value: float | str | None, digits: int = 1) -> str:
    if value is None:
        return "-"
    value = float(value)
    return "inf" if math.isinf(value) else f"{value:.{digits}f}"


_HEAD = [
    "input", "rate (req/s)", "P util", "mode", "ok / failed", "req/s", "TTFT p50 (ms)",
    "TTFT p99 (ms)", "TPOT p50 (ms)", "TPOT p99 (ms)", "E2EL p50 (ms)", "handoff p50 (ms)",
    "handoff p99 (ms)", "CPU steal",
]  # fmt: skip


def _row(point: PointOutcome, r: BenchResult | None) -> list[str]:
    head = [str(point.input_len), rate_label(point.rate), _fmt(point.prefill_util, 2)]
    if r is None:
        return [*head, point.mode, "point failed", *["-"] * (len(_HEAD) - 5)]
    return [
        *head, point.mode, f"{r.completed} / {r.failed}", _fmt(r.request_throughput, 2),
        _fmt(r.median_ttft_ms), _fmt(r.p99_ttft_ms), _fmt(r.median_tpot_ms, 2),
        _fmt(r.p99_tpot_ms, 2), _fmt(r.median_e2el_ms), _fmt(r.median_handoff_ms),
        _fmt(r.p99_handoff_ms), report.percent(r.host_cpu_steal),
    ]  # fmt: skip


def sweep_table(manifest: SweepManifest, results: Sequence[BenchResult]) -> str:
    """Markdown table: one row per point, by input length, rate, then the sweep's mode
    order; a point that could not run shows as failed."""
    by_key = {result_key(r): r for r in results}
    modes = list(manifest.modes)

    def order(p: PointOutcome) -> tuple:
        rank = modes.index(p.mode) if p.mode in modes else len(modes)
        return (p.input_len, float(p.rate), rank)

    lines = ["| " + " | ".join(_HEAD) + " |", "|" + "---|" * len(_HEAD)]
    for p in sorted(manifest.points, key=order):
        r = by_key.get((p.mode, p.input_len, rate_label(p.rate))) if p.error is None else None
        lines.append("| " + " | ".join(_row(p, r)) + " |")
    return "\n".join(lines)


def failed_points(manifest: SweepManifest) -> list[str]:
    """One line per point that could not run, with the first line of its error."""
    return [
        f"{p.mode} in={p.input_len} rate={rate_label(p.rate)}: {p.error.splitlines()[0]}"
        for p in manifest.points
        if p.error
    ]


def _capacity_line(manifest: SweepManifest) -> str:
    cap = manifest.capacity
    if cap is None:
        why = manifest.capacity_error or "not measured"
        return f"Prefill capacity: unknown ({why.splitlines()[0]}), so no utilisation."
    tok_s = ", ".join(f"{n}: {t:.0f}" for n, t in sorted(cap.tok_s.items()))
    where = f"{cap.threads} thread(s) on cores {cap.cores}" if cap.cores else "as given"
    return (
        f"Prefill capacity of one engine ({cap.model}, {where}), tokens/s by input length: "
        f"{tok_s}. P util = request rate x input length / capacity at that length."
    )


_FLOORS = {
    "mono1": "one instance with P's compute alone",
    "monolithic": "one instance on every core",
}


def summary_text(manifest: SweepManifest, results: Sequence[BenchResult]) -> str:
    """The sweep table, the push/pull ratios and the failed points, as Markdown."""
    parts = [_capacity_line(manifest), sweep_table(manifest, results)]
    ratios = report.ratio_table(results)
    if ratios:
        parts.append("push / pull (below 1: push is faster)\n\n" + ratios)
    for floor in ("mono1", "monolithic"):
        ratios = report.ratio_table(results, "push", floor, report.RATIO_METRICS)
        if ratios:
            parts.append(f"push / {floor} (the P/D cost over {_FLOORS[floor]})\n\n" + ratios)
    failed = failed_points(manifest)
    if failed:
        parts.append("Points that could not run:\n\n" + "\n".join(f"- {f}" for f in failed))
    if manifest.interrupted:
        parts.append("The sweep was interrupted; points not listed did not run.")
    return "\n\n".join(parts)


def write_sweep_report(
    manifest: SweepManifest, results: Sequence[BenchResult], out_dir: Path
) -> SweepReportFiles:
    """Write sweep.json, sweep.md and (given any result) report.md with its plots."""
    out_dir.mkdir(parents=True, exist_ok=True)
    manifest_path = out_dir / "sweep.json"
    manifest_path.write_bytes(msgspec.json.format(msgspec.json.encode(manifest)) + b"\n")
    files = report.write_report(results, out_dir) if results else None
    text = [f"# Sweep {manifest.date}", "", f"`{manifest.command}`", ""]
    text += [summary_text(manifest, results), ""]
    text += [f"![{p.stem}]({p.name})" for p in (files.plots if files else ())]
    markdown = out_dir / "sweep.md"
    markdown.write_text("\n".join(text) + "\n")
    return SweepReportFiles(markdown=markdown, manifest=manifest_path, report=files)


def load_results_of(manifest: SweepManifest, out_dir: Path) -> list[BenchResult]:
    """The saved results of a manifest's points (a report can be redrawn from files)."""
    return [load_result(out_dir / p.result_file) for p in manifest.points if p.result_file]
