"""CPU each vLLM instance spends during one request at a time, and whether a busy D core
slows P.

usage: vllm_wait_cpu.py OUT [--clusters pdserve-push pdserve-pull] [--requests 6]
       [--input-len 4096] [--spin-alternate] [--vllm-python PY] [--model CKPT]

For each cluster (`pdserve up --engine vllm`, as scripts/bench/vllm_engine_ab.py starts
them): one warm-up, then `--requests` prompts of `--input-len` random token ids, one at a
time, `max_tokens` 1, so the request's wall time is P's prefill plus the handoff. For each:
the wall time and the CPU seconds (user + system) of P's and D's process trees over it,
with the top threads. With push, D registers at admission and waits for the KV while P
prefills; this shows what that wait costs D. `--spin-alternate` runs a busy loop pinned to
D's cores during every second request: if P's prefill does not slow then, D's CPU during
the wait does not slow P on this machine. Writes OUT/wait_cpu.jsonl, prints medians.
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
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import vllm_engine_ab as ab

SPIN = "while True: pass"


def one_request(url: str, model: str, n_tokens: int, vocab: int) -> tuple[float, int]:
    prompt = [random.randrange(3, vocab) for _ in range(n_tokens)]
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    t0 = time.monotonic()
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    return time.monotonic() - t0, r.status_code


def measured(
    pids: dict[str, int], url: str, a: argparse.Namespace, vocab: int, spin: bool
) -> dict[str, Any]:
    """One request; a spinner on D's cores during it when `spin`."""
    spinner = None
    if spin:
        cores = ",".join(map(str, sorted(os.sched_getaffinity(pids["decode"]))))
        spinner = subprocess.Popen(["taskset", "-c", cores, sys.executable, "-c", SPIN])
        time.sleep(0.3)
    try:
        before = {role: ab.tree_threads_cpu_s(pid) for role, pid in pids.items()}
        wall, status = one_request(url, str(a.model), a.input_len, vocab)
        after = {role: ab.tree_threads_cpu_s(pid) for role, pid in pids.items()}
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()
    out: dict[str, Any] = {"spin": spin, "wall_s": round(wall, 3), "status": status}
    for role in pids:
        used = {k: v - before[role].get(k, 0.0) for k, v in after[role].items()}
        out[f"{role}_cpu_s"] = round(sum(used.values()), 3)
        top = sorted(used.items(), key=lambda kv: -kv[1])[:4]
        out[f"{role}_threads"] = {k: round(v, 3) for k, v in top if v >= 0.01}
    return out


def run_cluster(name: str, a: argparse.Namespace, vocab: int) -> list[dict[str, Any]]:
    up = ab.Up(name, a, a.out / "logs")
    rows = []
    try:
        pids = {k: v for k, v in up.wait_ready(a.startup_timeout).items() if k != "router"}
        ab.warm_up(up.url, str(a.model))
        time.sleep(3)  # past vLLM's 1 s of spinning on its queue after the warm-up
        for i in range(a.requests):
            row = {"cluster": name} | measured(
                pids, up.url, a, vocab, bool(a.spin_alternate and i % 2)
            )
            print(json.dumps(row), flush=True)
            rows.append(row)
            time.sleep(2)
    finally:
        up.stop()
    return rows


def table(rows: list[dict[str, Any]]) -> None:
    print("| cluster | spinner on D's core | requests | wall p50 (s) | P CPU-s p50 | D CPU-s p50 |")
    print("|---|---|---|---|---|---|")
    for key in sorted({(r["cluster"], r["spin"]) for r in rows}):
        sel = [r for r in rows if (r["cluster"], r["spin"]) == key and r["status"] == 200]
        med = [
            statistics.median(r[k] for r in sel)
            for k in ("wall_s", "prefill_cpu_s", "decode_cpu_s")
        ]
        print(
            f"| {key[0]} | {'yes' if key[1] else 'no'} | {len(sel)} | "
            + " | ".join(f"{m:.2f}" for m in med)
            + " |"
        )


def main() -> None:
    first, rest = __doc__.split("\n\n", 1)
    ap = argparse.ArgumentParser(
        description=first, epilog=rest, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("out", type=Path)
    ap.add_argument("--clusters", nargs="+", default=["pdserve-push", "pdserve-pull"])
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--input-len", type=int, default=4096)
    ap.add_argument("--spin-alternate", action="store_true")
    ap.add_argument("--vllm-python", help="default: pdserve serve's (.venv-vllm)")
    ap.add_argument("--model", type=Path, default=ab.REPO / "results/ckpt-qwen3-4l256")
    ap.add_argument(
        "--vllm-arg",
        action="append",
        default=["--enforce-eager"],
        metavar="ARG",
        help="one more argument for every vLLM instance (after --enforce-eager)",
    )
    ap.add_argument("--startup-timeout", type=float, default=900.0)
    a = ap.parse_args()
    # what vllm_engine_ab.Up reads
    a.transport, a.dtype, a.max_model_len = "tcp", "bfloat16", 9000
    a.out = a.out.resolve()
    (a.out / "logs").mkdir(parents=True, exist_ok=True)
    vocab = json.loads((a.model / "config.json").read_text())["vocab_size"]
    rows = [row for name in a.clusters for row in run_cluster(name, a, vocab)]
    with open(a.out / "wait_cpu.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    table(rows)


if __name__ == "__main__":
    main()
