"""Prefill capacity of one instance, and the utilisation a sweep point offers it.

A sweep point (input length L, request rate R) offers the prefill instance R * L prompt
tokens per second. Its capacity is the prefill tokens/s the engine reaches alone on the
cores the launcher gives it (one core, one thread, on this 2-core machine), measured at the
same length L because attention makes long prompts slower per token. Utilisation =
offered / capacity: well below 1 the prefill instance is mostly idle and requests rarely
queue; at 1 and above it is saturated and TTFT grows with the queue.

`measure_prefill_capacity` runs the measurement in a child process (`python -m
pdserve.bench.capacity`) pinned to the given cores, so that the sweep's own process (its
imports, its threads) neither disturbs the timing nor inherits torch's thread pool. The
child builds the engine with `pdserve serve`'s defaults (block size, step token budget and
so chunked prefill), warms it up, and reports the median of `repeats` prefills per length.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from pdserve.options import add_options, from_args, option


class PrefillCapacity(msgspec.Struct, frozen=True, kw_only=True):
    """Measured prefill tokens/s of one engine per prompt length."""

    model: str
    threads: int
    cores: list[int] | None = None  # the cores the measuring process was pinned to
    tok_s: dict[int, float]  # prompt length -> median prefill tokens/s

    def at(self, input_len: int) -> float | None:
        """Tokens/s at `input_len`: measured, else interpolated linearly between the
        nearest measured lengths (constant beyond them); None if nothing was measured."""
        if not self.tok_s:
            return None
        lengths = sorted(self.tok_s)
        if input_len in self.tok_s:
            return self.tok_s[input_len]
        if input_len <= lengths[0]:
            return self.tok_s[lengths[0]]
        if input_len >= lengths[-1]:
            return self.tok_s[lengths[-1]]
        hi = next(n for n in lengths if n > input_len)
        lo = max(n for n in lengths if n < input_len)
        w = (input_len - lo) / (hi - lo)
        return self.tok_s[lo] * (1 - w) + self.tok_s[hi] * w


def utilisation(input_len: int, rate: float, capacity: PrefillCapacity | None) -> float | None:
    """Offered prefill tokens/s over capacity at `input_len`; None if unknown, inf for an
    infinite rate."""
    tok_s = capacity.at(input_len) if capacity is not None else None
    if tok_s is None or tok_s <= 0:
        return None
    return math.inf if math.isinf(rate) else rate * input_len / tok_s


def measure_prefill_capacity(
    model: str,
    input_lens: Sequence[int],
    *,
    threads: int = 1,
    cores: Sequence[int] | None = None,
    repeats: int = 3,
    timeout_s: float = 600.0,
) -> PrefillCapacity:
    """Run the measurement in a child process pinned to `cores` (None: unpinned).

    Raises RuntimeError with the child's stderr tail if it fails.
    """
    cmd = [sys.executable, "-m", "pdserve.bench.capacity", "--model", model]
    cmd += ["--threads", str(threads), "--repeats", str(repeats), "--input-len"]
    cmd += [str(n) for n in sorted(set(input_lens))]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    pin = None if cores is None else (lambda: os.sched_setaffinity(0, list(cores)))
    proc = subprocess.run(
        cmd, capture_output=True, env=env, timeout=timeout_s, preexec_fn=pin, check=False
    )
    if proc.returncode != 0:
        tail = proc.stderr.decode(errors="replace")[-2000:]
        raise RuntimeError(f"prefill capacity measurement failed ({proc.returncode}):\n{tail}")
    measured = msgspec.json.decode(proc.stdout.strip().splitlines()[-1], type=PrefillCapacity)
    return msgspec.structs.replace(measured, cores=None if cores is None else list(cores))


@dataclass(frozen=True, kw_only=True)
class CapacityRun:
    """One measurement in the child process (the flags `measure_prefill_capacity` passes)."""

    model: str = option("builtin:small", help="")
    input_len: tuple[int, ...] = option(nargs="+", help="")
    threads: int = option(1, help="")
    repeats: int = option(3, help="")


def _measure_here(run: CapacityRun) -> dict:
    # Heavy imports stay inside the child process.
    from pdserve.bench.engine import prefill_tps
    from pdserve.config import EngineConfig, ModelConfig
    from pdserve.engine.engine import LLMEngine

    model_cfg = ModelConfig(model=run.model)
    engine = LLMEngine.from_config(EngineConfig(model=model_cfg, threads=run.threads))
    rng = random.Random(0)
    prefill_tps(engine, min(run.input_len), rng)  # first-call costs (allocator, kernels)
    tok_s = {}
    for n in run.input_len:
        tok_s[n] = statistics.median(prefill_tps(engine, n, rng) for _ in range(run.repeats))
    return {"model": run.model, "threads": run.threads, "tok_s": tok_s}


def main() -> int:
    """Child entry: print one JSON line {model, threads, tok_s: {len: tok/s}}."""
    parser = argparse.ArgumentParser(prog="python -m pdserve.bench.capacity")
    add_options(parser, CapacityRun)
    print(json.dumps(_measure_here(from_args(CapacityRun, parser.parse_args()))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
