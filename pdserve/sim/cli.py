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
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from pdserve.bench.arrivals import ArrivalConfig
from pdserve.bench.dataset import RandomDatasetConfig, TraceError
from pdserve.bench.metrics import BenchResult, parse_goodput, save_result
from pdserve.bench.serve import BenchConfig
from pdserve.options import add_options, from_args
from pdserve.sim.cluster_config import MODES, ClusterConfig
from pdserve.sim.profiles import (
    builtin_names,
    load_hardware,
    load_model,
    load_software,
    with_overrides,
)
from pdserve.sim.run import SimConfig, run_sim
from pdserve.sim.sweep import result_name, run_sweep

DEFAULT_NUM_PROMPTS = 100


def _key_value(item: str) -> tuple[str, str]:
    key, sep, value = item.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {item!r}")
    return key.strip(), value.strip()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `pdserve sim`."""
    c = parser.add_argument_group("cluster")
    c.add_argument("--model", default="qwen3-32b", help="model profile name or JSON path")
    c.add_argument("--hardware", default="h200-p5en", help="hardware profile name or JSON path")
    c.add_argument("--software", default="vllm-gpu", help="software profile name or JSON path")
    c.add_argument("--tp", type=int, default=None, help="TP size of every instance")
    c.add_argument("--tp-prefill", type=int, default=1)
    c.add_argument("--tp-decode", type=int, default=1)
    c.add_argument("--num-prefill", type=int, default=1)
    c.add_argument("--num-decode", type=int, default=1)
    c.add_argument("--mode", nargs="+", choices=MODES, default=["pull", "push"])
    c.add_argument(
        "--set",
        nargs="*",
        type=_key_value,
        default=[],
        metavar="SECTION.FIELD=VALUE",
        help="override a profile field, e.g. software.per_descriptor_s=1e-6 "
        "hardware.flops_efficiency=0.5",
    )
    c.add_argument("--list-profiles", action="store_true", help="print built-in profiles")
    c.add_argument(
        "--validate",
        default=None,
        metavar="NAME",
        help="simulate a validation set (e.g. seed-p5en) and print the error per point",
    )
    c.add_argument(
        "--planner-shift",
        action="store_true",
        help="replay a load that shifts from prefill-heavy to decode-heavy with the planner "
        "choosing the layout each window, against fixed 1P1D/2P1D/1P2D, in the first --mode "
        "(docs/multi-host.md)",
    )

    # The flags of `pdserve bench serve` for the same fields (declared on its configs).
    w = parser.add_argument_group("workload (as `pdserve bench serve`)")
    add_options(w, BenchConfig, only=("trace_path", "use_trace_timing", "num_prompts"))
    add_options(w, RandomDatasetConfig, only=("input_len", "output_len", "range_ratio"))
    add_options(w, ArrivalConfig)
    add_options(w, BenchConfig, only=("max_concurrency", "seed", "num_warmups"))

    s = parser.add_argument_group("sweep")
    s.add_argument("--sweep", action="store_true", help="grid of input lengths x rates x modes")
    s.add_argument("--input-lens", type=int, nargs="+", default=[1024, 4096, 16384])
    s.add_argument("--rates", type=float, nargs="+", default=[1.0, 2.0, 4.0, 8.0])

    o = parser.add_argument_group("output")
    add_options(o, BenchConfig, only=("goodput", "label", "metadata"))
    o.add_argument("--save-result", type=Path, default=None, help="JSON of a one-mode run")
    o.add_argument("--out", type=Path, default=None, help="save every run and the report here")
    add_options(o, BenchConfig, only=("disable_tqdm",))


def _overrides(items: list[tuple[str, str]]) -> dict[str, dict[str, str]]:
    sections: dict[str, dict[str, str]] = {"model": {}, "hardware": {}, "software": {}}
    for key, value in items:
        section, _, name = key.partition(".")
        if section not in sections or not name:
            raise ValueError(f"--set {key}: use model.FIELD, hardware.FIELD or software.FIELD")
        sections[section][name] = value
    return sections


def config_from_args(args: argparse.Namespace) -> SimConfig:
    """The base SimConfig (first mode) from parsed flags; ValueError when invalid."""
    sets = _overrides(args.set)
    model = with_overrides(load_model(args.model), sets["model"])
    hardware = with_overrides(load_hardware(args.hardware), sets["hardware"])
    software = with_overrides(load_software(args.software), sets["software"])
    cluster = ClusterConfig(
        model=model,
        hardware=hardware,
        software=software,
        mode=args.mode[0],
        num_prefill=args.num_prefill,
        num_decode=args.num_decode,
        tp_prefill=args.tp or args.tp_prefill,
        tp_decode=args.tp or args.tp_decode,
        warm=args.num_warmups > 0,
    )
    workload = from_args(
        BenchConfig,
        args,
        model=None,  # `--model` is the simulated model's profile here, not a served name
        random=from_args(RandomDatasetConfig, args),
        num_prompts=args.num_prompts or (None if args.dataset_path else DEFAULT_NUM_PROMPTS),
        arrivals=from_args(ArrivalConfig, args),
        goodput=tuple(parse_goodput(args.goodput).items()),
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


def _run(cfg: SimConfig, args: argparse.Namespace) -> list[BenchResult]:
    if args.sweep:
        if args.dataset_path is not None:
            raise ValueError("--sweep varies input lengths; it cannot replay a trace")
        return run_sweep(
            cfg, args.input_lens, args.rates, args.mode, args.out, not args.disable_tqdm
        )
    results = []
    for mode in args.mode:
        point = dataclasses.replace(cfg, cluster=dataclasses.replace(cfg.cluster, mode=mode))
        result = run_sim(point)
        if args.out is not None:
            save_result(result, args.out / result_name(result))
        results.append(result)
    return results


def main(args: argparse.Namespace) -> int:
    """Simulate, print the summary, save JSONs and the report as asked."""
    from pdserve.bench.report import format_run, summarize, write_report

    if args.list_profiles:
        print(_list_profiles())
        return 0
    if args.validate:
        return _validate(args.validate)
    if args.planner_shift:
        from pdserve.sim.planner_replay import shift_report

        print(shift_report(config_from_args(args).cluster))
        return 0
    if args.save_result is not None and (args.sweep or len(args.mode) > 1):
        print("pdserve sim: --save-result takes one run; use --out DIR", file=sys.stderr)
        return 2
    try:
        results = _run(config_from_args(args), args)
    except (ValueError, TraceError) as exc:
        print(f"pdserve sim: {exc}", file=sys.stderr)
        return 1
    if len(results) == 1:
        print(format_run(results[0]))
    print(summarize(results))
    if args.save_result is not None:
        save_result(results[0], args.save_result)
        print(f"saved {args.save_result}")
    if args.out is not None:
        files = write_report(results, args.out)
        print(f"wrote {len(results)} results, {files.markdown} and {len(files.plots)} plots")
    return 0
