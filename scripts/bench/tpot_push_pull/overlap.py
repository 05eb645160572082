"""Where push's extra inter-token time sits: the client's ITL by token position, and D's
decode steps that overlap a KV transfer landing on D.

A transfer's window on D, from the hop trace (`pdserve.handoff`, on at `--log-level debug`):
pull: `d.claimed` to `d.read_done` (D's READ); push: each `tcp.recv` of a Write, taken as the
4 ms before its hop (a 1 MiB-per-layer receive on this machine). Step records use
time.monotonic(), hops time.time(): the offset comes from each step line's log timestamp.

Second table: every decode-only step (any batch size), each overlapping one against the mean
of the non-overlapping steps of the same batch size; the sum of those excesses over the
sum of all decode-only step times is the share of D's decoding the receives cost.

usage: overlap.py OUTDIR   (a run.py output directory)
"""

from __future__ import annotations

import json
import statistics
import sys
from datetime import datetime
from pathlib import Path

from pdserve.engine.steptrace import StepRecord, parse_step_line

WRITE_RECV_S = 0.004
ITL_BINS = ((0, 1), (1, 8), (8, 16), (16, 32), (32, 48), (48, 63))


def _log_wall(line: str) -> float:
    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def read_log(path: Path) -> tuple[list[StepRecord], list[dict], float]:
    """Step records, hop records, and wall - monotonic (median over the step lines)."""
    steps, hops, offsets = [], [], []
    for line in path.open(errors="replace"):
        rec = parse_step_line(line)
        if rec is not None:
            steps.append(rec)
            offsets.append(_log_wall(line) - (rec.t + rec.step_s))
        elif "pdserve.handoff: hop " in line:
            hops.append(json.loads(line.split("hop ", 1)[1]))
    return steps, hops, statistics.median(offsets)


def transfer_windows(hops: list[dict], offset: float) -> list[tuple[float, float]]:
    """Monotonic (start, end) of each KV receive on D."""
    windows, claimed = [], {}
    for h in hops:
        t = h["t"] - offset
        if h["name"] == "tcp.recv" and h["key"] == "Write":
            windows.append((t - WRITE_RECV_S, t))
        elif h["name"] == "d.claimed":
            claimed[h["key"]] = t
        elif h["name"] == "d.read_done" and h["key"] in claimed:
            windows.append((claimed.pop(h["key"]), t))
    return windows


def overlap_split(steps: list[StepRecord], windows: list[tuple[float, float]]) -> tuple:
    """Batch-1 decode step times (ms): those overlapping a window, and the rest."""
    hit, rest = [], []
    for r in steps:
        if r.decodes != 1 or r.prefills:
            continue
        a, b = r.t, r.t + r.step_s
        overlaps = any(x < b and y > a for x, y in windows)
        (hit if overlaps else rest).append(1000 * r.step_s)
    return hit, rest


def matched_excess(
    steps: list[StepRecord], windows: list[tuple[float, float]]
) -> tuple[int, int, list[float], float]:
    """(decode-only steps, overlapping ones, their ms over same-batch others, total ms)."""
    hit: list[StepRecord] = []
    rest: dict[int, list[float]] = {}
    total = 0.0
    for r in steps:
        if r.prefills or not r.decodes:
            continue
        total += 1000 * r.step_s
        a, b = r.t, r.t + r.step_s
        if any(x < b and y > a for x, y in windows):
            hit.append(r)
        else:
            rest.setdefault(r.decodes, []).append(1000 * r.step_s)
    base = {n: statistics.fmean(v) for n, v in rest.items()}
    excess = [1000 * r.step_s - base[r.decodes] for r in hit if r.decodes in base]
    n_steps = len(hit) + sum(len(v) for v in rest.values())
    return n_steps, len(hit), excess, total


def _cell(xs: list[float]) -> str:
    if not xs:
        return "0 | - | -"
    return f"{len(xs)} | {statistics.fmean(xs):.2f} | {statistics.median(xs):.2f}"


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        sys.exit(0 if len(sys.argv) > 1 else 2)
    out = Path(sys.argv[1])
    rows = json.loads((out / "rows.json").read_text())
    modes = list(dict.fromkeys(row["mode"] for row in rows))
    print("Client inter-token latency (ms, mean over all requests of a mode) by token position:\n")
    print("| mode | " + " | ".join(f"ITL {a + 1}-{b}" for a, b in ITL_BINS) + " | all | p50 |")
    print("|---|" + "---|" * (len(ITL_BINS) + 2))
    for m in modes:
        itls = [json.loads((out / f"{r['tag']}.json").read_text())["itls"] for r in rows]
        itls = [it for r, per in zip(rows, itls, strict=True) if r["mode"] == m for it in per]
        cells = [statistics.fmean(x for it in itls for x in it[a:b]) for a, b in ITL_BINS]
        flat = [x for it in itls for x in it]
        vals = [*cells, statistics.fmean(flat), statistics.median(flat)]
        print(f"| {m} | " + " | ".join(f"{1000 * v:.2f}" for v in vals) + " |")
    print("\nD's batch-1 decode steps against KV receives on D (whole run incl. warm-ups):\n")
    print(
        "| mode | receives | overlapping: steps | mean ms | p50 ms "
        "| others: steps | mean ms | p50 ms |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for m in modes:
        steps, hops, offset = read_log(out / f"logs-{m}/decode-0.log")
        windows = transfer_windows(hops, offset)
        hit, rest = overlap_split(steps, windows)
        print(f"| {m} | {len(windows)} | {_cell(hit)} | {_cell(rest)} |")
    print("\nD's decode-only steps (any batch), overlapping a receive vs same-batch others:\n")
    print("| mode | steps | overlapping | excess per overlapping step: mean / p50 ms | share |")
    print("|---|---|---|---|---|")
    for m in modes:
        steps, hops, offset = read_log(out / f"logs-{m}/decode-0.log")
        n, k, excess, total = matched_excess(steps, transfer_windows(hops, offset))
        mean = statistics.fmean(excess) if excess else float("nan")
        p50 = statistics.median(excess) if excess else float("nan")
        share = sum(excess) / total if total else float("nan")
        print(f"| {m} | {n} | {k} ({k / max(n, 1):.0%}) | {mean:.2f} / {p50:.2f} | {share:.1%} |")


if __name__ == "__main__":
    main()
