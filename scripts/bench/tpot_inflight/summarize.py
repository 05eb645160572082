"""Table of run.py's rows.json: per mode, A (no transfers) vs B (transfers in flight), and
C (P prefilling, nothing transferred) where the run has C windows.

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
        tag = r["tag"].removeprefix(f"{r['mode']}-")
        out.append(
            f"| {r['mode']} | {tag} | {r['tpot_p50']:.1f} | {r['tpot_p99']:.1f}"
            f" | {r['itl_p99']:.1f} | {bg:.0f} | {r['cpu_decode']:.2f} | {r['rq_decode']:.2f}"
            f" | {r['cpu_prefill']:.2f} | {r['cpu_router']:.2f} | {r['t']:.1f}"
            f" | {r['load_before'][0]}-{r['load_after'][0]} |"
        )
    if any(kind(r) == "C" for r in rows):
        return [*out, *ratios_with_control(rows), ""]
    out += ["", "| mode | TPOT p50 A / B / ratio | TPOT p99 A / B / ratio |", "|---|---|---|"]
    for mode in dict.fromkeys(r["mode"] for r in rows):
        a = [r for r in rows if r["mode"] == mode and kind(r) == "A"]
        b = [r for r in rows if r["mode"] == mode and kind(r) == "B"]
        cells = []
        for key in ("tpot_p50", "tpot_p99"):
            ma, mb = mean(a, key), mean(b, key)
            cells.append(f"{ma:.1f} / {mb:.1f} / {mb / ma:.2f}")
        out.append(f"| {mode} | {cells[0]} | {cells[1]} |")
    return [*out, ""]


def kind(row: dict) -> str:
    """A, B or C (rows of runs before C windows have only `background`)."""
    return row.get("window") or ("B" if row["background"] else "A")


def ratios_with_control(rows: list[dict]) -> list[str]:
    """Per mode: TPOT p50 of A, B and C windows (mean over windows, and the median, which a
    single disturbed window does not move) and their ratios."""
    out = ["", "| mode | over windows | TPOT p50 A / B / C | B/A | C/A | **B/C** |"]
    out.append("|---|---|---|---|---|---|")
    for mode in dict.fromkeys(r["mode"] for r in rows):
        m = {k: [r["tpot_p50"] for r in rows if r["mode"] == mode and kind(r) == k] for k in "ABC"}
        for name, f in (("mean", statistics.fmean), ("median", statistics.median)):
            v = {k: f(x) for k, x in m.items()}
            out.append(
                f"| {mode} | {name} | {v['A']:.1f} / {v['B']:.1f} / {v['C']:.1f}"
                f" | {v['B'] / v['A']:.2f} | {v['C'] / v['A']:.2f} | {v['B'] / v['C']:.2f} |"
            )
    return out


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        sys.exit(0 if len(sys.argv) > 1 else 2)
    for arg in sys.argv[1:]:
        print("\n".join(summarize(Path(arg))))


if __name__ == "__main__":
    main()
