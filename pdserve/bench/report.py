"""Reports from `bench serve` results: a terminal summary of one run, and for a set of runs
(a sweep) a Markdown table and PNG plots written next to the JSON files.

A run belongs to a *series* = (mode, input length): mode is the result's `metadata["mode"]`
(the sweep sets pull / push / ...), else its label, else its backend; input length is the
configured one, else the mean measured prompt length. Plots draw one line per series against
the configured request rate (a categorical axis, so "inf" has a place). The ratio plot divides
one mode by a baseline mode (push / pull by default) at equal input length and rate: below 1
means the mode beats the baseline.

`write_report(results, out_dir)` is the sweep's entry; `main(args)` reads JSON files.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from pdserve.bench.metrics import BenchResult, load_result
from pdserve.options import add_options, from_args, option

SeriesKey = tuple[str, int | None]


@dataclass(frozen=True)
class ReportFiles:
    """What `write_report` wrote."""

    markdown: Path
    plots: tuple[Path, ...]


def mode_of(result: BenchResult) -> str:
    """The series' mode name of a run."""
    return result.metadata.get("mode") or result.label or result.backend


def input_len_of(result: BenchResult) -> int | None:
    """Configured input length, else the mean measured one (None if unknown)."""
    if result.input_len is not None:
        return result.input_len
    known = [n for n in result.input_lens if n is not None]
    return round(float(np.mean(known))) if known else None


def series_key(result: BenchResult) -> SeriesKey:
    return mode_of(result), input_len_of(result)


def _sort_key(result: BenchResult) -> tuple:
    mode, input_len = series_key(result)
    return (input_len or 0, mode, result.rate)


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.{digits}f}"


def rate_label(rate: float | str) -> str:
    """A rate as written in file names and tables: 0.5, 2, inf."""
    return "inf" if math.isinf(float(rate)) else f"{float(rate):g}"


# --- one run on the terminal -------------------------------------------------------------

STATS = ("mean", "median", "std")


def _stat_lines(result: BenchResult, name: str, title: str) -> list[str]:
    """A metric's block: mean, median, std and the run's percentiles (`--metric-percentiles`),
    for the metrics the run reports (`--percentile-metrics`) that have samples."""
    if getattr(result, f"mean_{name}_ms") is None or name not in result.percentile_metrics:
        return []
    stats = [(stat.capitalize(), getattr(result, f"{stat}_{name}_ms")) for stat in STATS]
    stats += [(f"P{q:g}", result.percentile(name, q)) for q in result.metric_percentiles]
    lines = [f"{title:-^50}"]
    for stat, value in stats:
        lines.append(f"{f'{stat} {name.upper()} (ms):':<40} {_fmt(value, 2):<10}")
    return lines


def _failure_lines(result: BenchResult, limit: int = 5) -> list[str]:
    errors = [e for e in result.errors if e]
    if not errors:
        return []
    distinct = list(dict.fromkeys(errors))
    lines = [f"{'Failures':-^50}"]
    lines += [f"{errors.count(e)} x {e}" for e in distinct[:limit]]
    if len(distinct) > limit:
        lines.append(f"... and {len(distinct) - limit} other messages")
    return lines


def percent(share: float | None) -> str:
    """A share (0.123) as a whole percentage ("12%"), or "-" when unknown."""
    return "-" if share is None else f"{share * 100:.0f}%"


def format_run(result: BenchResult) -> str:
    """vLLM-style summary block of one run."""
    timed_trace = result.dataset_name == "trace" and result.burstiness is None
    rate_name = f"Request rate {'of the trace' if timed_trace else 'configured'} (RPS):"
    rows = [
        ("Successful requests:", f"{result.completed}"),
        ("Failed requests:", f"{result.failed}"),
        (rate_name, rate_label(result.request_rate)),
        ("Maximum request concurrency:", f"{result.max_concurrency}"),
        ("Benchmark duration (s):", f"{result.duration:.2f}"),
        ("Total input tokens:", f"{result.total_input_tokens}"),
        ("Total generated tokens:", f"{result.total_output_tokens}"),
        ("Request throughput (req/s):", f"{result.request_throughput:.2f}"),
        ("Request goodput (req/s):", _fmt(result.request_goodput, 2)),
        ("Output token throughput (tok/s):", f"{result.output_throughput:.2f}"),
        ("Peak output token throughput (tok/s):", f"{result.max_output_tokens_per_s:.2f}"),
        ("Peak concurrent requests:", f"{result.max_concurrent_requests}"),
        ("Total token throughput (tok/s):", f"{result.total_token_throughput:.2f}"),
        (
            "Host CPU busy / stolen:",
            f"{percent(result.host_cpu_busy)} / {percent(result.host_cpu_steal)}",
        ),
    ]
    lines = [f"{' Serving Benchmark Result ':=^50}"]
    lines += [f"{name:<40} {value:<10}" for name, value in rows]
    lines += _stat_lines(result, "ttft", "Time to First Token")
    lines += _stat_lines(result, "tpot", "Time per Output Token (excl. 1st token)")
    lines += _stat_lines(result, "itl", "Inter-token Latency")
    lines += _stat_lines(result, "e2el", "End-to-end Latency")
    lines += _stat_lines(result, "handoff", "P/D Handoff (prefill done to first token)")
    lines += _failure_lines(result)
    lines.append("=" * 50)
    return "\n".join(lines)


# --- many runs: tables -------------------------------------------------------------------


def markdown_table(results: Sequence[BenchResult]) -> str:
    """One row per run, sorted by input length, mode and rate."""
    handoff = any(r.median_handoff_ms is not None for r in results)
    head = [
        "mode", "input", "output", "rate (req/s)", "ok / failed", "req/s", "out tok/s",
        "TTFT p50 (ms)", "TTFT p99 (ms)", "TPOT p50 (ms)", "TPOT p99 (ms)", "ITL p50 (ms)",
        "E2EL p50 (ms)", "goodput (req/s)",
    ]  # fmt: skip
    head += ["handoff p50 (ms)", "handoff p99 (ms)"] if handoff else []
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in sorted(results, key=_sort_key):
        mode, input_len = series_key(r)
        cells = [
            mode, f"{input_len if input_len is not None else '-'}",
            f"{r.output_len if r.output_len is not None else '-'}", rate_label(r.request_rate),
            f"{r.completed} / {r.failed}", _fmt(r.request_throughput, 2),
            _fmt(r.output_throughput), _fmt(r.median_ttft_ms), _fmt(r.p99_ttft_ms),
            _fmt(r.median_tpot_ms, 2), _fmt(r.p99_tpot_ms, 2), _fmt(r.median_itl_ms, 2),
            _fmt(r.median_e2el_ms), _fmt(r.request_goodput, 2),
        ]  # fmt: skip
        cells += [_fmt(r.median_handoff_ms), _fmt(r.p99_handoff_ms)] if handoff else []
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


RATIO_METRICS = (
    ("median_ttft_ms", "TTFT p50"),
    ("p99_ttft_ms", "TTFT p99"),
    ("median_tpot_ms", "TPOT p50"),
)
# The ratio table also shows these (the plot keeps to the three above); a ratio neither run
# can give, e.g. handoffs of a monolithic baseline, shows as "-".
RATIO_TABLE_METRICS = (
    *RATIO_METRICS,
    ("p99_tpot_ms", "TPOT p99"),
    ("median_handoff_ms", "handoff p50"),
    ("p99_handoff_ms", "handoff p99"),
)


def _ratio(a: float | None, b: float | None) -> float:
    return math.nan if a is None or b is None or b == 0 else a / b


def _point_order(item: tuple[tuple[str, int | None, float], BenchResult]) -> tuple:
    (_, input_len, rate), _ = item
    return (input_len or 0, rate)


def ratio_rows(
    results: Sequence[BenchResult], mode: str = "push", baseline: str = "pull"
) -> list[tuple[int | None, float, dict[str, float]]]:
    """(input_len, rate, {metric: mode / baseline}) for every point both modes ran."""
    by_point: dict[tuple[str, int | None, float], BenchResult] = {
        (*series_key(r), r.rate): r for r in results
    }
    rows = []
    for (m, input_len, rate), r in sorted(by_point.items(), key=_point_order):
        base = by_point.get((baseline, input_len, rate))
        if m == mode and base is not None:
            ratios = {k: _ratio(getattr(r, k), getattr(base, k)) for k, _ in RATIO_TABLE_METRICS}
            rows.append((input_len, rate, ratios))
    return rows


def ratio_table(
    results: Sequence[BenchResult],
    mode: str = "push",
    baseline: str = "pull",
    metrics: Sequence[tuple[str, str]] = RATIO_TABLE_METRICS,
) -> str:
    """Markdown table of mode / baseline ratios of `metrics` (attribute, label); empty if no
    point has both modes."""
    rows = ratio_rows(results, mode, baseline)
    if not rows:
        return ""
    labels = [f"{label} {mode}/{baseline}" for _, label in metrics]
    head = ["input", "rate (req/s)", *labels]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for input_len, rate, ratios in rows:
        cells = [f"{input_len}", rate_label(rate)]
        cells += [_fmt(ratios[k], 2) for k, _ in metrics]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# --- many runs: plots --------------------------------------------------------------------


def _rate_axis(results: Sequence[BenchResult]) -> list[float]:
    return sorted({r.rate for r in results})


def _series(results: Sequence[BenchResult]) -> dict[SeriesKey, list[BenchResult]]:
    groups: dict[SeriesKey, list[BenchResult]] = {}
    for r in sorted(results, key=_sort_key):
        groups.setdefault(series_key(r), []).append(r)
    return groups


def _set_rate_ticks(ax, rates: list[float]) -> None:
    ax.set_xticks(range(len(rates)), [rate_label(r) for r in rates])
    ax.set_xlabel("request rate (req/s)")
    ax.grid(True, alpha=0.3)


def _value(r: BenchResult, key: str) -> float:
    value = getattr(r, key)
    return math.nan if value is None else value


_LINE_STYLES = ("-", "--", ":", "-.")


def plot_vs_rate(results: Sequence[BenchResult], metric: str, path: Path) -> Path:
    """Median and p99 of `metric` (ttft, tpot, ...) against rate, one line per series."""
    rates = _rate_axis(results)
    groups = _series(results)
    # colour per input length, line style per mode, so a mode pair reads as one colour
    lengths = sorted({n for _, n in groups}, key=lambda n: n or 0)
    modes = sorted({m for m, _ in groups})
    fig = Figure(figsize=(11, 4.2), layout="constrained")
    axes = fig.subplots(1, 2)
    for ax, stat in zip(axes, ("median", "p99"), strict=True):
        for (mode, input_len), runs in groups.items():
            xs = [rates.index(r.rate) for r in runs]
            ys = [_value(r, f"{stat}_{metric}_ms") for r in runs]
            style = _LINE_STYLES[modes.index(mode) % len(_LINE_STYLES)]
            colour = f"C{lengths.index(input_len) % 10}"
            ax.plot(xs, ys, style, color=colour, marker="o", label=f"{mode}, in={input_len}")
        ax.set_title(f"{metric.upper()} {stat}")
        ax.set_ylabel("ms")
        _set_rate_ticks(ax, rates)
    axes[0].legend(fontsize="small")
    fig.savefig(path, dpi=110)
    return path


def plot_ratio(
    results: Sequence[BenchResult], path: Path, mode: str = "push", baseline: str = "pull"
) -> Path | None:
    """mode / baseline ratios against rate, one line per input length; None if no pairs."""
    rows = ratio_rows(results, mode, baseline)
    if not rows:
        return None
    rates = sorted({rate for _, rate, _ in rows})
    fig = Figure(figsize=(5 * len(RATIO_METRICS), 4), layout="constrained")
    axes = fig.subplots(1, len(RATIO_METRICS))
    for ax, (key, label) in zip(axes, RATIO_METRICS, strict=True):
        for input_len in sorted({n for n, _, _ in rows}, key=lambda n: n or 0):
            picked = [(rate, ratios[key]) for n, rate, ratios in rows if n == input_len]
            xs = [rates.index(rate) for rate, _ in picked]
            ax.plot(xs, [v for _, v in picked], marker="o", label=f"in={input_len}")
        ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
        ax.set_title(f"{label}: {mode} / {baseline}")
        _set_rate_ticks(ax, rates)
    axes[0].legend(fontsize="small")
    fig.savefig(path, dpi=110)
    return path


# --- files -------------------------------------------------------------------------------


def summarize(results: Sequence[BenchResult], mode: str = "push", baseline: str = "pull") -> str:
    """Terminal summary of a set of runs: the table, then the ratio table if any."""
    parts = [markdown_table(results)]
    ratios = ratio_table(results, mode, baseline)
    if ratios:
        parts.append(ratios)
    return "\n\n".join(parts)


def write_report(
    results: Sequence[BenchResult],
    out_dir: str | Path,
    name: str = "report",
    mode: str = "push",
    baseline: str = "pull",
) -> ReportFiles:
    """Write `<name>.md` and `<name>_{ttft,tpot,handoff,ratio}.png` into `out_dir`.

    The handoff plot only when some run reported handoffs, the ratio plot only when some
    point ran in both `mode` and `baseline`.
    """
    if not results:
        raise ValueError("no results to report")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plots = [
        plot_vs_rate(results, "ttft", out / f"{name}_ttft.png"),
        plot_vs_rate(results, "tpot", out / f"{name}_tpot.png"),
    ]
    if any(r.median_handoff_ms is not None for r in results):
        plots.append(plot_vs_rate(results, "handoff", out / f"{name}_handoff.png"))
    ratio = plot_ratio(results, out / f"{name}_ratio.png", mode, baseline)
    plots += [ratio] if ratio is not None else []
    text = [f"# Benchmark report ({len(results)} runs)", "", markdown_table(results), ""]
    ratios = ratio_table(results, mode, baseline)
    text += [f"## {mode} / {baseline}", "", ratios, ""] if ratios else []
    text += [f"![{p.stem}]({p.name})" for p in plots]
    markdown = out / f"{name}.md"
    markdown.write_text("\n".join(text) + "\n")
    return ReportFiles(markdown=markdown, plots=tuple(plots))


def load_results(paths: Sequence[str | Path]) -> list[BenchResult]:
    """Read result JSON files."""
    return [load_result(p) for p in paths]


@dataclass(frozen=True)
class ReportConfig:
    """A report over saved results (`bench report`'s flags; `results` is its positional)."""

    results: tuple[Path, ...]  # the positional RESULTS (options.py declares only flags)
    out: Path | None = option(None, help="default: the first file's folder")
    name: str = option("report", help="")
    mode: str = option("push", help="mode divided by the baseline")
    baseline: str = option("pull", help="")

    def out_dir(self) -> Path:
        """Where the report goes: `out`, else the first result's folder."""
        return self.out or self.results[0].parent


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of a report over saved results (a `bench report` command, or `python -m`)."""
    # A positional: options.py declares flags only, so it is added here and handed to
    # `from_args` as a computed field.
    parser.add_argument("results", nargs="+", type=Path, help="result JSON files")
    add_options(parser, ReportConfig)


def run(cfg: ReportConfig) -> int:
    """Write the report and print its summary."""
    results = load_results(cfg.results)
    files = write_report(results, cfg.out_dir(), cfg.name, cfg.mode, cfg.baseline)
    print(summarize(results, cfg.mode, cfg.baseline))
    print(f"\nwrote {files.markdown} and {len(files.plots)} plots")
    return 0


if __name__ == "__main__":  # as `pdserve bench report` (pdserve.bench.report_args)
    _parser = argparse.ArgumentParser(prog="python -m pdserve.bench.report")
    add_arguments(_parser)
    _args = _parser.parse_args()
    raise SystemExit(run(from_args(ReportConfig, _args, results=tuple(_args.results))))
