"""Calibrate the simulator on a measured `pdserve bench sweep` and write a validation set.

    python -m pdserve.sim.calibrate --measured SWEEP_DIR \\
        --out pdserve/sim/profiles/validation/pdserve-cpu-sweep.json

Reads every `<mode>-in<L>-r<R>.json` bench result of the sweep directory (`--out-dir` of
`pdserve bench sweep`), keeps its reference figures (TTFT, TPOT and handoff, median and p99)
and its bench seed (so the simulation replays the same prompts at the same times), fits a
small named set of parameters (`FIT_PARAMS`) to the median figures of the fit points only
(default: the lightest rate of every input length, all modes), and writes a validation set:
the measured figures (marked `tuned` where they were fitted to), the fitted values as
profile overrides, and a note naming what was fitted to what. `pdserve sim --validate NAME`
then reports the error at every point; the points not fitted to are predictions.

The fit minimises the mean squared log error (sim / measured) over the fit figures by
coordinate descent in log space: each parameter in turn is multiplied or divided by a step
factor while that lowers the error, and the step shrinks when no parameter moves. It is
deterministic (the simulation is) and needs no other library.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import msgspec

from pdserve.bench.metrics import BenchResult, load_result
from pdserve.options import add_options, from_args, option
from pdserve.sim.validation import Outcome, Point, ValidationSet, evaluate, profiles_for

METRICS = ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "median_handoff_ms")
FIT_METRICS = ("median_ttft_ms", "median_tpot_ms", "median_handoff_ms")
MODE_ORDER = {"pull": 0, "push": 1, "monolithic": 2}


@dataclass(frozen=True)
class FitParam:
    """One fitted parameter: a profile field (`section.field`), for every mode or for one
    mode only (`mode`), its bounds, and its start value (None: the profile's own)."""

    key: str
    low: float
    high: float
    mode: str | None = None
    start: float | None = None

    @property
    def label(self) -> str:
        return self.key if self.mode is None else f"{self.mode}: {self.key}"


# What is fitted, and why each is free: the engine's speed on this loaded machine (the
# quiet-machine fit of `measure` is faster than what the sweep saw), the host work of a
# step (HTTP streaming shares the engine's core), the HTTP hop and front-end costs that
# the engine-only measurement cannot see, and the monolithic instance's speed on two
# threads (two cores, each shared with other jobs).
FIT_PARAMS = (
    FitParam("hardware.flops_efficiency", 0.05, 1.0),
    FitParam("software.step_overhead_s", 1e-4, 0.1),
    FitParam("software.http_hop_s", 1e-5, 0.05),
    FitParam("software.api_overhead_s", 1e-5, 0.05),
    FitParam("hardware.flops_efficiency", 0.02, 1.0, mode="monolithic"),
    FitParam("software.step_overhead_s", 1e-4, 0.1, mode="monolithic"),
)


def start_value(vs: ValidationSet, p: FitParam) -> float:
    """`p.start`, else the field's value in `vs`'s profiles (with its overrides)."""
    if p.start is not None:
        return p.start
    model, hardware, software = profiles_for(vs, p.mode or "pull")
    section, _, name = p.key.partition(".")
    profile = {"model": model, "hardware": hardware, "software": software}[section]
    return float(getattr(profile, name))


def _order(r: BenchResult) -> tuple[int, int, float]:
    return (r.input_len or 0, MODE_ORDER.get(r.metadata.get("mode", ""), 9), _rate(r))


def _rate(r: BenchResult) -> float:
    return float(r.request_rate)


def load_sweep(directory: Path) -> list[BenchResult]:
    """The sweep's per-point results (`<mode>-in<L>-r<R>.json`), sorted by input, mode,
    rate. Files of other shapes (report, manifest, simulated runs) are skipped."""
    results = []
    for path in sorted(Path(directory).glob("*-in*-r*.json")):
        if path.name.startswith("sim-"):
            continue
        result = load_result(path)
        if result.metadata.get("mode") in MODE_ORDER and result.input_len is not None:
            results.append(result)
    if not results:
        raise ValueError(f"no sweep results (<mode>-in<L>-r<R>.json) in {directory}")
    return sorted(results, key=_order)


def reference_points(
    results: Sequence[BenchResult], is_fit: Callable[[BenchResult], bool]
) -> list[Point]:
    """One Point per (result, metric) the result has; `tuned` on the fit results' medians."""
    points = []
    for r in results:
        note = f"{r.failed} of {r.num_prompts} failed" if r.failed else ""
        for metric in METRICS:
            value = getattr(r, metric)
            if value is None or not math.isfinite(value) or value <= 0:
                continue
            points.append(
                Point(
                    source="measured",
                    input_len=r.input_len or 0,
                    output_len=r.output_len or 0,
                    rate=_rate(r),
                    mode=r.metadata["mode"],
                    metric=metric,
                    value=round(float(value), 2),
                    seed=r.seed,
                    tuned=is_fit(r) and metric in FIT_METRICS,
                    note=note,
                )
            )
    return points


def with_params(
    vs: ValidationSet, params: Sequence[FitParam], values: Sequence[float]
) -> ValidationSet:
    """`vs` with each parameter's value written into its overrides."""
    overrides = dict(vs.overrides)
    mode_overrides = {mode: dict(o) for mode, o in vs.mode_overrides.items()}
    for p, value in zip(params, values, strict=True):
        target = overrides if p.mode is None else mode_overrides.setdefault(p.mode, {})
        target[p.key] = f"{value:.4g}"
    return msgspec.structs.replace(vs, overrides=overrides, mode_overrides=mode_overrides)


def fit_error(outcomes: Sequence[Outcome]) -> float:
    """Mean squared log error of the tuned figures (a figure the sim cannot produce, e.g. a
    NaN, counts as a large error)."""
    errors = [
        math.log(o.simulated / o.point.value) ** 2 if o.simulated > 0 else 25.0
        for o in outcomes
        if o.point.tuned
    ]
    return sum(errors) / len(errors)


def _fit_only(vs: ValidationSet) -> ValidationSet:
    return msgspec.structs.replace(vs, points=[p for p in vs.points if p.tuned])


def fit(
    vs: ValidationSet,
    params: Sequence[FitParam] = FIT_PARAMS,
    min_step: float = 1.02,
    log: Callable[[str], None] | None = None,
) -> tuple[list[float], float]:
    """Coordinate descent on the tuned points of `vs`: (fitted values, final error)."""
    target = _fit_only(vs)
    if not target.points:
        raise ValueError("no tuned points to fit to")
    values = [start_value(vs, p) for p in params]

    def error(vals: Sequence[float]) -> float:
        return fit_error(evaluate(with_params(target, params, vals)))

    best = error(values)
    step = 2.0
    while step >= min_step:
        moved = False
        for i, p in enumerate(params):
            for factor in (step, 1 / step):
                trial = list(values)
                trial[i] = min(p.high, max(p.low, values[i] * factor))
                if trial[i] == values[i]:
                    continue
                err = error(trial)
                if err < best:
                    values, best, moved = trial, err, True
                    break
        if log is not None:
            log(f"step x{step:.3f}: error {best:.4f}")
        if not moved:
            step = math.sqrt(step)
    return values, best


def fitted_note(params: Sequence[FitParam], values: Sequence[float], fit_desc: str) -> str:
    """The `fitted` text of the validation set: what, to which points, to what values."""
    items = "; ".join(f"{p.label} = {v:.4g}" for p, v in zip(params, values, strict=True))
    return f"Fitted to {fit_desc} (figures: {', '.join(FIT_METRICS)}): {items}."


def build(
    template: ValidationSet,
    results: Sequence[BenchResult],
    fit_rate: float | None = None,
    params: Sequence[FitParam] = FIT_PARAMS,
    log: Callable[[str], None] | None = None,
) -> ValidationSet:
    """The calibrated validation set: `template`'s settings, the measured points, the fit."""
    lightest = min(_rate(r) for r in results) if fit_rate is None else fit_rate
    points = reference_points(results, lambda r: _rate(r) == lightest)
    vs = msgspec.structs.replace(
        template, points=points, num_prompts=max(r.num_prompts for r in results)
    )
    values, _ = fit(vs, params, log=log)
    desc = f"the {lightest:g} req/s point of every input length, every mode"
    return msgspec.structs.replace(
        with_params(vs, params, values), fitted=fitted_note(params, values, desc)
    )


def template_set(name: str, description: str, assumptions: str) -> ValidationSet:
    """pdserve's local sweep on this machine: 1 P + 1 D pinned to a core each, and one
    monolithic instance with both cores (two threads) and no router."""
    return ValidationSet(
        name=name,
        description=description,
        model="builtin-small",
        hardware="cpu-epyc-1core",
        software="pdserve-cpu",
        num_monolithic=1,
        monolithic_router=False,
        mode_overrides={
            "monolithic": {"hardware.peak_flops": "134.6e9", "hardware.mem_bw": "33.8e9"}
        },
        assumptions=assumptions,
        points=[],
    )


def _ms(value: float) -> str:
    if not math.isfinite(value):
        return str(value)
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def _wide_rows(outcomes: Sequence[Outcome]) -> list[str]:
    """One markdown row per (input, rate, mode): measured / simulated (error) per metric."""
    cells: dict[tuple, dict[str, Outcome]] = {}
    for o in outcomes:
        p = o.point
        cells.setdefault((p.input_len, p.rate, MODE_ORDER[p.mode], p.mode), {})[p.metric] = o
    rows = []
    for (input_len, rate, _, mode), by_metric in sorted(cells.items()):
        fitted = any(o.point.tuned for o in by_metric.values())
        row = [str(input_len), f"{rate:g}", mode, "yes" if fitted else "no"]
        for metric in METRICS:
            o = by_metric.get(metric)
            row.append(
                "-"
                if o is None
                else f"{_ms(o.point.value)} / {_ms(o.simulated)} ({o.error_pct:+.0f}%)"
            )
        rows.append("| " + " | ".join(row) + " |")
    return rows


def wide_table(outcomes: Sequence[Outcome]) -> str:
    """Markdown: measured / simulated (error) for every metric of every point."""
    head = [
        "input",
        "rate",
        "mode",
        "fitted",
        "TTFT p50 (ms)",
        "TTFT p99",
        "TPOT p50",
        "TPOT p99",
        "handoff p50",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join([*lines, *_wide_rows(outcomes)])


def error_summary(outcomes: Sequence[Outcome]) -> str:
    """Median and worst absolute error per metric, held-out figures only."""
    lines = ["| metric | figures not fitted to | median abs error | worst |", "|---|---|---|---|"]
    for metric in METRICS:
        errs = sorted(
            abs(o.error_pct) for o in outcomes if o.point.metric == metric and not o.point.tuned
        )
        if errs:
            mid = (
                errs[len(errs) // 2]
                if len(errs) % 2
                else (errs[len(errs) // 2 - 1] + errs[len(errs) // 2]) / 2
            )
            lines.append(f"| {metric} | {len(errs)} | {mid:.0f}% | {errs[-1]:.0f}% |")
    return "\n".join(lines)


def dump_validation(vs: ValidationSet) -> str:
    """The set as JSON, one point per line, fields at their defaults left out."""
    raw = msgspec.to_builtins(vs)
    points = [
        {k: v for k, v in point.items() if v not in (None, "", False)}
        for point in raw.pop("points")
    ]
    lines = ",\n".join(f"  {json.dumps(point)}" for point in points)
    return json.dumps(raw, indent=1)[:-2] + f',\n "points": [\n{lines}\n ]\n}}\n'


@dataclass(frozen=True)
class CalibrateConfig:
    """One calibration (`python -m pdserve.sim.calibrate`'s flags): the measured sweep it
    fits to and the validation set it writes."""

    measured: Path = option(help="a `bench sweep` --out-dir")
    out: Path = option(help="validation set JSON to write")
    name: str | None = option(None, help="set name (default: the file's stem)")
    description: str = option("", help="")
    assumptions: str = option("", help="")
    fit_rate: float | None = option(None, help="default: the lightest rate")


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: read a measured sweep, fit, write the validation set, print the tables."""
    parser = argparse.ArgumentParser(
        prog="python -m pdserve.sim.calibrate", description=__doc__.split("\n")[0]
    )
    add_options(parser, CalibrateConfig)
    return calibrate(from_args(CalibrateConfig, parser.parse_args(argv)))


def calibrate(cfg: CalibrateConfig) -> int:
    """Read the measured sweep, fit, write the validation set, print the tables."""
    template = template_set(cfg.name or cfg.out.stem, cfg.description, cfg.assumptions)
    vs = build(template, load_sweep(cfg.measured), cfg.fit_rate, log=print)
    cfg.out.write_text(dump_validation(vs))
    print(f"wrote {cfg.out}\n{vs.fitted}\n")
    outcomes = evaluate(vs)
    print(wide_table(outcomes) + "\n\n" + error_summary(outcomes))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
