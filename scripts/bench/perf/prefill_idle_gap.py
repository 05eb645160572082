"""Does an idle gap before a prefill make it slower? (light-load TTFT, issue 8)

P in a P/D cluster idles ~100-200 ms between one-at-a-time prompts (D decodes meanwhile);
the monolithic instance goes from its last decode step straight to the next prompt. This
times the same 1024-token prefill in one engine, pinned to one core: back to back, after a
sleep (`--gap-ms`), and after the same gap spent by another process on the same core (a
busy loop), in interleaved order.

usage: taskset -c 0 .venv/bin/python scripts/bench/perf/prefill_idle_gap.py [--gap-ms 150]
       [--repeats 15] [--model builtin:small] [--dtype float32]
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--gap-ms", type=float, default=150.0)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--model", default="builtin:small")
    ap.add_argument("--dtype", default="float32")
    a = ap.parse_args()
    torch.set_num_threads(1)
    from pdserve.bench.engine import prefill_tps
    from pdserve.config import EngineConfig, ModelConfig
    from pdserve.engine.engine import LLMEngine

    cfg = EngineConfig(model=ModelConfig(model=a.model, dtype=a.dtype), threads=1)
    engine = LLMEngine.from_config(cfg)
    rng = random.Random(0)
    for _ in range(3):
        prefill_tps(engine, a.input_len, rng)
    gap = a.gap_ms / 1000
    busy = f"import time\nt = time.perf_counter() + {gap}\nwhile time.perf_counter() < t: pass"
    spin = [sys.executable, "-c", busy]
    times: dict[str, list[float]] = {"back-to-back": [], "sleep": [], "other process": []}
    for _ in range(a.repeats):
        for kind in times:
            if kind == "sleep":
                time.sleep(gap)
            elif kind == "other process":
                subprocess.run(spin, check=True)  # inherits this core
            times[kind].append(a.input_len / prefill_tps(engine, a.input_len, rng) * 1000)
    for kind, ms in times.items():
        print(
            f"{kind:14s} prefill ms p50 {statistics.median(ms):7.1f}  min {min(ms):7.1f}  "
            f"max {max(ms):7.1f}"
        )


if __name__ == "__main__":
    main()
