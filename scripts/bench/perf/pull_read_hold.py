"""How long D's pull READ holds the thread that runs it, from D's handoff trace.

For each cluster log directory (light_ttft.py's `logs-MODE`, instances at
`--log-level debug`), per request: `d.start_receive` (engine thread) to `d.claimed` and to
`d.read_done`, and for the thread that ran the claim and the READ (the engine thread with
`--pull-read-on-engine-loop`, the lane otherwise, from `d.lane_start`) its CPU time and its
time waiting for the core over that span; the rest it was blocked (on P's answer or the
transport). Prints p50 / p90 / max in ms.

usage: pull_read_hold.py LOGDIR [LOGDIR ...]
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from pdserve.transfer.hoptrace import Hop, parse_hop_line


def hops_by_key(log: Path) -> dict[str, dict[str, Hop]]:
    out: dict[str, dict[str, Hop]] = {}
    for line in log.read_text().splitlines():
        h = parse_hop_line(line)
        if h is not None:
            out.setdefault(h.key, {})[h.name] = h
    return out


def spans(req: dict[str, Hop]) -> dict[str, float] | None:
    """ms per span of one request, or None if its trace is incomplete."""
    names = ("d.start_receive", "d.claimed", "d.read_done")
    if not all(n in req for n in names):
        return None
    start, claimed, done = (req[n] for n in names)
    # The thread that claims and reads: its first hop is the lane's, or start_receive's.
    first = req.get("d.lane_start", start)
    ms = 1e3
    return {
        "start_receive -> claimed": (claimed.t - start.t) * ms,
        "start_receive -> read_done": (done.t - start.t) * ms,
        "reader thread: wall": (done.t - first.t) * ms,
        "reader thread: cpu": (float(done.extra["cpu"]) - float(first.extra["cpu"])) * ms,
        "reader thread: waiting for the core": (
            float(done.extra.get("runq", 0)) - float(first.extra.get("runq", 0))
        )
        * ms,
    }


def main() -> None:
    for arg in sys.argv[1:]:
        logs = sorted(Path(arg).glob("decode-*.log"))
        rows = [s for log in logs for r in hops_by_key(log).values() if (s := spans(r))]
        print(f"{arg}: {len(rows)} requests")
        for name in rows[0] if rows else ():
            v = sorted(r[name] for r in rows)
            p90 = v[min(len(v) - 1, int(0.9 * len(v)))]
            print(f"  {name:38s} p50 {statistics.median(v):6.2f}  p90 {p90:6.2f}  max {v[-1]:6.2f}")


if __name__ == "__main__":
    main()
