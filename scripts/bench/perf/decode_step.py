"""Engine-only decode step time: B requests of a 1024-token prompt decoding together.

Prints wall and thread-CPU ms per step over the timed steps (CPU time excludes the time
the thread waits for a core, so it moves less with other load on a shared machine).
usage: python scripts/bench/perf/decode_step.py MODEL BATCH STEPS [--profile] [--bf16]
"""

from __future__ import annotations

import random
import sys
import time

import torch

from pdserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.types import EngineRequest, SamplingParams


def engine_with_batch(model: str, batch: int, steps: int, dtype: str = "float32") -> LLMEngine:
    """An engine whose `batch` requests have their prompts cached and decode `steps` more."""
    cfg = EngineConfig(
        model=ModelConfig(model=model, dtype=dtype),
        cache=CacheConfig(kv_cache_memory_gib=1.0),
        scheduler=SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=256),
    )
    engine = LLMEngine.from_config(cfg)
    rng = random.Random(0)
    sp = SamplingParams(max_tokens=steps + batch + 8, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        ids = [rng.randrange(3, 250) for _ in range(1024)]
        engine.add_request(EngineRequest(request_id=f"d{i}", prompt_token_ids=ids, params=sp))
    for _ in range(batch + 5):
        engine.step()
    return engine


def main(model: str, batch: int, steps: int, profile: bool, dtype: str) -> None:
    torch.set_num_threads(1)
    engine = engine_with_batch(model, batch, steps, dtype)
    if profile:
        from torch.profiler import profile as torch_profile

        with torch_profile() as prof:
            for _ in range(steps):
                engine.step()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
        return
    cpu, wall = time.thread_time(), time.perf_counter()
    for _ in range(steps):
        engine.step()
    cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
    print(f"batch {batch}: {wall / steps * 1e3:.3f} ms/step wall, {cpu / steps * 1e3:.3f} cpu")


if __name__ == "__main__":
    dtype = "bfloat16" if "--bf16" in sys.argv else "float32"
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), "--profile" in sys.argv, dtype)
