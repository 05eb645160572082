"""Does a decode step on core 1 slow down when core 0 is busy? One process, no HTTP.

Why: moving D's front end to core 0 (thread_pin_ab.py's `split`, engine_process_ab.py's
`split`) raised the engine's CPU per token by 15-25% both with a shared GIL and with a
separate engine process, so the GIL alone cannot be the cause. This runs builtin:small's
decode steps (16 running requests, one torch thread) pinned to core 1 and alternates
windows in which core 0 is idle, runs a pure-Python loop, or runs the same decode work in a
second engine, ABBA-style.

usage: flock /work/notes/bench.lock .venv/bin/python scripts/bench/perf/neighbour_load.py
       [--steps 150] [--rounds 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

NEIGHBOURS = ("idle", "python", "decode")
STREAMS = 16


def engine():
    import torch

    from pdserve.config import CacheConfig, EngineConfig, ModelConfig
    from pdserve.engine.engine import LLMEngine

    torch.set_num_threads(1)
    cfg = EngineConfig(
        model=ModelConfig(model="builtin:small"), cache=CacheConfig(num_blocks=4096), threads=1
    )
    eng = LLMEngine.from_config(cfg)
    fresh(eng)
    return eng


def fresh(eng) -> None:
    """16 new requests, prefilled: every window decodes at the same context lengths."""
    from pdserve.engine.types import EngineRequest, SamplingParams

    for rid in list(eng.requests):
        eng.abort_request(rid)
    sp = SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True)
    n = len(eng.requests) + time.monotonic_ns()
    for i in range(STREAMS):
        ids = [3 + (i * 31 + j) % 240 for j in range(64)]
        er = EngineRequest(request_id=f"r{n}-{i}", prompt_token_ids=ids, params=sp)
        assert not eng.add_request(er), "refused"  # an output here is an error
    while eng.stats().num_waiting:
        eng.step()


def ms_per_step(eng, steps: int) -> float:
    t = time.perf_counter()
    for _ in range(steps):
        eng.step()
    return 1e3 * (time.perf_counter() - t) / steps


def neighbour(kind: str) -> subprocess.Popen | None:
    if kind == "idle":
        return None
    here = os.path.dirname(os.path.abspath(__file__))
    code = {
        "python": "x = 0\nwhile True:\n    x = (x * 31 + 7) % 1000003",
        "decode": f"import sys; sys.path.insert(0, {here!r})\n"
        "from neighbour_load import engine\neng = engine()\nwhile True: eng.step()",
    }[kind]
    proc = subprocess.Popen([sys.executable, "-c", code])
    os.sched_setaffinity(proc.pid, {0})
    time.sleep(8.0 if kind == "decode" else 0.5)  # the decode neighbour loads its model first
    return proc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--rounds", type=int, default=4)
    a = ap.parse_args()
    os.sched_setaffinity(0, {1})
    eng = engine()
    ms_per_step(eng, 30)  # warm-up
    rows: dict[str, list[float]] = {k: [] for k in NEIGHBOURS}
    for r in range(a.rounds):
        order = NEIGHBOURS if r % 2 == 0 else NEIGHBOURS[::-1]
        for kind in order:
            proc = neighbour(kind)
            try:
                fresh(eng)
                rows[kind].append(ms_per_step(eng, a.steps))
            finally:
                if proc is not None:
                    proc.kill()
                    proc.wait()
            print(kind, round(rows[kind][-1], 3), flush=True)
    base = statistics.median(rows["idle"])
    for kind, xs in rows.items():
        med = statistics.median(xs)
        print(f"{kind}: median {med:.3f} ms/step, x{med / base:.3f}")


if __name__ == "__main__":
    main()
