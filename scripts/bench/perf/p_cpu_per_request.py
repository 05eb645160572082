"""P's CPU per request, push vs pull (issue 8): does push's writer cost P compute?

One `pdserve up` (builtin:small, tcp, router and clients on core 0) per mode and round,
modes alternating ABBA; per cluster, 4 warm-ups then 16 requests of 1024 in / 16 out one at a
time and 32 at 4 req/s, with P's and D's CPU seconds (/proc) before and after each workload,
and P's per-thread CPU to tell the engine thread from the transfer threads.

usage: flock /work/notes/bench.lock .venv/bin/python scripts/bench/perf/p_cpu_per_request.py OUT
       [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import thread_pin_ab as tp  # cluster helpers (scripts/bench/tpot_inflight/run.py)
from procstat import cpu_s, thread_cpu  # importable: thread_pin_ab put scripts/bench on the path

inflight = tp.inflight
WORKLOADS = {
    "serial": ["--input-len", "1024", "--output-len", "16", "--num-prompts", "16",
               "--max-concurrency", "1", "--request-rate", "inf"],
    "rate4": ["--input-len", "1024", "--output-len", "16", "--num-prompts", "32",
              "--request-rate", "4"],
}  # fmt: skip


def measure(c: inflight.Cluster, mode: str, wl: str, out: Path) -> dict:
    p = c.pids["prefill"]
    eng = tp.engine_thread(p)
    t0, d0 = thread_cpu(p), cpu_s(c.pids["decode"])
    res_path = out / f"{mode}-{wl}-{time.strftime('%H%M%S')}.json"
    b = inflight.bench(c.url, WORKLOADS[wl], res_path, out / "bench.log", core0=True)
    b.wait()
    t1, d1 = thread_cpu(p), cpu_s(c.pids["decode"])
    res = json.loads(res_path.read_text())
    n = res["completed"]
    eng_s = t1[str(eng)] - t0.get(str(eng), 0)
    other_s = sum(t1[t] - t0.get(t, 0) for t in t1 if t != str(eng))
    row = {
        "mode": mode,
        "workload": wl,
        "completed": n,
        "ttft_p50": round(res["median_ttft_ms"], 1),
        "ttft_p99": round(res["p99_ttft_ms"], 1),
        "p_engine_ms_req": round(1e3 * eng_s / n, 1),
        "p_other_ms_req": round(1e3 * other_s / n, 1),
        "d_ms_req": round(1e3 * (d1 - d0) / n, 1),
        "load": Path("/proc/loadavg").read_text().split()[0],
    }
    print(json.dumps(row), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--rounds", type=int, default=2)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    print(f"start {time.strftime('%F %T')} load {Path('/proc/loadavg').read_text().strip()}")
    rows = []
    for r in range(a.rounds):
        for mode in ("push", "pull") if r % 2 == 0 else ("pull", "push"):
            c = inflight.start_cluster(mode, a.out, isolate=True)
            try:
                warm = tp.with_prompts(WORKLOADS["serial"], 4)
                inflight.bench(c.url, warm, None, a.out / "warm.log", core0=True).wait()
                rows += [{"round": r, **measure(c, mode, wl, a.out)} for wl in WORKLOADS]
            finally:
                tp.stop(c)
    tp.finish(a.out, rows)


if __name__ == "__main__":
    main()
