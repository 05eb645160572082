"""Markdown table of an xPyD run: one row per (mode, topology), ratios against 1P1D.

usage: table.py OUTDIR   (run_xpyd.sh's output directory)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        sys.exit(0 if len(sys.argv) > 1 else 2)
    out = Path(sys.argv[1])
    rows = {}
    for f in sorted(out.glob("*.json")):
        d = json.loads(f.read_text())
        m = d["metadata"]
        rows[(m["mode"], int(m["prefill"]), int(m["decode"]))] = d
    print(
        "| mode | P | D | rate | ok / failed | req/s | req/s per P | out tok/s "
        "| TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 | handoff p50 | load before |"
    )
    print("|" + "---|" * 14)
    for (mode, p, dd), d in sorted(
        rows.items(), key=lambda kv: (kv[0][0], kv[0][1] * 10 + kv[0][2])
    ):
        print(
            f"| {mode} | {p} | {dd} | {d['request_rate']:g} | {d['completed']} / {d['failed']} "
            f"| {d['request_throughput']:.2f} | {d['request_throughput'] / p:.2f} "
            f"| {d['output_throughput']:.0f} | {d['median_ttft_ms']:.0f} | {d['p99_ttft_ms']:.0f} "
            f"| {d['median_tpot_ms']:.1f} | {d['p99_tpot_ms']:.1f} "
            f"| {(d['median_handoff_ms'] or 0):.0f} | {d['metadata'].get('load_before', '-')} |"
        )
    print()
    print("Ratios to 1P1D of the same mode (throughput per P instance, TTFT p50, TPOT p50):")
    print()
    print("| mode | topology | req/s per P | TTFT p50 | TPOT p50 |")
    print("|---|---|---|---|---|")
    for (mode, p, dd), d in sorted(
        rows.items(), key=lambda kv: (kv[0][0], kv[0][1] * 10 + kv[0][2])
    ):
        base = rows.get((mode, 1, 1))
        if base is None:
            continue
        print(
            f"| {mode} | {p}P{dd}D "
            f"| {d['request_throughput'] / p / base['request_throughput']:.2f} "
            f"| {d['median_ttft_ms'] / base['median_ttft_ms']:.2f} "
            f"| {d['median_tpot_ms'] / base['median_tpot_ms']:.2f} |"
        )


if __name__ == "__main__":
    main()
