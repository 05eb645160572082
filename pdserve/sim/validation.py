"""Validation sets: published or measured figures, and the simulator's error at each.

A validation set (`pdserve/sim/profiles/validation/NAME.json`) names the profiles and
layout it applies to, the workload assumptions the source left out (prompts per point,
output length), and a list of points: (input, output, rate, mode, metric, value). Each
point says whether it was used to set a parameter (`tuned`), so the error of the others
is a prediction. `pdserve sim --validate NAME` prints the table `docs/simulator.md` shows.
"""

from __future__ import annotations

import dataclasses
import math
from importlib import resources
from pathlib import Path

import msgspec

from pdserve.bench.arrivals import ArrivalConfig
from pdserve.bench.dataset import RandomDatasetConfig
from pdserve.bench.metrics import BenchResult
from pdserve.bench.serve import BenchConfig
from pdserve.sim.cluster_config import ClusterConfig, Mode
from pdserve.sim.profiles import (
    HardwareProfile,
    ModelProfile,
    SoftwareProfile,
    load_hardware,
    load_model,
    load_software,
    with_overrides,
)
from pdserve.sim.run import SimConfig, run_sim


class Point(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One reference figure: `metric` is a BenchResult field (median_ttft_ms, ...)."""

    source: str
    input_len: int
    output_len: int
    rate: float
    mode: Mode
    metric: str
    value: float
    max_concurrency: int | None = None  # 1 with rate inf: one request at a time
    seed: int | None = None  # the measured run's bench seed (same prompts and arrivals)
    tuned: bool = False
    note: str = ""


class ValidationSet(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Reference figures for one setting and how to simulate it."""

    name: str
    description: str
    model: str
    hardware: str
    software: str
    tp_prefill: int = 1
    tp_decode: int = 1
    num_prefill: int = 1
    num_decode: int = 1
    num_prompts: int = 100
    seed: int = 0
    num_monolithic: int | None = None  # monolithic instances (None: num_prefill + num_decode)
    monolithic_router: bool = True
    overrides: dict[str, str] = {}  # "section.field" -> value, as `--set`, every mode
    mode_overrides: dict[str, dict[str, str]] = {}  # mode -> overrides on top of those
    assumptions: str = ""
    fitted: str = ""  # which parameters were fitted, to which points, how
    points: list[Point]


@dataclasses.dataclass(frozen=True)
class Outcome:
    """A point and what the simulator says there."""

    point: Point
    simulated: float

    @property
    def error_pct(self) -> float:
        return 100.0 * (self.simulated - self.point.value) / self.point.value


def load_validation(name_or_path: str) -> ValidationSet:
    """A shipped validation set by name, or a JSON file by path."""
    path = Path(name_or_path)
    if path.suffix != ".json" or not path.is_file():
        entry = resources.files("pdserve.sim") / "profiles" / "validation" / f"{name_or_path}.json"
        if not entry.is_file():
            raise ValueError(f"no validation set {name_or_path!r}")
        return msgspec.json.decode(entry.read_bytes(), type=ValidationSet, strict=False)
    return msgspec.json.decode(path.read_bytes(), type=ValidationSet, strict=False)


def profiles_for(
    vs: ValidationSet, mode: Mode
) -> tuple[ModelProfile, HardwareProfile, SoftwareProfile]:
    """The set's profiles with its overrides and the mode's applied."""
    sections: dict[str, dict[str, str]] = {"model": {}, "hardware": {}, "software": {}}
    for key, value in {**vs.overrides, **vs.mode_overrides.get(mode, {})}.items():
        section, _, name = key.partition(".")
        if section not in sections or not name:
            raise ValueError(f"{vs.name}: override {key!r} is not model/hardware/software.FIELD")
        sections[section][name] = value
    return (
        with_overrides(load_model(vs.model), sections["model"]),
        with_overrides(load_hardware(vs.hardware), sections["hardware"]),
        with_overrides(load_software(vs.software), sections["software"]),
    )


def point_config(
    vs: ValidationSet,
    input_len: int,
    output_len: int,
    rate: float,
    mode: Mode,
    max_concurrency: int | None = None,
    seed: int | None = None,
) -> SimConfig:
    """The SimConfig of one point of `vs` (`seed`: the point's own, else the set's)."""
    model, hardware, software = profiles_for(vs, mode)
    mono = mode == "monolithic" and vs.num_monolithic is not None
    cluster = ClusterConfig(
        model=model,
        hardware=hardware,
        software=software,
        mode=mode,
        num_prefill=vs.num_monolithic if mono else vs.num_prefill,
        num_decode=0 if mono else vs.num_decode,
        tp_prefill=vs.tp_prefill,
        tp_decode=vs.tp_decode,
        monolithic_router=vs.monolithic_router,
    )
    workload = BenchConfig(
        random=RandomDatasetConfig(input_len=input_len, output_len=output_len),
        num_prompts=vs.num_prompts,
        arrivals=ArrivalConfig(request_rate=rate),
        max_concurrency=max_concurrency,
        seed=vs.seed if seed is None else seed,
        disable_tqdm=True,
    )
    return SimConfig(cluster=cluster, workload=workload)


def evaluate(vs: ValidationSet) -> list[Outcome]:
    """Simulate every distinct point once and compare each figure."""
    runs: dict[tuple, BenchResult] = {}
    outcomes = []
    for p in vs.points:
        key = (p.input_len, p.output_len, p.rate, p.mode, p.max_concurrency, p.seed)
        if key not in runs:
            runs[key] = run_sim(point_config(vs, *key))
        value = getattr(runs[key], p.metric)
        outcomes.append(Outcome(p, math.nan if value is None else float(value)))
    return outcomes


def table(outcomes: list[Outcome]) -> str:
    """Markdown: one row per figure with the simulated value and the error."""
    cols = ["source", "input", "output", "load", "mode", "metric", "reference", "simulated"]
    lines = ["| " + " | ".join([*cols, "error", "tuned"]) + " |", "|" + "---|" * 10]
    for o in outcomes:
        p = o.point
        lines.append(
            f"| {p.source} | {p.input_len} | {p.output_len} | {_load(p)} | {p.mode} | "
            f"{p.metric} | {p.value:g} | {o.simulated:.1f} | {o.error_pct:+.0f}% | "
            f"{'yes' if p.tuned else 'no'} |"
        )
    return "\n".join(lines)


def _load(p: Point) -> str:
    if p.max_concurrency is not None and math.isinf(p.rate):
        return "one at a time" if p.max_concurrency == 1 else f"{p.max_concurrency} in flight"
    return f"{p.rate:g} req/s"
