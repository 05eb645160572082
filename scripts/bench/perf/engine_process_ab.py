"""D's engine in a thread or in its own process: TPOT under many streams, A/B in one run.

Issue 8: "if GIL contention shows in TPOT under many streams, move the engine core into its
own process". Two push 1P1D clusters (`pdserve up`, builtin:small) run side by side, P on
core 0 and D on core 1 in both, the routers and bench clients on core 0; the idle one costs
next to nothing (its engines block on their inboxes). Windows alternate between placements:

- `thread`: cluster A, D's engine in a thread of its HTTP process (the default);
- `proc`: cluster B (`--engine-process`), D's front end and D's engine core both on core 1;
- `split`: cluster B with D's front-end process moved to core 0 (with P and the router) and
  its engine core alone on core 1: what a separate interpreter makes possible, and what the
  thread-pinning A/B (thread_pin_ab.py) showed the shared GIL forbids.

Per window: the bench result, and the CPU seconds per output token of D's engine (thread, or
core process) and of the rest of D (the front end), and P's CPU seconds.

usage: flock /work/notes/bench.lock .venv/bin/python scripts/bench/perf/engine_process_ab.py
       OUT [--rounds 3] | OUT --summary
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tpot_inflight"))
import run as inflight  # scripts/bench/tpot_inflight/run.py: the cluster helpers
from procstat import cpu_s, thread_cpu
from thread_pin_ab import WORKLOADS, engine_thread, finish, stop, with_prompts

VARIANTS = ("thread", "proc", "split")
SHOWN = ("streams16", "serial1k")


def core_of(pid: int) -> int:
    """The engine core process of D's front end `pid` (its only child)."""
    kids = [
        int(c)
        for task in os.listdir(f"/proc/{pid}/task")
        for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split()
    ]
    if len(kids) != 1:
        sys.exit(f"D (pid {pid}) has children {kids}, expected one engine core")
    return kids[0]


def pin_process(pid: int, cores: set[int]) -> None:
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cores)
        except OSError:  # a thread that ended meanwhile
            continue


def engine_cpu(variant: str, d: int, eng: int) -> tuple[float, float]:
    """(engine, rest of D) CPU seconds: the engine thread vs D's other threads, or the core
    process vs the front-end process."""
    if variant == "thread":
        per_thread = thread_cpu(d)
        e = per_thread.get(str(eng), 0.0)
        return e, sum(per_thread.values()) - e
    return cpu_s(eng), cpu_s(d)


def window(c: inflight.Cluster, eng: int, variant: str, wl: str, out: Path) -> dict:
    d, p = c.pids["decode"], c.pids["prefill"]
    if variant != "thread":  # cluster B: place D's front end for this window
        pin_process(d, {0} if variant == "split" else {1})
        pin_process(eng, {1})
    e0, r0 = engine_cpu(variant, d, eng)
    p0 = cpu_s(p)
    tag = f"{wl}-{variant}-{time.strftime('%H%M%S')}"
    res_path = out / f"{tag}.json"
    b = inflight.bench(c.url, WORKLOADS[wl], res_path, out / f"{tag}.log", core0=True)
    b.wait()
    e1, r1 = engine_cpu(variant, d, eng)
    res = json.loads(res_path.read_text()) if b.returncode == 0 else {}
    toks = res.get("total_output_tokens") or 1
    row = {
        "workload": wl,
        "variant": variant,
        "rc": b.returncode,
        "completed": res.get("completed"),
        "tpot_p50": res.get("median_tpot_ms"),
        "tpot_p99": res.get("p99_tpot_ms"),
        "ttft_p50": res.get("median_ttft_ms"),
        "handoff_p50": res.get("median_handoff_ms"),
        "d_engine_ms_tok": round(1e3 * (e1 - e0) / toks, 3),
        "d_front_ms_tok": round(1e3 * (r1 - r0) / toks, 3),
        "p_cpu_s": round(cpu_s(p) - p0, 2),
        "load": Path("/proc/loadavg").read_text().split()[0],
    }
    print(json.dumps(row), flush=True)
    return row


def summarize(rows: list[dict]) -> None:
    """Medians per workload and variant, and each variant's ratio to `thread` per round."""
    keys = ("tpot_p50", "tpot_p99", "ttft_p50", "d_engine_ms_tok", "d_front_ms_tok")
    for wl in dict.fromkeys(r["workload"] for r in rows):
        mine = [r for r in rows if r["workload"] == wl and r["rc"] == 0]
        for v in VARIANTS:
            med = {k: statistics.median(r[k] for r in mine if r["variant"] == v) for k in keys}
            print(wl, v, " ".join(f"{k} {x:.3f}" for k, x in med.items()))
        for v in VARIANTS[1:]:
            ratios = []
            for rnd in sorted({r["round"] for r in mine}):
                of = {
                    x: statistics.median(
                        r["tpot_p50"] for r in mine if r["round"] == rnd and r["variant"] == x
                    )
                    for x in ("thread", v)
                }
                ratios.append(round(of[v] / of["thread"], 3))
            print(f"  {v}/thread tpot_p50 per round", ratios)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--summary", action="store_true", help="only summarize OUT/rows.json")
    a = ap.parse_args()
    if a.summary:
        summarize(json.loads((a.out / "rows.json").read_text()))
        return
    a.out.mkdir(parents=True, exist_ok=True)
    print(f"start {time.strftime('%F %T')} load {Path('/proc/loadavg').read_text().strip()}")
    clusters = {
        "A": inflight.start_cluster("push", a.out, isolate=True, tag="thread"),
        "B": inflight.start_cluster(
            "push", a.out, isolate=True, tag="proc", instance_args=("--engine-process",)
        ),
    }
    rows: list[dict] = []
    try:
        engines = {
            "A": engine_thread(clusters["A"].pids["decode"]),
            "B": core_of(clusters["B"].pids["decode"]),
        }
        for c in clusters.values():  # warm-up: every shape once, unmeasured
            for wl in SHOWN:
                warm = with_prompts(WORKLOADS[wl], 4)
                inflight.bench(c.url, warm, None, a.out / f"warm-{wl}.log", core0=True).wait()
        for r in range(a.rounds):
            order = VARIANTS if r % 2 == 0 else VARIANTS[::-1]
            for wl in SHOWN:
                for variant in order + order[::-1]:
                    key = "A" if variant == "thread" else "B"
                    row = window(clusters[key], engines[key], variant, wl, a.out)
                    rows.append({"round": r, **row})
    finally:
        for c in clusters.values():
            stop(c)
    summarize(rows)
    finish(a.out, rows)


if __name__ == "__main__":
    main()
