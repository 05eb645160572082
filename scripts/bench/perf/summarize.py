"""Markdown table of bench-serve result JSONs: python summarize.py DIR [DIR ...]."""

from __future__ import annotations

import json
import sys
from pathlib import Path

rows = []
for d in sys.argv[1:]:
    for f in sorted(Path(d).glob("*.json")):
        r = json.loads(f.read_text())
        if "median_ttft_ms" not in r:
            continue
        rate = "1 at a time" if r.get("max_concurrency") == 1 else f"{r['request_rate']:g} req/s"
        h = r.get("median_handoff_ms")
        rows.append(
            (
                r["input_len"],
                rate,
                r["label"],
                r["completed"],
                r.get("failed", 0),
                r["median_ttft_ms"],
                r["p99_ttft_ms"],
                r["median_tpot_ms"],
                r["p99_tpot_ms"],
                h,
                r.get("p99_handoff_ms"),
            )
        )
order = {"pull": 0, "push": 1, "monolithic": 2}
rows.sort(key=lambda x: (x[0], x[1] != "1 at a time", x[1], order.get(x[2], 3)))
print(
    "| input | load | mode | ok / failed | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 "
    "| handoff p50 | handoff p99 |"
)
print("|---|---|---|---|---|---|---|---|---|---|")


def f(v: float | None) -> str:
    """One figure: '-' if missing, 1 decimal from 10 up, else 2."""
    return "-" if v is None else f"{v:.1f}" if v >= 10 else f"{v:.2f}"


for r in rows:
    print(
        f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} / {r[4]} | " + " | ".join(f(v) for v in r[5:]) + " |"
    )
