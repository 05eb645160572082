"""Paired A/B of engine step times: two code trees, each in its own worker process, run in
short alternating slices (ABBA order) so that the machine's background load hits both alike.

Each worker builds one engine for one scenario and then, per command, runs a slice:
  decode "BxC": B requests with C-token random prompts (prefilled once at start); a slice
                is STEPS decode steps of all B together (the context grows as it goes);
  prefill "pN": a slice is one fresh N-token prompt prefilled to its first token.
Reports per tree the min and median ms per step (or per prefill) over the slices, wall and
thread CPU, and the median of the per-round after/before ratios (CPU time).

usage: python scripts/bench/perf/ab_steps.py BEFORE_ROOT AFTER_ROOT SCENARIO
           [--rounds 20] [--steps 10] [--chunk 2048] [--model builtin:small] [--cpu 0]
Run it under the bench lock; it pins the workers to one core and one torch thread.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

HERE = os.path.abspath(__file__)


def worker(scenario: str, model: str, chunk: int, steps: int) -> None:
    """Serve slices on stdin/stdout: 'run' -> one JSON line of timings; EOF ends."""
    import torch

    import pdserve
    from pdserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from pdserve.engine.engine import LLMEngine
    from pdserve.engine.types import EngineRequest, SamplingParams

    torch.set_num_threads(1)
    cfg = EngineConfig(
        model=ModelConfig(model=model, dtype="float32"),
        cache=CacheConfig(kv_cache_memory_gib=1.0),
        scheduler=SchedulerConfig(max_num_batched_tokens=chunk, max_num_seqs=256),
    )
    engine = LLMEngine.from_config(cfg)
    rng = random.Random(0)

    def add(rid: str, n: int, max_tokens: int) -> None:
        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        ids = [rng.randrange(3, 250) for _ in range(n)]
        rejected = engine.add_request(
            EngineRequest(request_id=rid, prompt_token_ids=ids, params=sp)
        )
        if rejected:
            raise SystemExit(f"request {rid} rejected: {rejected[0].error}")

    def drain() -> None:
        while engine.has_work():
            engine.step()

    add("warm", 64, 1)
    drain()
    if scenario.startswith("p"):
        n, count = int(scenario[1:]), 0

        def one_slice() -> int:
            nonlocal count
            count += 1
            add(f"p{count}", n, 1)
            drain()
            return 1
    else:
        batch, ctx = (int(x) for x in scenario.split("x"))
        for i in range(batch):
            add(f"d{i}", ctx, 4096)  # more than any run decodes
        reqs = list(engine.requests.values())
        while any(r.num_computed_tokens < r.num_prompt_tokens for r in reqs):
            engine.step()

        def one_slice() -> int:
            for _ in range(steps):
                engine.step()
            return steps

    one_slice()  # warm-up
    print("ready", pdserve.__file__, flush=True)
    for _ in sys.stdin:
        cpu, wall = time.thread_time(), time.perf_counter()
        k = one_slice()
        cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
        print(json.dumps({"wall_ms": wall / k * 1e3, "cpu_ms": cpu / k * 1e3}), flush=True)


def spawn(root: str, args: argparse.Namespace) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": root, "OMP_NUM_THREADS": "1"}
    cmd = ["taskset", "-c", args.cpu, sys.executable, HERE, "--worker", args.scenario]
    cmd += ["--model", args.model, "--chunk", str(args.chunk), "--steps", str(args.steps)]
    # cwd=/ so that the tree on PYTHONPATH, not the checkout in the cwd, is imported
    p = subprocess.Popen(
        cmd, env=env, cwd="/", stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    return p


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("before", nargs="?")
    ap.add_argument("after", nargs="?")
    ap.add_argument("scenario")
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--model", default="builtin:small")
    ap.add_argument("--cpu", default="0")
    args = ap.parse_args()
    if args.worker:
        worker(args.scenario, args.model, args.chunk, args.steps)
        return
    procs = {"before": spawn(args.before, args), "after": spawn(args.after, args)}
    for name, p in procs.items():  # both set up before any timing
        assert p.stdout is not None
        ready, path = p.stdout.readline().split()
        root = os.path.realpath(getattr(args, name))
        if ready != "ready" or not os.path.realpath(path).startswith(root):
            raise SystemExit(f"{name} worker imported {path}, not from {root}")
    times: dict[str, list[dict[str, float]]] = {name: [] for name in procs}
    for r in range(args.rounds):
        order = ["before", "after"] if r % 2 == 0 else ["after", "before"]
        for name in order:
            p = procs[name]
            assert p.stdin is not None and p.stdout is not None
            p.stdin.write("run\n")
            p.stdin.flush()
            times[name].append(json.loads(p.stdout.readline()))
    for p in procs.values():
        assert p.stdin is not None
        p.stdin.close()
        p.wait()
    ratios = [
        a["cpu_ms"] / b["cpu_ms"] for a, b in zip(times["after"], times["before"], strict=True)
    ]
    out = {"scenario": args.scenario, "rounds": args.rounds, "load": os.getloadavg()[0]}
    for name, ts in times.items():
        for key in ("wall_ms", "cpu_ms"):
            vals = [t[key] for t in ts]
            out[f"{name}_{key}_min"] = round(min(vals), 3)
            out[f"{name}_{key}_median"] = round(statistics.median(vals), 3)
    out["ratio_cpu_median"] = round(statistics.median(ratios), 3)
    out["ratio_cpu_q1_q3"] = [round(q, 3) for q in statistics.quantiles(ratios, n=4)[::2]]
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
