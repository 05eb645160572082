"""Profile driver: scenario given on argv; engine alone, 1 thread."""

from __future__ import annotations

import random
import sys
import time

import torch

from pdserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from pdserve.engine.engine import LLMEngine
from pdserve.engine.types import EngineRequest, SamplingParams

torch.set_num_threads(1)
scen = sys.argv[1]
model = sys.argv[2] if len(sys.argv) > 2 else "builtin:small"
chunk = int(sys.argv[3]) if len(sys.argv) > 3 else 2048
cfg = EngineConfig(
    model=ModelConfig(model=model, dtype="float32"),
    cache=CacheConfig(kv_cache_memory_gib=1.0),
    scheduler=SchedulerConfig(max_num_batched_tokens=chunk, max_num_seqs=256),
)
eng = LLMEngine.from_config(cfg)
rng = random.Random(0)
V = min(eng.tokenizer.vocab_size, 250)


def prompt(n):
    return [rng.randrange(3, V) for _ in range(n)]


def run_prefill(n, reps):
    ts = []
    for r in range(reps):
        sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        eng.add_request(
            EngineRequest(request_id=f"p{n}-{r}", prompt_token_ids=prompt(n), params=sp)
        )
        t0 = time.perf_counter()
        while eng.has_work():
            eng.step()
        ts.append(time.perf_counter() - t0)
    return sorted(ts)[len(ts) // 2]


run_prefill(64, 1)
if scen == "p4k":
    print("prefill 4096 median s", run_prefill(4096, 3))
elif scen == "p1k":
    print("prefill 1024 median s", run_prefill(1024, 7))
elif scen == "dec":
    steps = 40
    sp = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
    for i in range(16):
        eng.add_request(EngineRequest(request_id=f"d{i}", prompt_token_ids=prompt(2048), params=sp))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.requests.values()):
        eng.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    print("decode step 16x2k ms", (time.perf_counter() - t0) / steps * 1e3)
    while eng.has_work():
        eng.step()
elif scen == "dec1":
    steps = 100
    sp = SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True)
    eng.add_request(EngineRequest(request_id="d", prompt_token_ids=prompt(1024), params=sp))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.requests.values()):
        eng.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    print("decode step 1x1k ms", (time.perf_counter() - t0) / steps * 1e3)
