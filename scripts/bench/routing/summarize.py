"""Tables for docs/results.md (routing) from the result JSONs in results/routing/.

usage: summarize.py   (after bench_routing.py, which writes results/routing/ in the repo)
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parents[3] / "results" / "routing"
KEYS = ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms")


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def routing() -> None:
    runs: dict[str, list[dict]] = {}
    for f in sorted(HERE.glob("routing-*-r*.json")):
        name = f.stem[len("routing-") :].rsplit("-r", 1)[0]
        runs.setdefault(name, []).append(load(f))
    if not runs:
        return
    base = runs.get("push-round_robin")
    print(
        "| config | rounds | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 | done/failed "
        "| vs push RR (TTFT p50, p99, TPOT p50, p99) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, rs in runs.items():
        vals = [statistics.mean(r[k] for r in rs) for k in KEYS]
        done = sum(r["completed"] for r in rs)
        failed = sum(r.get("failed", 0) for r in rs)
        ratio = ""
        if base:
            b = [statistics.mean(r[k] for r in base) for k in KEYS]
            ratio = ", ".join(f"{v / bb:.2f}" for v, bb in zip(vals, b, strict=True))
        print(
            f"| {name} | {len(rs)} | {vals[0]:.0f} | {vals[1]:.0f} | {vals[2]:.1f} | {vals[3]:.1f} "
            f"| {done}/{failed} | {ratio} |"
        )
    print()
    print("per round:")
    for f in sorted(HERE.glob("routing-*-r*.json")):
        r = load(f)
        print(
            f"  {f.stem}: "
            + " ".join(f"{k}={r[k]:.1f}" for k in KEYS)
            + f" load={r.get('loadavg_before', 0):.1f}"
        )


def crossover() -> None:
    lengths = sorted({int(f.stem.split("-")[1]) for f in HERE.glob("crossover-*-*.json")})
    if not lengths:
        return
    print(
        "| prompt tokens | TTFT p50 disagg | TTFT p50 local | local/disagg | TTFT p99 disagg "
        "| TTFT p99 local | TPOT p50 disagg | TPOT p50 local | local/disagg |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for n in lengths:
        d, loc = load(HERE / f"crossover-{n}-disagg.json"), load(HERE / f"crossover-{n}-local.json")
        print(
            f"| {n} | {d['median_ttft_ms']:.1f} | {loc['median_ttft_ms']:.1f} "
            f"| {loc['median_ttft_ms'] / d['median_ttft_ms']:.2f} | {d['p99_ttft_ms']:.1f} "
            f"| {loc['p99_ttft_ms']:.1f} | {d['median_tpot_ms']:.1f} | {loc['median_tpot_ms']:.1f} "
            f"| {loc['median_tpot_ms'] / d['median_tpot_ms']:.2f} |"
        )


if __name__ == "__main__":
    if sys.argv[1:]:
        print(__doc__)
        sys.exit(0 if sys.argv[1] in ("-h", "--help") else 2)
    crossover()
    print()
    routing()
