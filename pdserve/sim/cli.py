"""`pdserve sim`: simulate a P/D cluster and predict pull vs push TTFT and TPOT.

One run per mode given (`--mode pull push`), or a grid with `--sweep` (input lengths x
rates x modes). The workload flags are `pdserve bench serve`'s, and results are the same
JSON and report, marked metadata source=sim, so simulated and measured runs sit side by
side (`python -m pdserve.bench.report measured/*.json simulated/*.json`).

    pdserve sim --model qwen3-32b --hardware h200-p5en --software vllm-gpu --tp 4 \\
        --input-len 16384 --output-len 128 --request-rate 8 --mode pull push
    pdserve sim --sweep --input-lens 1024 4096 16384 --rates 1 2 4 8 --out sim-results/
    pdserve sim --list-profiles
    pdserve sim --validate seed-p5en

`run` does what a `SimCommand` asks on a workload; pdserve.sim.sim_args builds both from the
flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pdserve.bench.arrivals import ArrivalConfig
from pdserve.bench.dataset import RandomDatasetConfig, TraceError
from pdserve.bench.metrics import BenchResult, save_result
from pdserve.bench.serve import BenchConfig
from pdserve.options import add_options, key_value, option
from pdserve.sim.cluster_config import ClusterConfig, Mode
from pdserve.sim.profiles import (
    builtin_names,
    load_hardware,
    load_model,
    load_software,
    with_overrides,
)
from pdserve.sim.run import SimConfig, run_sim
from pdserve.sim.sweep import result_name, run_sweep


@dataclass(frozen=True)
class SimCommand:
    """What `pdserve sim` is asked to do, besides the workload (`pdserve bench serve`'s
    configs): the simulated cluster's profiles and layout, the modes, the sweep's grid and
    where results go; or one of the other jobs (list profiles, validate, planner shift)."""

    # cluster
    model: str = option("qwen3-32b", help="model profile name or JSON path")
    hardware: str = option("h200-p5en", help="hardware profile name or JSON path")
    software: str = option("vllm-gpu", help="software profile name or JSON path")
    tp: int | None = option(None, help="TP size of every instance")
    tp_prefill: int = option(1, help="")
    tp_decode: int = option(1, help="")
    num_prefill: int = option(1, help="")
    num_decode: int = option(1, help="")
    mode: tuple[Mode, ...] = option(("pull", "push"), nargs="+", help="")
    overrides: tuple[tuple[str, str], ...] = option(
        (),
        flag="--set",
        nargs="*",
        parse=key_value,
        metavar="SECTION.FIELD=VALUE",
        help="override a profile field, e.g. software.per_descriptor_s=1e-6 "
        "hardware.flops_efficiency=0.5",
    )
    list_profiles: bool = option(False, help="print built-in profiles")
    validate: str | None = option(
        None,
        metavar="NAME",
        help="simulate a validation set (e.g. seed-p5en) and print the error per point",
    )
    planner_shift: bool = option(
        False,
        help="replay a load that shifts from prefill-heavy to decode-heavy with the planner "
        "choosing the layout each window, against fixed 1P1D/2P1D/1P2D, in the first --mode "
        "(docs/multi-host.md)",
    )
    # sweep
    sweep: bool = option(False, help="grid of input lengths x rates x modes")
    input_lens: tuple[int, ...] = option((1024, 4096, 16384), nargs="+", help="")
    rates: tuple[float, ...] = option((1.0, 2.0, 4.0, 8.0), nargs="+", help="")
    # output
    save_result: Path | None = option(None, help="JSON of a one-mode run")
    out: Path | None = option(None, help="save every run and the report here")


_CLUSTER = (
    "model",
    "hardware",
    "software",
    "tp",
    "tp_prefill",
    "tp_decode",
    "num_prefill",
    "num_decode",
    "mode",
    "overrides",
    "list_profiles",
    "validate",
    "planner_shift",
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `pdserve sim` (declared on `SimCommand` and `pdserve bench serve`'s configs)."""
    add_options(parser.add_argument_group("cluster"), SimCommand, only=_CLUSTER)

    # The flags of `pdserve bench serve` for the same fields (declared on its configs).
    w = parser.add_argument_group("workload (as `pdserve bench serve`)")
    add_options(w, BenchConfig, only=("trace_path", "use_trace_timing", "num_prompts"))
    add_options(w, RandomDatasetConfig, only=("input_len", "output_len", "range_ratio"))
    add_options(w, ArrivalConfig)
    add_options(w, BenchConfig, only=("max_concurrency", "seed", "num_warmups"))

    s = parser.add_argument_group("sweep")
    add_options(s, SimCommand, only=("sweep", "input_lens", "rates"))

    o = parser.add_argument_group("output")
    add_options(o, BenchConfig, only=("goodput", "label", "metadata"))
    add_options(o, SimCommand, only=("save_result", "out"))
    add_options(o, BenchConfig, only=("disable_tqdm",))


def _overrides(items: Sequence[tuple[str, str]]) -> dict[str, dict[str, str]]:
    sections: dict[str, dict[str, str]] = {"model": {}, "hardware": {}, "software": {}}
    for key, value in items:
        section, _, name = key.partition(".")
        if section not in sections or not name:
            raise ValueError(f"--set {key}: use model.FIELD, hardware.FIELD or software.FIELD")
        sections[section][name] = value
    return sections


def sim_config(cmd: SimCommand, workload: BenchConfig) -> SimConfig:
    """The base SimConfig (first mode): the profiles loaded, with `--set`'s overrides;
    ValueError when invalid."""
    sets = _overrides(cmd.overrides)
    model = with_overrides(load_model(cmd.model), sets["model"])
    hardware = with_overrides(load_hardware(cmd.hardware), sets["hardware"])
    software = with_overrides(load_software(cmd.software), sets["software"])
    cluster = ClusterConfig(
        model=model,
        hardware=hardware,
        software=software,
        mode=cmd.mode[0],
        num_prefill=cmd.num_prefill,
        num_decode=cmd.num_decode,
        tp_prefill=cmd.tp or cmd.tp_prefill,
        tp_decode=cmd.tp or cmd.tp_decode,
        warm=workload.num_warmups > 0,
    )
    return SimConfig(cluster=cluster, workload=workload)


def _list_profiles() -> str:
    kinds = ("models", "hardware", "software")
    return "\n".join(f"{kind}: {', '.join(builtin_names(kind))}" for kind in kinds)


def _validate(name: str) -> int:
    from pdserve.sim.validation import evaluate, load_validation, table

    try:
        vs = load_validation(name)
    except ValueError as exc:
        print(f"pdserve sim: {exc}", file=sys.stderr)
        return 1
    print(f"{vs.name}: {vs.description}\n")
    if vs.fitted:
        print(f"{vs.fitted}\n")
    outcomes = evaluate(vs)
    if all(o.point.source == "measured" for o in outcomes):
        from pdserve.sim.calibrate import error_summary, wide_table

        print(f"{wide_table(outcomes)}\n\n{error_summary(outcomes)}")
    else:
        print(table(outcomes))
    return 0


def _run(cmd: SimCommand, workload: BenchConfig) -> list[BenchResult]:
    cfg = sim_config(cmd, workload)
    if cmd.sweep:
        if workload.trace_path is not None:
            raise ValueError("--sweep varies input lengths; it cannot replay a trace")
        return run_sweep(
            cfg, cmd.input_lens, cmd.rates, cmd.mode, cmd.out, not workload.disable_tqdm
        )
    results = []
    for mode in cmd.mode:
        point = dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, mode=mode))
        result = run_sim(point)
        if cmd.out is not None:
            save_result(result, cmd.out / result_name(result))
        results.append(result)
    return results


def run(cmd: SimCommand, workload: BenchConfig) -> int:
    """Do what `cmd` asks on `workload`; the exit status."""
    from pdserve.bench.report import format_run, summarize, write_report

    if cmd.list_profiles:
        print(_list_profiles())
        return 0
    if cmd.validate:
        return _validate(cmd.validate)
    if cmd.planner_shift:
        from pdserve.sim.planner_replay import shift_report

        print(shift_report(sim_config(cmd, workload).cluster))
        return 0
    if cmd.save_result is not None and (cmd.sweep or len(cmd.mode) > 1):
        print("pdserve sim: --save-result takes one run; use --out DIR", file=sys.stderr)
        return 2
    try:
        results = _run(cmd, workload)
    except (ValueError, TraceError) as exc:
        print(f"pdserve sim: {exc}", file=sys.stderr)
        return 1
    if len(results) == 1:
        print(format_run(results[0]))
    print(summarize(results))
    if cmd.save_result is not None:
        save_result(results[0], cmd.save_result)
        print(f"saved {cmd.save_result}")
    if cmd.out is not None:
        files = write_report(results, cmd.out)
        print(f"wrote {len(results)} results, {files.markdown} and {len(files.plots)} plots")
    return 0
