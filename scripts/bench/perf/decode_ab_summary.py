"""Table of decode ms/step (and prefill tok/s) from a `decode_ab.sh` output directory.

ms/step = 1000 * batch / (decode tok/s). Per model, metric and side: the best (min ms/step,
max tok/s) and the median over the rounds; ratios are after / before.
usage: python scripts/bench/perf/decode_ab_summary.py OUT_DIR
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path


def load(out: Path) -> dict[tuple[str, str, str], list[float]]:
    """(model, metric, side) -> values over rounds."""
    runs: dict[tuple[str, str, str], list[float]] = defaultdict(list)
    for path in sorted(out.glob("*.json")):
        side = path.name.split("-")[0]
        for row in json.loads(path.read_text()):
            model = Path(row["model"]).name
            runs[(model, "prefill tok/s", side)].append(row["prefill_tok_s"])
            for key, tok_s in row.items():
                if key.startswith("decode_tok_s_b"):
                    batch = int(key.removeprefix("decode_tok_s_b"))
                    runs[(model, f"decode b={batch} ms/step", side)].append(1000 * batch / tok_s)
    return runs


def main(out: Path) -> None:
    runs = load(out)
    print("| model | metric | before best / median | after best / median | ratio best | median |")
    print("|---|---|---|---|---|---|")
    for model, metric in sorted({(m, k) for m, k, _ in runs}):
        b, a = runs[(model, metric, "before")], runs[(model, metric, "after")]
        best = max if metric.endswith("tok/s") else min  # least disturbed by other load
        bm, am = statistics.median(b), statistics.median(a)
        print(
            f"| {model} | {metric} | {best(b):.2f} / {bm:.2f} | {best(a):.2f} / {am:.2f} "
            f"| {best(a) / best(b):.2f} | {am / bm:.2f} |"
        )


if __name__ == "__main__":
    main(Path(sys.argv[1]))
