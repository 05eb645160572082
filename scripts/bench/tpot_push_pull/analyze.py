"""Tables from run.py's output: per run, the client's figures next to D's and P's step traces
and each process's thread CPU.

usage: analyze.py OUTDIR
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

from pdserve.engine.steptrace import StepRecord, parse_step_line


def steps(log: Path) -> list[StepRecord]:
    with open(log, errors="replace") as f:
        return [r for line in f if (r := parse_step_line(line)) is not None]


def window(recs: list[StepRecord], t0: float, t1: float) -> list[StepRecord]:
    return [r for r in recs if t0 <= r.t <= t1]


def cpu_delta(row: dict, role: str) -> dict[str, float]:
    a, b = row["before"]["cpu"][role], row["after"]["cpu"][role]
    return {tid: b[tid] - a.get(tid, 0.0) for tid in b}


def by_name(delta: dict[str, float], names: dict[str, str]) -> dict[str, float]:
    """CPU by thread kind: peer ids and addresses dropped from the names, unnamed = other."""
    out: dict[str, float] = defaultdict(float)
    for tid, s in delta.items():
        name = re.sub(
            r"-(prefill|decode)?-?[0-9a-f]{8}\S*|-127\.0\.0\.1:\d+", "", names.get(tid, "other")
        )
        out[name] += s
    return out


def decode_concurrency(res: dict) -> float:
    """Mean number of requests decoding at once (client view), weighted by decode time."""
    times = zip(res["start_times"], res["ttfts"], res["latencies"], strict=True)
    iv = [(s + t, s + lat) for s, t, lat in times if t is not None and lat is not None]
    span = sum(b - a for a, b in iv)
    overlap = sum(max(0.0, min(b, d) - max(a, c)) for a, b in iv for c, d in iv)
    return overlap / span


def d_stats(recs: list[StepRecord], span: float) -> dict[str, float]:
    dec = [r for r in recs if r.decodes]
    busy = sum(r.step_s for r in recs)
    tw = sum(r.decodes * (r.step_s + r.gap_s) for r in dec) / sum(r.step_s + r.gap_s for r in dec)
    return {
        "steps": len(recs),
        "batch_mean_tw": tw,
        "batch_p50": statistics.median(r.decodes for r in dec),
        "batch_max": max(r.decodes for r in dec),
        "step_ms_p50": 1000 * statistics.median(r.step_s for r in dec),
        "gap_ms_p50": 1000 * statistics.median(r.gap_s for r in dec),
        "busy": busy / span,
        "tok_s": sum(r.decodes for r in recs) / span,
        "landed": sum(r.kv_landed for r in recs),
    }


def main() -> None:
    out = Path(sys.argv[1])
    rows = json.loads((out / "rows.json").read_text())
    names = json.loads((out / "threads.json").read_text())["names"]
    trace = {
        m: {role: steps(out / f"logs-{m}/{role}-0.log") for role in ("prefill", "decode")}
        for m in dict.fromkeys(row["mode"] for row in rows)
    }
    print(
        "| run | ok/failed | TTFT p50 | TPOT p50 | TPOT p99 | handoff p50 | E2EL p50 | out tok/s "
        "| client decode conc | D batch (time-wtd) | D batch p50 / max | D step ms p50 "
        "| D gap ms p50 | D busy | D tok/s | P steps | P step ms p50 | P busy | load |"
    )
    print("|" + "---|" * 19)
    pooled: dict[str, list[StepRecord]] = defaultdict(list)
    cpu_rows = []
    per_mode: dict[str, list[dict]] = defaultdict(list)
    for row in rows:
        m, t1 = row["mode"], row["after"]["t"]
        res = json.loads((out / f"{row['tag']}.json").read_text())
        # the step trace from the first measured request on (the 2 warm-ups come before)
        t0 = res["start_time_unix"] - row["before"]["wall"] + row["before"]["t"]
        span = t1 - t0
        d = d_stats(window(trace[m]["decode"], t0, t1), span)
        p = window(trace[m]["prefill"], t0, t1)
        pooled[m] += [r for r in window(trace[m]["decode"], t0, t1) if r.decodes]
        conc = decode_concurrency(res)
        per_mode[m].append({**d, "tpot": res["median_tpot_ms"], "ttft": res["median_ttft_ms"]})
        print(
            f"| {row['tag']} | {res['completed']}/{res['failed']}"
            f" | {res['median_ttft_ms']:.0f} | {res['median_tpot_ms']:.1f}"
            f" | {res['p99_tpot_ms']:.1f} | {res['median_handoff_ms']:.1f}"
            f" | {res['median_e2el_ms']:.0f} | {res['output_throughput']:.0f} | {conc:.2f}"
            f" | {d['batch_mean_tw']:.2f} | {d['batch_p50']:.0f} / {d['batch_max']}"
            f" | {d['step_ms_p50']:.1f} | {d['gap_ms_p50']:.1f} | {d['busy']:.2f}"
            f" | {d['tok_s']:.0f} | {len(p)} | {1000 * statistics.median(r.step_s for r in p):.0f}"
            f" | {sum(r.step_s for r in p) / span:.2f}"
            f" | {row['before']['load'][0]}-{row['after']['load'][0]} |"
        )
        dn = by_name(cpu_delta(row, "decode"), names[m]["decode"])
        idle = row["after"].get("idle_cpu", {})
        idle_s = sum(v - row["before"]["idle_cpu"][k] for k, v in idle.items())
        cpu_rows.append(
            (row["tag"], span, dn, sum(cpu_delta(row, "prefill").values()),
             sum(cpu_delta(row, "router").values()), idle_s, row.get("client_cpu", 0.0),
             {k: v - row["before"]["runq"][k] for k, v in row["after"].get("runq", {}).items()})
        )  # fmt: skip
    print("\nThread CPU seconds per run incl. the 2 warm-ups (D by thread; P, router totals):\n")
    threads = sorted({k for _, _, dn, *_ in cpu_rows for k in dn}, key=str)
    head = " | ".join(f"D {t}" for t in threads)
    print(
        f"| run | window s | {head} | P | router | idle cluster | bench client "
        "| runq wait D / P / router |"
    )
    print("|" + "---|" * (len(threads) + 7))
    for tag, span, dn, pc, rc, idle_s, cl, rq in cpu_rows:
        cells = " | ".join(f"{dn.get(t, 0.0):.2f}" for t in threads)
        waits = " / ".join(
            f"{rq.get(k, float('nan')):.2f}" for k in ("decode", "prefill", "router")
        )
        print(
            f"| {tag} | {span:.1f} | {cells} | {pc:.2f} | {rc:.2f} | {idle_s:.2f} | {cl:.2f}"
            f" | {waits} |"
        )
    print("\nD's decode step time by batch size (all runs of a mode pooled):\n")
    modes = list(trace)
    print("| decodes per step | " + " | ".join(f"{m}: steps | {m}: step ms" for m in modes) + " |")
    print("|---|" + "---|---|" * len(modes))
    sizes = sorted({r.decodes for rs in pooled.values() for r in rs})
    for n in sizes:
        cells = []
        for m in modes:
            xs = [r.step_s for r in pooled[m] if r.decodes == n]
            cells.append(f"{len(xs)} | {1000 * statistics.fmean(xs):.1f}" if xs else "0 | -")
        print(f"| {n} | {' | '.join(cells)} |")
    print("\nMeans over runs:\n")
    for m, ds in per_mode.items():
        keys = ("tpot", "ttft", "batch_mean_tw", "step_ms_p50", "busy", "tok_s")
        print(m, {k: round(statistics.fmean(d[k] for d in ds), 2) for k in keys})


if __name__ == "__main__":
    main()
