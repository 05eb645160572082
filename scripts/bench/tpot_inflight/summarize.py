"""Table of run.py's rows.json: per mode, A (no transfers) vs B (transfers in flight).

usage: summarize.py ROWS_JSON [ROWS_JSON ...]
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def mean(rows: list[dict], key: str) -> float:
    return statistics.fmean(r[key] for r in rows)


def summarize(path: Path) -> list[str]:
    rows = json.loads(path.read_text())
    out = [f"### {path.parent.name}", ""]
    out.append(
        "| mode | window | TPOT p50 ms | TPOT p99 ms | ITL p99 ms | KV landed (bg) "
        "| D CPU s | D runq wait s | P CPU s | router CPU s | window s | load 1m |"
    )
    out.append("|" + "---|" * 12)
    for r in rows:
        bg = r["kv_received"] - r["completed"]  # the foreground's own prompts land in D too
        out.append(
            f"| {r['mode']} | {r['tag'].split('-')[1]} | {r['tpot_p50']:.1f} | {r['tpot_p99']:.1f}"
            f" | {r['itl_p99']:.1f} | {bg:.0f} | {r['cpu_decode']:.2f} | {r['rq_decode']:.2f}"
            f" | {r['cpu_prefill']:.2f} | {r['cpu_router']:.2f} | {r['t']:.1f}"
            f" | {r['load_before'][0]}-{r['load_after'][0]} |"
        )
    out += ["", "| mode | TPOT p50 A / B / ratio | TPOT p99 A / B / ratio |", "|---|---|---|"]
    for mode in dict.fromkeys(r["mode"] for r in rows):
        a = [r for r in rows if r["mode"] == mode and not r["background"]]
        b = [r for r in rows if r["mode"] == mode and r["background"]]
        cells = []
        for key in ("tpot_p50", "tpot_p99"):
            ma, mb = mean(a, key), mean(b, key)
            cells.append(f"{ma:.1f} / {mb:.1f} / {mb / ma:.2f}")
        out.append(f"| {mode} | {cells[0]} | {cells[1]} |")
    return [*out, ""]


def main() -> None:
    for arg in sys.argv[1:]:
        print("\n".join(summarize(Path(arg))))


if __name__ == "__main__":
    main()
