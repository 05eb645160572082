"""Prefix-caching benchmark (issue 26); run it on a quiet machine (timings are compared).

The workload is `pdserve bench serve --dataset-name multiturn`: conversations sharing one
system prompt and growing turn by turn, written from the seed, so every configuration
replays the same requests. Each configuration gets a fresh cluster (cold caches):

  1p1d:  1P1D, push and pull, with prefix caching on and off (`--no-enable-prefix-caching`
         on every instance), round robin;
  2p2d:  2P2D push with caching on, router policy cache_aware vs round_robin vs
         least_loaded.

On a shared machine, `--rounds N` runs the configurations N times, interleaved (every
configuration once per round), so that a load that changes during the run hits them all;
compare configurations within a round, and the rounds with each other.

Reported per configuration: TTFT p50/p99 (the bench's result), the 1-minute load average
before and after, KV bytes moved between the instances (`pdserve_kv_bytes_transferred_total`
summed over them, before/after) and the prefix-cache hit rate
(`pdserve_prefix_cache_hits_total / _queries_total` over them).
Processes bind 127.0.0.1 on free ports and are stopped by PID at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

# spawn / wait / stop by PID and the bench call are the routing script's
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "routing"))
import bench_routing as br

OUT = Path(__file__).resolve().parents[3] / "results" / "prefix"
SERIES = (
    "pdserve_kv_bytes_transferred",
    "pdserve_prefix_cache_queries",
    "pdserve_prefix_cache_hits",
)


def scrape(urls: list[str]) -> dict[str, float]:
    """The three counters, summed over `urls`."""
    totals = dict.fromkeys(SERIES, 0.0)
    for u in urls:
        text = httpx.get(f"{u}/metrics", timeout=10).text
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                for name in SERIES:
                    if s.name in (name, f"{name}_total"):
                        totals[name] += s.value
    return totals


def run_config(a: argparse.Namespace, name: str, mode: str, n_p: int, n_d: int,
               policy: str, caching: bool) -> dict:  # fmt: skip
    br.OUT = OUT  # the routing script's logs go next to these results
    extra = ["--num-kv-blocks", str(a.kv_blocks)]
    if not caching:
        extra.append("--no-enable-prefix-caching")
    ps = [br.spawn(f"{name}-p{i}", br.instance("prefill", mode, a.model, "0", extra), "0")
          for i in range(n_p)]  # fmt: skip
    ds = [br.spawn(f"{name}-d{i}", br.instance("decode", mode, a.model, "1", extra), "1")
          for i in range(n_d)]  # fmt: skip
    try:
        br.wait_healthy(ps + ds)
        args = ["router", "--prefill", *ps, "--decode", *ds, "--kv-transfer", mode]
        router = br.spawn(f"{name}-router", [*args, "--policy", policy], None)
        br.wait_healthy([router])
        before = scrape(ps + ds)
        work = [
            "--dataset-name", "multiturn", "--multiturn-system-len", str(a.system_len),
            "--multiturn-user-len", str(a.user_len), "--multiturn-turns", str(a.turns),
            "--output-len", str(a.output_len), "--num-prompts", str(a.num_prompts),
            "--request-rate", str(a.rate), "--seed", str(a.seed), "--num-warmups", "0",
        ]  # fmt: skip
        r = br.bench(router, name, work, OUT / f"prefix-{name}.json")
        time.sleep(1.0)  # the last transfers' counters
        after = scrape(ps + ds)
    finally:
        br.stop_all()
        br.PROCS.clear()
    moved = after[SERIES[0]] - before[SERIES[0]]
    queries = after[SERIES[1]] - before[SERIES[1]]
    hits = after[SERIES[2]] - before[SERIES[2]]
    row = {
        "config": name, "ttft_p50_ms": r["median_ttft_ms"], "ttft_p99_ms": r["p99_ttft_ms"],
        "tpot_p50_ms": r["median_tpot_ms"], "kv_bytes_moved": moved,
        "prefix_hit_rate": hits / queries if queries else 0.0,
        "loadavg_before": r["loadavg_before"], "loadavg_after": os.getloadavg()[0],
    }  # fmt: skip
    print(json.dumps(row), flush=True)
    return row


CONFIGS = {
    "1p1d-push-cache": ("push", 1, 1, "round_robin", True),
    "1p1d-push-nocache": ("push", 1, 1, "round_robin", False),
    "1p1d-pull-cache": ("pull", 1, 1, "round_robin", True),
    "1p1d-pull-nocache": ("pull", 1, 1, "round_robin", False),
    "2p2d-push-cache_aware": ("push", 2, 2, "cache_aware", True),
    "2p2d-push-round_robin": ("push", 2, 2, "round_robin", True),
    "2p2d-push-least_loaded": ("push", 2, 2, "least_loaded", True),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    ap.add_argument("--model", default="builtin:small")
    ap.add_argument("--system-len", type=int, default=512)
    ap.add_argument("--user-len", type=int, default=64)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--rate", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-blocks", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=1, help="run every configuration N times")
    a = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    # `timeout` sends SIGTERM: exit through `finally` so every child is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    rows = [
        {**run_config(a, name, *CONFIGS[name]), "round": k}
        for k in range(a.rounds)
        for name in a.configs
    ]
    (OUT / "summary.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
