"""The router's own CPU per request and per relayed token, against fake instances.

A fake P and a fake D (tests/test_router_fake_instance.py, threads of this process, pinned
to `--fake-core`) answer at once; D streams `--tokens` events, `--token-gap-ms` apart. A real
`pdserve router` process runs pinned to `--router-core`. This process sends `--requests`
streaming completions one at a time (a ~`--prompt-words`-word prompt each) and reads
the router's CPU time (schedstat, exact) before and after. Two runs (`--tokens` and 1 token)
split the cost into a per-request and a per-token part. Also prints the router's added
latency to the first event (client's first event minus D's first event send).

usage: router_cpu.py [--mode push] [--requests 200] [--tokens 64] [--token-gap-ms 2]
       (run under flock /work/notes/bench.lock)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "scripts/bench"))
from procstat import run_ns as thread_run_ns  # noqa: E402
from test_router_fake_instance import FakeInstance  # noqa: E402

from pdserve.ports import free_port  # noqa: E402


def run_ns(pid: int) -> int:
    """Nanoseconds the router's threads have been on a CPU so far."""
    return sum(thread_run_ns(pid).values())


def user_sys_s(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of the process (tick-sampled)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def wait_ready(url: str, proc: subprocess.Popen) -> None:
    for _ in range(600):
        if proc.poll() is not None:
            raise RuntimeError("router exited")
        try:
            if httpx.get(f"{url}/v1/models", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError("router not ready")


def one_request(client: httpx.Client, url: str, prompt: str, tokens: int) -> float:
    """Seconds from sending to the first event."""
    body = {"model": "fake-model", "prompt": prompt, "max_tokens": tokens, "stream": True}
    t0 = time.perf_counter()
    first = None
    with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        for chunk in r.iter_raw():
            if first is None and chunk.strip():
                first = time.perf_counter() - t0
    assert first is not None
    return first


def measure(a: argparse.Namespace, tokens: int) -> dict:
    gap = a.token_gap_ms / 1000
    with (
        FakeInstance("prefill") as p,
        FakeInstance("decode", num_chunks=tokens, chunk_delay_s=gap) as d,
    ):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "pdserve", "router", "--prefill", p.url, "--decode", d.url]
        cmd += ["--kv-transfer", a.mode, "--port", str(port), "--local-prefill-below", "0"]
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        os.sched_setaffinity(proc.pid, {a.router_core})
        try:
            wait_ready(url, proc)
            prompt = " ".join(f"w{i}" for i in range(a.prompt_words))
            with httpx.Client(timeout=30) as client:
                for _ in range(5):
                    one_request(client, url, prompt, tokens)
                time.sleep(1.0)
                idle0, t_idle0 = run_ns(proc.pid), time.perf_counter()
                time.sleep(a.idle_s)
                idle_ns_s = (run_ns(proc.pid) - idle0) / (time.perf_counter() - t_idle0)
                c0, t0, us0 = run_ns(proc.pid), time.perf_counter(), user_sys_s(proc.pid)
                firsts = [one_request(client, url, prompt, tokens) for _ in range(a.requests)]
                busy_ns = run_ns(proc.pid) - c0 - idle_ns_s * (time.perf_counter() - t0)
                us1 = user_sys_s(proc.pid)
        finally:
            proc.terminate()
            proc.wait(timeout=20)
    return {
        "tokens": tokens,
        "cpu_ms_per_request": round(busy_ns / a.requests / 1e6, 3),
        "idle_cpu_ms_per_s": round(idle_ns_s / 1e6, 3),
        "first_event_ms_p50": round(statistics.median(firsts) * 1000, 3),
        "user_share": round((us1[0] - us0[0]) / max(1e-9, sum(us1) - sum(us0)), 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--mode", choices=("push", "pull"), default="push")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--token-gap-ms", type=float, default=2.0)
    ap.add_argument("--prompt-words", type=int, default=1000)
    ap.add_argument("--idle-s", type=float, default=3.0)
    ap.add_argument("--router-core", type=int, default=0)
    ap.add_argument("--fake-core", type=int, default=1)
    a = ap.parse_args()
    os.sched_setaffinity(0, {a.fake_core})
    many = measure(a, a.tokens)
    one = measure(a, 1)
    per_token = (many["cpu_ms_per_request"] - one["cpu_ms_per_request"]) / (a.tokens - 1)
    out = {"mode": a.mode, "many": many, "one": one, "cpu_ms_per_token": round(per_token, 4)}
    out["cpu_ms_fixed"] = round(one["cpu_ms_per_request"] - per_token, 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
