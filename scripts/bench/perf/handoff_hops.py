"""Per-hop breakdown of the P/D handoff from `pdserve.handoff` trace lines (pdserve/tracelog.py).

usage: handoff_hops.py [--pool] RUN_DIR [RUN_DIR ...]
RUN_DIR holds logs/{prefill-0,decode-0,router}.log of a cluster run with the trace on, and
serial.json (bench serve --save-result, one request at a time). On vLLM's engine (`pdserve
up --engine vllm ... -- --log-level debug`: the instances' hops come from the KV connector
only) the table starts at P's last saved layer, needs no serial.json and takes any load.
For each request: the time of each hop after P's prefill-done, joined by transfer id,
request id, or (for the transport's unkeyed frames) by time; prints the median and p90 of
each hop's time since prefill done and of the step from the previous hop.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from pdserve.tracelog import parse_hop_line

PUSH = [
    ("p.prefill_done", "P: prompt done (engine thread, sampled)"),
    ("p.writer_fin", "P: writer takes the finished prompt"),
    ("p.last_write_sent", "P: last layer WRITE on the wire (tcp sender)"),
    ("d.last_write_recv", "D: last layer WRITE landed (tcp receiver)"),
    ("p.last_ack", "P: its Ack back (tcp receiver)"),
    ("p.watch_done", "P: watcher wakes on it"),
    ("p.notif_posted", "P: writer posts PushDone"),
    ("p.notif_sent", "P: PushDone on the wire (tcp sender)"),
    ("d.notif_recv", "D: PushDone read (tcp receiver)"),
    ("d.notif_thread", "D: notification thread has it"),
    ("d.engine_kv", "D: engine thread applies it"),
    ("d.engine_out", "D: first token output made"),
    ("d.deliver", "D: handed to the event loop"),
    ("d.sse_first", "D: SSE event yielded"),
    ("r.first_token", "router: first token read"),
    ("r.respond", "router: response built"),
    ("r.asgi_call", "router: ASGI response called"),
    ("r.relay_first", "router: first chunk to the client"),
    ("client", "client: first token"),
]
WHOLE = [
    ("p.prefill_done", "P: prompt done (engine thread, sampled)"),
    ("p.writer_fin", "P: writer takes the finished prompt"),
    ("p.write_posted", "P: writer posts the WRITE (PushDone as its notification)"),
    ("p.write_sent", "P: WRITE on the wire (tcp sender)"),
    ("d.write_recv", "D: WRITE landed, PushDone queued (tcp receiver)"),
    *PUSH[9:],
]
PULL = [
    ("p.prefill_done", "P: prompt done (engine thread, sampled)"),
    ("r.p_answer", "router: P's answer"),
    ("r.d_leg_sent", "router: D leg sent"),
    ("d.http_handler", "D: HTTP handler (body parsed)"),
    ("d.engine_add", "D: engine thread adds it"),
    ("d.start_receive", "D: engine admits, queues the READ"),
    ("d.lane_start", "D: lane thread starts the job"),
    ("d.claimed", "D: claim granted (side channel)"),
    ("d.read_done", "D: READ done"),
    ("d.engine_kv", "D: engine thread applies it"),
    ("d.engine_out", "D: first token output made"),
    ("d.deliver", "D: handed to the event loop"),
    ("d.sse_first", "D: SSE event yielded"),
    ("r.first_token", "router: first token read"),
    ("r.respond", "router: response built"),
    ("r.asgi_call", "router: ASGI response called"),
    ("r.relay_first", "router: first chunk to the client"),
    ("client", "client: first token"),
]


VLLM_PUSH = [
    ("p.layers_done", "P: last layer saved (vLLM's forward pass)"),
    ("p.notif_posted", "P: writer posts PushDone (every layer's write done)"),
    ("d.notif_thread", "D: notification thread has it"),
    ("r.first_token", "router: D's first token read"),
    ("r.p_answer", "router: P's answer (vLLM's HTTP response)"),
    ("p.writer_fin", "P: the request's SendSpec reaches the worker (frees the hold)"),
]


def per_transfer_vllm(run: Path) -> list[dict[str, float]]:
    """vLLM push: each transfer's hops, in ms since P's last saved layer."""
    keyed: dict[str, dict[str, float]] = {}
    for _, h in load(run):
        keyed.setdefault(h.key, {}).setdefault(h.name, h.t)
    rows = [v for v in keyed.values() if "p.layers_done" in v and "r.first_token" in v]
    return [{k: (t - v["p.layers_done"]) * 1e3 for k, t in v.items()} for v in rows]


def load(run: Path):
    hops = []  # (proc, Hop)
    for log in sorted((run / "logs").glob("*.log")):
        for line in log.read_text(errors="replace").splitlines():
            h = parse_hop_line(line)
            if h is not None:
                hops.append((log.stem.split("-")[0], h))
    return hops


def per_request(run: Path) -> tuple[list[dict[str, float]], bool]:
    hops = load(run)
    keyed: dict[str, dict[str, float]] = {}
    rid_of: dict[str, str] = {}
    for _, h in hops:
        if h.name == "d.engine_out":
            rid_of[h.key] = str(h.extra["rid"])
    by_rid = {}
    for _, h in hops:
        keyed.setdefault(h.key, {}).setdefault(h.name, h.t)
        by_rid.setdefault(h.key, {}).setdefault(h.name, h.t)
    starts = sorted((v["p.prefill_done"], k) for k, v in keyed.items() if "p.prefill_done" in v)
    res = json.loads((run / "serial.json").read_text())
    handoffs = res["handoffs"]
    starts = starts[-len(handoffs) :]
    push = any(h.name == "p.notif_posted" for _, h in hops)
    unkeyed = sorted(
        (h.t, proc, h.name, h.key)
        for proc, h in hops
        if h.name.startswith(("tcp.", "p.watch", "r.relay", "r.asgi", "r.chunks"))
    )
    out = []
    for (t0, tid), ho in zip(starts, handoffs, strict=True):
        row = dict(keyed[tid])
        rid = rid_of.get(tid)
        for key in (rid, rid and rid.split("-", 1)[-1]):
            for name, t in by_rid.get(key, {}).items():
                row.setdefault(name, t)
        rf = row.get("r.respond")
        if rf is not None:
            for name in ("r.asgi_call", "r.chunks_start", "r.relay_first"):
                relay = [u[0] for u in unkeyed if u[2] == name and u[0] >= rf]
                if relay:
                    row[name] = relay[0]
        if ho is not None:
            row["client"] = t0 + ho
        if push and "p.write_posted" in row:  # whole-request write, PushDone its notif
            tw = row["p.write_posted"]
            # The sender may have the WRITE on the wire before the writer logs its post.
            later = [u for u in unkeyed if tw - 0.002 <= u[0] and u[3] == "Write"]
            sent = [u[0] for u in later if u[1] == "prefill" and u[2] == "tcp.sent"]
            recv = [u[0] for u in later if u[1] == "decode" and u[2] == "tcp.recv"]
            if sent:
                row["p.write_sent"] = sent[0]
            if recv:
                row["d.write_recv"] = recv[0]
        if push and "p.notif_posted" in row:
            tn = row["p.notif_posted"]
            lo = t0 - 0.5
            before = [u for u in unkeyed if lo <= u[0] <= tn]
            # The sender may put PushDone on the wire before the writer logs its post.
            writes = [u[0] for u in before if u[1] == "prefill" and u[3] == "Write"]
            start = max(writes[-1] if writes else lo, tn - 0.002)
            after = [u for u in unkeyed if start <= u[0] <= tn + 0.5]

            def last(proc, name, key=None, seq=before):
                c = [u[0] for u in seq if u[1] == proc and u[2] == name and key in (None, u[3])]
                return c[-1] if c else None

            def first(proc, name, key=None, seq=after):
                c = [u[0] for u in seq if u[1] == proc and u[2] == name and key in (None, u[3])]
                return c[0] if c else None

            for k, v in {
                "p.last_write_sent": last("prefill", "tcp.sent", "Write"),
                "d.last_write_recv": last("decode", "tcp.recv", "Write"),
                "p.last_ack": last("prefill", "tcp.ack_recv"),
                "p.watch_done": last("prefill", "p.watch_done"),
                "p.notif_sent": first("prefill", "tcp.sent", "Notif"),
                "d.notif_recv": first("decode", "tcp.recv", "Notif"),
            }.items():
                if v is not None:
                    row[k] = v
        out.append({k: (v - t0) * 1e3 for k, v in row.items()})
        out[-1]["layerwise"] = "p.notif_posted" in row
    return out, push


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def report(rows: list[dict[str, float]], order) -> str:
    lines = [
        "| hop | since prefill done p50 (ms) | p90 | step from previous p50 (ms) | n |",
        "|---|---|---|---|---|",
    ]
    prev = None
    for name, what in order:
        xs = [r[name] for r in rows if name in r]
        if not xs:
            continue
        steps = [r[name] - r[prev] for r in rows if name in r and prev in r] if prev else []
        step = f"{statistics.median(steps):+.3f}" if steps else ""
        lines.append(
            f"| {what} (`{name}`) | {statistics.median(xs):.3f} | {pct(xs, 0.9):.3f} "
            f"| {step} | {len(xs)} |"
        )
        prev = name
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        sys.exit(0 if len(sys.argv) > 1 else 2)
    args = sys.argv[1:]
    pool = "--pool" in args  # one table for all the runs given (same mode)
    runs = [Path(a) for a in args if a != "--pool"]
    groups = [runs] if pool else [[r] for r in runs]
    for group in groups:
        run = " + ".join(map(str, group))
        vllm = [r for g in group for r in per_transfer_vllm(g)]
        if vllm:
            print(f"## {run} (vLLM, push, layer-wise: {len(vllm)} requests)\n")
            print(report(vllm, VLLM_PUSH) + "\n")
            continue
        rows, push = [], False
        for r in group:
            more, push = per_request(r)
            rows += more
        if not push:
            print(f"## {run} (pull, {len(rows)} requests)\n")
            print(report(rows, PULL) + "\n")
            continue
        for lw in (True, False):
            sub = [r for r in rows if r["layerwise"] is lw]
            if sub:
                what = "layer-wise" if lw else "whole-request write"
                print(f"## {run} (push, {what}: {len(sub)} of {len(rows)} requests)\n")
                print(report(sub, PUSH if lw else WHOLE) + "\n")


if __name__ == "__main__":
    main()
