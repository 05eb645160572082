"""Summarise handoff_ab.sh runs: per workload, mode and code, each round's figures and the
median over rounds; then after/before ratios of the round medians.

usage: handoff_ab_summary.py AB_DIR [AB_DIR ...]   (dirs holding r<round>-<code>-<mode>/)
"""

from __future__ import annotations

import json
import re
import statistics
import sys
from pathlib import Path

FIELDS = [
    ("median_handoff_ms", "handoff p50"),
    ("p99_handoff_ms", "handoff p99"),
    ("median_ttft_ms", "TTFT p50"),
    ("median_tpot_ms", "TPOT p50"),
]


def collect(dirs: list[Path]) -> dict[tuple[str, str, str], list[dict]]:
    runs: dict[tuple[str, str, str], list[dict]] = {}
    for d in dirs:
        for run in sorted(d.glob("r*-*-*")):
            m = re.fullmatch(r"r(\d+)-(\w+)-(push|pull)", run.name)
            if not m:
                continue
            for wl in ("serial", "rate2"):
                f = run / f"{wl}.json"
                if f.exists():
                    res = json.loads(f.read_text())
                    res["_round"] = f"{d.name}/r{m.group(1)}"
                    runs.setdefault((wl, m.group(3), m.group(2)), []).append(res)
    return runs


def main() -> None:
    runs = collect([Path(a) for a in sys.argv[1:]])
    for wl in ("serial", "rate2"):
        title = "one request at a time" if wl == "serial" else "2 req/s"
        print(f"### 1024 tokens, {title}\n")
        print("| mode | code | " + " | ".join(n for _, n in FIELDS) + " | rounds | failed |")
        print("|---|---|" + "---|" * (len(FIELDS) + 2))
        for mode in ("push", "pull"):
            med = {}
            for code in ("before", "after"):
                rs = runs.get((wl, mode, code), [])
                if not rs:
                    continue
                vals = [statistics.median(r[k] for r in rs if r[k] is not None) for k, _ in FIELDS]
                med[code] = vals
                per = "; ".join("/".join(f"{r[k]:.1f}" for k, _ in FIELDS[:2]) for r in rs)
                failed = sum(r["failed"] for r in rs)
                cells = " | ".join(f"{v:.2f}" for v in vals)
                print(f"| {mode} | {code} | {cells} | {len(rs)} ({per}) | {failed} |")
            if len(med) == 2:
                pairs = zip(med["after"], med["before"], strict=True)
                ratios = " | ".join(f"{a / b:.2f}x" for a, b in pairs)
                print(f"| {mode} | after/before | {ratios} | | |")
        print()


if __name__ == "__main__":
    main()
