"""Does D's HTTP front end steal its engine's time? An A/B by thread affinity, one cluster.

Issue 8 asks to keep the front end from stealing the engine loop's time, and to move the
engine core into its own process if GIL contention shows in TPOT under many streams. Before
building that, this measures what taking the front end off D's core would buy, without any
code change: on one push 1P1D cluster (`pdserve up`, P on core 0, D on core 1, router and
bench clients moved to core 0), it alternates two placements of D's threads:

- `same`:  every D thread on core 1 (as `pdserve up` launches it);
- `split`: D's engine thread alone on core 1, every other D thread (the event loop that runs
  uvicorn and the SSE streams, the transfer threads) on core 0 with P and the router.

The threads still share one GIL in `split`; only the cores differ. Per window it records the
bench result and the CPU seconds of D's engine thread, D's other threads, and P.

usage: flock /work/notes/bench.lock .venv/bin/python scripts/bench/perf/thread_pin_ab.py OUT
       [--rounds 2] [--model builtin:small]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tpot_inflight"))
import run as inflight  # scripts/bench/tpot_inflight/run.py: the cluster helpers
from procstat import cpu_s, thread_cpu, thread_names

# name -> bench serve arguments; "streams" is the many-streams decode load the issue names
WORKLOADS = {
    "streams16": ["--input-len", "64", "--output-len", "256", "--num-prompts", "32",
                  "--max-concurrency", "16", "--request-rate", "inf"],
    "serial1k": ["--input-len", "1024", "--output-len", "64", "--num-prompts", "16",
                 "--max-concurrency", "1", "--request-rate", "inf"],
    "rate2_1k": ["--input-len", "1024", "--output-len", "64", "--num-prompts", "32",
                 "--request-rate", "2"],
}  # fmt: skip


def with_prompts(args: list[str], n: int) -> list[str]:
    i = args.index("--num-prompts")
    return [*args[: i + 1], str(n), *args[i + 2 :]]


def place(pid: int, engine_tid: int, variant: str) -> None:
    """Pin D's threads for `variant` (module doc); threads born later inherit the pinning of
    the thread that makes them, so re-pin before every window."""
    for tid in map(int, os.listdir(f"/proc/{pid}/task")):
        cores = {1} if variant == "same" or tid == engine_tid else {0}
        try:
            os.sched_setaffinity(tid, cores)
        except OSError:  # a thread that ended meanwhile
            continue


def engine_thread(pid: int) -> int:
    names = thread_names(pid)
    tids = [int(t) for t, n in names.items() if n == "pdserve-engine"]
    if len(tids) != 1:
        sys.exit(f"could not find D's engine thread among {names}")
    return tids[0]


def window(c: inflight.Cluster, eng: int, variant: str, wl: str, out: Path) -> dict:
    d, p = c.pids["decode"], c.pids["prefill"]
    place(d, eng, variant)
    t0, p0 = thread_cpu(d), cpu_s(p)
    tag = f"{wl}-{variant}-{time.strftime('%H%M%S')}"
    res_path = out / f"{tag}.json"
    b = inflight.bench(c.url, WORKLOADS[wl], res_path, out / f"{tag}.log", core0=True)
    b.wait()
    t1, p1 = thread_cpu(d), cpu_s(p)
    res = json.loads(res_path.read_text()) if b.returncode == 0 else {}
    toks = res.get("total_output_tokens") or 1
    eng_s = t1.get(str(eng), 0) - t0.get(str(eng), 0)
    other_s = sum(t1[t] - t0.get(t, 0) for t in t1 if t != str(eng))
    row = {
        "workload": wl,
        "variant": variant,
        "rc": b.returncode,
        "completed": res.get("completed"),
        "tpot_p50": res.get("median_tpot_ms"),
        "tpot_p99": res.get("p99_tpot_ms"),
        "ttft_p50": res.get("median_ttft_ms"),
        "handoff_p50": res.get("median_handoff_ms"),
        "d_engine_ms_tok": round(1e3 * eng_s / toks, 3),
        "d_other_ms_tok": round(1e3 * other_s / toks, 3),
        "p_cpu_s": round(p1 - p0, 2),
        "load": Path("/proc/loadavg").read_text().split()[0],
    }
    print(json.dumps(row), flush=True)
    return row


def summarize(rows: list[dict]) -> None:
    """Medians per workload and placement, and split/same ratios per ABBA pair."""
    keys = ("tpot_p50", "tpot_p99", "ttft_p50", "d_engine_ms_tok", "d_other_ms_tok")
    for wl in dict.fromkeys(r["workload"] for r in rows):
        mine = [r for r in rows if r["workload"] == wl]
        for v in ("same", "split"):
            med = {k: statistics.median(r[k] for r in mine if r["variant"] == v) for k in keys}
            print(wl, v, " ".join(f"{k} {x:.3f}" for k, x in med.items()))
        by_variant = lambda r: r["variant"]  # noqa: E731 - "same" sorts before "split"
        pairs = [sorted(mine[i : i + 2], key=by_variant) for i in range(0, len(mine), 2)]
        for k in ("tpot_p50", "d_engine_ms_tok"):
            print(f"  split/same {k} per pair", [round(b[k] / a[k], 2) for a, b in pairs])


def stop(c: inflight.Cluster) -> None:
    """Stop a cluster we started, by its PID: SIGTERM (`pdserve up` then stops its instances;
    SIGINT would be ignored when this driver runs as a background job)."""
    c.popen.send_signal(signal.SIGTERM)
    c.popen.wait(30)


def finish(out: Path, rows: list[dict]) -> None:
    (out / "rows.json").write_text(json.dumps(rows, indent=1))
    print(f"end {time.strftime('%F %T')} load {Path('/proc/loadavg').read_text().strip()}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--summary", action="store_true", help="only summarize OUT/rows.json")
    a = ap.parse_args()
    if a.summary:
        summarize(json.loads((a.out / "rows.json").read_text()))
        return
    a.out.mkdir(parents=True, exist_ok=True)
    print(f"start {time.strftime('%F %T')} load {Path('/proc/loadavg').read_text().strip()}")
    c = inflight.start_cluster("push", a.out, isolate=True)
    rows = []
    try:
        for wl in WORKLOADS:  # warm-up: every shape once, unmeasured
            warm = with_prompts(WORKLOADS[wl], 4)
            inflight.bench(c.url, warm, None, a.out / f"warm-{wl}.log", core0=True).wait()
        eng = engine_thread(c.pids["decode"])
        for r in range(a.rounds):
            order = ("same", "split") if r % 2 == 0 else ("split", "same")
            for wl in WORKLOADS:
                for variant in order + order[::-1]:
                    rows.append({"round": r, **window(c, eng, variant, wl, a.out)})
    finally:
        stop(c)
    summarize(rows)
    finish(a.out, rows)


if __name__ == "__main__":
    main()
