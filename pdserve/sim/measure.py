"""Measure this machine for the simulator: a hardware and a software profile from timings.

`python -m pdserve.sim.measure --out-dir DIR` times, on `--threads` torch threads:
- peak FLOP/s: a square float32 matmul (the best of several repeats);
- memory bandwidth: a large tensor copy (bytes read + written per second);
- pdserve's engine (`LLMEngine`, no HTTP) on a built-in model: prefill steps of several
  lengths and decode steps of several batch sizes.
Each engine step's roofline terms are known from the model profile, so the achieved
efficiencies (FLOPs and bytes) and the host overheads (per step, per sequence) are fitted
to the step times of a few steps (FIT_PREFILL, FIT_DECODE) by least squares, and the other
steps are predicted from them (the printed table gives each step's error). The result is
DIR/hardware.json and DIR/software.json, ready for
`pdserve sim --hardware DIR/hardware.json --software DIR/software.json`.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pdserve.options import add_options, from_args, option
from pdserve.sim.costs import CostModel, SeqWork, step_bytes, step_flops
from pdserve.sim.profiles import HardwareProfile, ModelProfile, SoftwareProfile, load_model

PREFILL_LENS = (128, 256, 512, 1024, 2048)
DECODE_BATCHES = (1, 4, 16)
DECODE_CTXS = (256, 2048)
# The steps the efficiencies and overheads are fitted to; the others are predictions.
FIT_PREFILL = (128, 2048)
FIT_DECODE = ((1, 256), (16, 256))


def _best_of(fn: Callable[[], None], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def matmul_flops(n: int = 1024, repeats: int = 5) -> float:
    """Best float32 FLOP/s of an n x n matmul."""
    import torch

    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b  # warm-up
    return 2 * n**3 / _best_of(lambda: a @ b, repeats)


def copy_bandwidth(num_bytes: int = 256 << 20, repeats: int = 5) -> float:
    """Best bytes/s of a tensor copy, counting the read and the write."""
    import torch

    src = torch.ones(num_bytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    return 2 * num_bytes / _best_of(lambda: dst.copy_(src), repeats)


def engine_samples(model: str, repeats: int = 3) -> list[tuple[list[SeqWork], float]]:
    """(step shape, best seconds) for prefill and decode steps of pdserve's engine."""
    from pdserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from pdserve.engine.engine import LLMEngine
    from pdserve.engine.types import EngineRequest, SamplingParams

    cfg = EngineConfig(
        model=ModelConfig(model=model, dtype="float32"),
        cache=CacheConfig(kv_cache_memory_gib=0.5),
        scheduler=SchedulerConfig(max_num_batched_tokens=max(PREFILL_LENS), max_num_seqs=64),
    )
    engine = LLMEngine.from_config(cfg)
    rng = random.Random(0)
    ids = iter(range(10**9))

    def add(n: int, max_tokens: int) -> None:
        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        prompt = [rng.randrange(10, 250) for _ in range(n)]
        engine.add_request(
            EngineRequest(request_id=f"m{next(ids)}", prompt_token_ids=prompt, params=sp)
        )

    def drain() -> None:
        while engine.has_work():
            engine.step()

    samples = []
    add(64, 2)
    drain()  # warm-up
    for n in PREFILL_LENS:
        best = float("inf")
        for _ in range(repeats):
            add(n, 1)
            t0 = time.perf_counter()
            engine.step()
            best = min(best, time.perf_counter() - t0)
            drain()
        samples.append(([SeqWork(n, 0, True)], best))
    for batch, ctx in ((b, c) for c in DECODE_CTXS for b in DECODE_BATCHES):
        for _ in range(batch):
            add(ctx, 2 + 8 * repeats)
        while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.requests.values()):
            engine.step()
        steps = []
        for _ in range(8 * repeats):
            t0 = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - t0)
        drain()
        samples.append(([SeqWork(1, ctx, True)] * batch, float(np.median(steps))))
    return samples


def is_fit_sample(seqs: list[SeqWork]) -> bool:
    """Whether a sample is one the fit uses (FIT_PREFILL, FIT_DECODE)."""
    first = seqs[0]
    if first.num_cached == 0:
        return first.num_new in FIT_PREFILL
    return (len(seqs), first.num_cached) in FIT_DECODE


def fit(
    model: ModelProfile, peak_flops: float, mem_bw: float, samples: list
) -> tuple[float, float, float, float]:
    """(flops_eff, bw_eff, step_overhead_s, seq_overhead_s) minimising relative error of
    t = max(F / (peak * ef), B / (bw * eb)) + step + seq * n over the samples."""
    flops = np.array([step_flops(model, s) for s, _ in samples]) / peak_flops
    mem = np.array([step_bytes(model, s) for s, _ in samples]) / mem_bw
    nseq = np.array([len(s) for s, _ in samples], dtype=float)
    t = np.array([secs for _, secs in samples])
    best = (np.inf, 1.0, 1.0, 0.0, 0.0)
    for ef in np.geomspace(0.005, 1.0, 80):
        for eb in np.geomspace(0.005, 1.0, 80):
            roof = np.maximum(flops / ef, mem / eb)
            a = np.stack([np.ones_like(t), nseq], axis=1) / t[:, None]
            coef, *_ = np.linalg.lstsq(a, 1.0 - roof / t, rcond=None)
            coef = np.maximum(coef, 0.0)
            err = float(np.sum((roof + a @ coef * t - t) ** 2 / t**2))
            if err < best[0]:
                best = (err, float(ef), float(eb), float(coef[0]), float(coef[1]))
    return best[1], best[2], best[3], best[4]


def measure(model_name: str, threads: int) -> tuple[HardwareProfile, SoftwareProfile, list]:
    """Profiles of this machine from measurement (see the module docstring)."""
    import torch

    torch.set_num_threads(threads)
    model = load_model(model_name.replace("builtin:", "builtin-"))
    peak, bw = matmul_flops(), copy_bandwidth()
    samples = engine_samples(model_name)
    ef, eb, step_o, seq_o = fit(model, peak, bw, [x for x in samples if is_fit_sample(x[0])])
    when = time.strftime("%Y-%m-%d")
    hardware = HardwareProfile(
        name="cpu-measured",
        peak_flops=peak,
        mem_bw=bw,
        mem_capacity=8e9,
        devices_per_node=1,
        flops_efficiency=round(ef, 4),
        mem_bw_efficiency=round(eb, 4),
        net_bw_per_device=5e9,
        net_latency_s=5e-5,
        notes=f"measured {when} by pdserve.sim.measure, {threads} torch thread(s): float32 "
        f"matmul {peak / 1e9:.1f} GFLOP/s, copy {bw / 1e9:.1f} GB/s; efficiencies fitted to "
        f"{model_name} engine steps. Network: loopback TCP, assumed.",
    )
    software = SoftwareProfile(
        name="pdserve-cpu-measured",
        block_size=16,
        max_num_batched_tokens=2048,
        max_num_seqs=64,
        step_overhead_s=round(step_o, 6),
        seq_overhead_s=round(seq_o, 7),
        first_token_from_prefill=True,
        layerwise_push=True,
        pull_setup="thread",
        push_writer="thread",
        blocks_per_descriptor=1_000_000,
        notes=f"step and sequence overheads fitted to {model_name} engine steps ({when}).",
    )
    return hardware, software, samples


@dataclass(frozen=True, kw_only=True)
class MeasureConfig:
    """One measurement (`python -m pdserve.sim.measure`'s flags)."""

    model: str = option("builtin:small", help="")
    threads: int = option(1, help="")
    out_dir: Path = option(help="")


def main() -> int:
    """CLI: measure, write the two profiles, print each step's fit."""
    parser = argparse.ArgumentParser(prog="python -m pdserve.sim.measure")
    add_options(parser, MeasureConfig)
    return write_profiles(from_args(MeasureConfig, parser.parse_args()))


def write_profiles(cfg: MeasureConfig) -> int:
    """Measure this machine, write `cfg.out_dir`/hardware.json and software.json, print
    each step's measured and modelled time."""
    hardware, software, samples = measure(cfg.model, cfg.threads)
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    import msgspec

    for kind, profile in (("hardware", hardware), ("software", software)):
        raw = msgspec.json.format(msgspec.json.encode(profile), indent=2)
        (cfg.out_dir / f"{kind}.json").write_bytes(raw + b"\n")
    costs = CostModel(load_model(cfg.model.replace("builtin:", "builtin-")), hardware, software)
    rows = [
        {"seqs": len(s), "new": s[0].num_new, "cached": s[0].num_cached,
         "fitted": is_fit_sample(s), "measured_ms": round(t * 1e3, 3),
         "model_ms": round(costs.step_time(s) * 1e3, 3),
         "error_pct": round(100 * (costs.step_time(s) - t) / t, 1)}
        for s, t in samples
    ]  # fmt: skip
    print(json.dumps(rows, indent=1))
    print(f"wrote {cfg.out_dir}/hardware.json and software.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
