"""What a stranger's P/D leg costs a decode instance that has a cluster token.

Starts one decode instance (push, builtin:tiny, a cluster token) on 127.0.0.1, sends it
`--legs` unsigned push legs with 4k-character prompts from one keep-alive client, one at a
time, and prints the instance's CPU seconds per refused leg (from /proc, so the figure does
not depend on what else the machine runs) and the wall time per leg. Every leg must be
refused with a 401 before its prompt is tokenized (pdserve.server.transfers).

usage: PYTHONPATH=$PWD python scripts/bench/leg_refusal_cost.py [--legs 400] [--rounds 2]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import uuid
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from procs import PdserveProcess

DECODE = ["serve", "--role", "decode", "--kv-transfer", "push", "--threads", "1"]
DECODE += ["--model", "builtin:tiny", "--log-level", "warning"]
FORGED = {
    "do_remote_prefill": True,
    "transfer_mode": "push",
    "remote_engine_id": "prefill-x",
    "remote_incarnation": "abc",
    "remote_host": "127.0.0.1",
    "remote_port": 40000,
}


def cpu_seconds(pid: int) -> float:
    """User + system CPU of process `pid` so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def send_leg(client: httpx.Client, url: str) -> None:
    kv = {**FORGED, "transfer_id": uuid.uuid4().hex}
    body = {"prompt": "x" * 4000, "max_tokens": 16, "kv_transfer_params": kv}
    r = client.post(f"{url}/v1/completions", json=body)
    if r.status_code != 401:
        raise SystemExit(f"expected 401, got {r.status_code}: {r.text}")


def one_round(client: httpx.Client, url: str, pid: int, legs: int) -> tuple[float, float]:
    c0, t0 = cpu_seconds(pid), time.perf_counter()
    for _ in range(legs):
        send_leg(client, url)
    return (cpu_seconds(pid) - c0) / legs, (time.perf_counter() - t0) / legs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--legs", type=int, default=400, help="legs per round (default 400)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds (default 2)")
    args = ap.parse_args()
    env = {"PDSERVE_CLUSTER_TOKEN": uuid.uuid4().hex}
    with PdserveProcess(DECODE, env=env) as d, httpx.Client(trust_env=False, timeout=30) as c:
        for _ in range(20):  # warm: imports, first-request paths
            send_leg(c, d.url)
        for r in range(args.rounds):
            cpu, wall = one_round(c, d.url, d.pid, args.legs)
            print(f"round {r}: D CPU per refused leg {cpu * 1e3:.3f} ms, wall {wall * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
