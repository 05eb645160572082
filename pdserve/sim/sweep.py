"""A grid of simulated runs (input lengths x request rates x modes), like `bench sweep`.

Every point keeps the base run's workload (output length, prompts, burstiness...) and
changes only the input length, the rate and the mode. Its seed is `pdserve bench sweep`'s
(`pdserve.bench.sweep.point_seed`, the same function: equal across modes, different across
points), so a simulated point draws exactly the prompts and arrival times of the measured
point with the same base seed, and the two sit side by side in one report.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from pathlib import Path

from tqdm import tqdm

from pdserve.bench.metrics import BenchResult, save_result
from pdserve.bench.sweep import point_seed
from pdserve.bench.sweep_report import rate_label
from pdserve.sim.cluster_config import Mode
from pdserve.sim.run import SimConfig, run_sim


def point_config(base: SimConfig, input_len: int, rate: float, mode: Mode) -> SimConfig:
    """`base` with one point's input length, request rate, mode and seed."""
    wl = base.workload
    workload = dataclasses.replace(
        wl,
        random=dataclasses.replace(wl.random, input_len=input_len),
        arrivals=dataclasses.replace(wl.arrivals, request_rate=rate),
        seed=point_seed(wl.seed, input_len, rate),
        metadata=(*wl.metadata, ("input_len", str(input_len)), ("rate", rate_label(rate))),
    )
    cluster = dataclasses.replace(base.cluster, mode=mode)
    return dataclasses.replace(base, workload=workload, cluster=cluster)


def result_name(result: BenchResult) -> str:
    """File name of a run's JSON: sim-<mode>-in<L>-r<rate>.json (`bench sweep`'s stem)."""
    return f"sim-{result.metadata['mode']}-in{result.input_len}-r{rate_label(result.rate)}.json"


def run_sweep(
    base: SimConfig,
    input_lens: Sequence[int],
    rates: Sequence[float],
    modes: Sequence[Mode],
    out_dir: Path | None = None,
    progress: bool = True,
) -> list[BenchResult]:
    """Simulate every point; save each JSON under `out_dir` when given."""
    grid = list(itertools.product(input_lens, rates, modes))
    results = []
    for input_len, rate, mode in tqdm(grid, disable=not progress, unit="point"):
        result = run_sim(point_config(base, input_len, rate, mode))
        if out_dir is not None:
            save_result(result, Path(out_dir) / result_name(result))
        results.append(result)
    return results
