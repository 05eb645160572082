"""vLLM engine, four KV connectors, one router and one bench client: pdserve's connector (push,
pull) against vLLM's own (NixlConnector; NixlPushConnector as shipped and with NIXL's
progress thread off or delayed), nothing else changed.

Every cluster is `pdserve up --engine vllm --connector C --kv-transfer M` on the same random
Qwen3 checkpoint: 1 prefill + 1 decode instance, one core each (pdserve up's pinning), the
router on P's core, the client (`pdserve bench serve`) unpinned. One cluster is up at a
time (vLLM's busy NIXL progress thread would slow whatever runs beside it); clusters run in
palindromic order per round with the same arrival seed.

Per cluster: start, wait for the router, one warm-up request (vLLM's first NIXL handshake
can take ~30 s), then each instance's idle CPU (its process tree's CPU seconds over
`--idle-s` with no request), then every point, then stop.

Points (`--points`, LEN:RATE): RATE is req/s, `c1` (one at a time: one request in flight),
or `heavy`: the heaviest rate P sustains, taken as 0.8 / (P's one-at-a-time TTFT p50) of the
first cluster at that length in this run (so LEN:c1 must come before LEN:heavy; every
cluster then gets the same rate).

Clusters (`--clusters`):
  pdserve-push, pdserve-pull      PdserveConnector (--transport, default tcp)
  nixl-pull                       vLLM's NixlConnector as shipped
  nixl-push                       vLLM's NixlPushConnector as shipped (busy progress thread)
  nixl-push-noprog, nixl-pull-noprog   NIXL's progress thread off
  nixl-push-delay, nixl-pull-delay     the progress thread sleeping $PDSERVE_NIXL_PTHR_DELAY_US
                                       (default 100) us between polls
  (the last two kinds through scripts/bench/perf/vllm_noprog/sitecustomize.py on vLLM's path)

usage: vllm_engine_ab.py OUTDIR [--vllm-python PY] [--model CKPT] [--points 1024:c1 1024:1
       1024:heavy 4096:c1 4096:1 4096:heavy] [--rounds 2] [--num-prompts 24] [--clusters ...]
       (under flock /work/notes/bench.lock; the machine is shared)
       vllm_engine_ab.py OUTDIR --summary
Results: OUTDIR/r<round>__<LEN-RATE>__<cluster>.json (pdserve bench serve's result JSON),
OUTDIR/r<round>__idle__<cluster>.json, OUTDIR/logs/.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from pdserve.ports import free_port

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
NOPROG = HERE / "perf" / "vllm_noprog"
CLUSTERS = (
    "pdserve-push",
    "pdserve-pull",
    "nixl-pull",
    "nixl-push",
    "nixl-push-noprog",
    "nixl-push-delay",
    "nixl-pull-noprog",
    "nixl-pull-delay",
)
DEFAULT_CLUSTERS = CLUSTERS[:6]
DEFAULT_POINTS = ("1024:c1", "1024:1", "1024:heavy", "4096:c1", "4096:1", "4096:heavy")
PTHR_DELAY_US = "100"
HEAVY_FRACTION = 0.8  # of P's one-at-a-time throughput
ROW = re.compile(r"^\s+(prefill|decode|router)\s+(\S+)\s+pid (\d+)")


class Up:
    """One `pdserve up --engine vllm` cluster, started and stopped by its PID."""

    def __init__(self, name: str, a: argparse.Namespace, logs: Path) -> None:
        connector, mode = name.split("-")[:2]
        self.name, self.port = name, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.stdout = logs / f"{name}.up.log"
        cmd = [sys.executable, "-m", "pdserve", "up", "--engine", "vllm", "--kv-transfer", mode]
        cmd += ["--connector", "pdserve" if connector == "pdserve" else "nixl"]
        cmd += ["--transport", a.transport, "--model", str(a.model), "--port", str(self.port)]
        cmd += ["--log-dir", str(logs / name), "--startup-timeout", str(a.startup_timeout)]
        cmd += ["--max-restarts", "0"]  # a crash is a result, not something to hide
        if a.vllm_python:
            cmd += ["--vllm-python", a.vllm_python]
        cmd += ["--", "--max-model-len", str(a.max_model_len), "--dtype", a.dtype]
        cmd += ["--kv-cache-memory", "1"]
        env = dict(os.environ)
        if name.endswith(("-noprog", "-delay")):  # vLLM keeps this after pdserve's own path
            env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(NOPROG), env.get("PYTHONPATH"))))
        if name.endswith("-delay"):
            env.setdefault("PDSERVE_NIXL_PTHR_DELAY_US", PTHR_DELAY_US)
        (logs / name).mkdir(mode=0o700, exist_ok=True)
        with open(self.stdout, "w") as out:
            self.proc = subprocess.Popen(
                cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT
            )

    def wait_ready(self, timeout_s: float) -> dict[str, int]:
        """The PIDs of the instances once `pdserve up` printed its table."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                sys.exit(f"{self.name}: pdserve up exited; see {self.stdout}")
            text = self.stdout.read_text(errors="replace")
            if "pdserve up: ready" in text:
                return {m[1]: int(m[3]) for line in text.splitlines() if (m := ROW.match(line))}
            time.sleep(2)
        sys.exit(f"{self.name}: not ready after {timeout_s} s; see {self.stdout}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def warm_up(url: str, model: str, timeout_s: float = 600) -> None:
    """One P/D request must complete (a push stream that failed still answers 200)."""
    body = {"model": model, "prompt": list(range(3, 67)), "max_tokens": 4, "temperature": 0}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
            if r.status_code == 200 and '"choices"' in r.text and '"error"' not in r.text:
                return
        except httpx.HTTPError:
            pass
        time.sleep(3)
    sys.exit(f"warm-up at {url} did not complete in {timeout_s} s")


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of `pid` and all its descendants."""
    ticks = os.sysconf("SC_CLK_TCK")
    children: dict[int, list[int]] = {}
    stats: dict[int, list[str]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            stats[int(entry.name)] = fields
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        if p in stats:
            total += (int(stats[p][11]) + int(stats[p][12])) / ticks
        todo += children.get(p, [])
    return total


def idle_cpu(pids: dict[str, int], seconds: float) -> dict[str, float]:
    """Each instance's share of a core while no request runs."""
    before = {role: tree_cpu_s(pid) for role, pid in pids.items()}
    time.sleep(seconds)
    return {role: (tree_cpu_s(pid) - before[role]) / seconds for role, pid in pids.items()}


def bench(url: str, length: str, rate: str, a: argparse.Namespace, seed: int, save: Path) -> int:
    cmd = [sys.executable, "-m", "pdserve", "bench", "serve", "--base-url", url]
    cmd += ["--input-len", length, "--output-len", str(a.output_len), "--ignore-eos"]
    cmd += ["--seed", str(seed), "--num-prompts", str(a.num_prompts), "--num-warmups", "2"]
    cmd += ["--disable-tqdm", "--save-result", str(save)]
    if rate == "c1":
        cmd += ["--request-rate", "inf", "--max-concurrency", "1"]
    else:
        cmd += ["--request-rate", rate]
    with open(save.with_suffix(".txt"), "w") as log:
        return subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT).returncode


def resolve(point: str, out: Path, r: int, first: str) -> tuple[str, str]:
    """LEN and RATE of a point; `heavy` from the first cluster's c1 TTFT in this round."""
    length, rate = point.split(":")
    if rate != "heavy":
        return length, rate
    c1 = out / f"r{r}__{length}-c1__{first}.json"
    if not c1.exists():
        sys.exit(f"{point}: needs {length}:c1 measured first on {first} ({c1})")
    ttft_s = json.loads(c1.read_text())["median_ttft_ms"] / 1000
    return length, f"{HEAVY_FRACTION / ttft_s:.2f}"


def run_cluster(name: str, a: argparse.Namespace, r: int, first: str) -> None:
    logs = a.out / "logs" / f"r{r}"
    logs.mkdir(parents=True, exist_ok=True)
    up = Up(name, a, logs)
    try:
        t0 = time.monotonic()
        pids = {k: v for k, v in up.wait_ready(a.startup_timeout).items() if k != "router"}
        warm_up(up.url, str(a.model))
        print(f"{time.strftime('%T')} r{r} {name} ready in {time.monotonic() - t0:.0f} s")
        idle = idle_cpu(pids, a.idle_s)
        (a.out / f"r{r}__idle__{name}.json").write_text(json.dumps(idle))
        for point in a.points:
            length, rate = resolve(point, a.out, r, first)
            save = a.out / f"r{r}__{length}-{point.split(':')[1]}__{name}.json"
            rc = bench(up.url, length, rate, a, seed=r, save=save)
            print(f"{time.strftime('%T')} r{r} {point} ({rate}/s) {name} rc={rc}", flush=True)
    finally:
        up.stop()


def summary(out: Path) -> None:
    """Medians over rounds, per point and cluster; each instance's idle CPU."""
    rows: dict[tuple[str, str], list[dict]] = {}
    for f in sorted(out.glob("r*__*__*.json")):
        _, point, name = f.stem.split("__")
        if point != "idle":
            rows.setdefault((point, name), []).append(json.loads(f.read_text()))
    keys = ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms")
    keys += ("median_handoff_ms", "p99_handoff_ms")
    head = ["point", "cluster", "rounds", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99"]
    head += ["handoff p50", "handoff p99", "failed", "req/s"]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for (point, name), res in sorted(rows.items()):
        cells = [_median([x.get(k) for x in res]) for k in keys]
        failed = sum(x.get("failed", 0) for x in res)
        tput = _median([x.get("request_throughput") for x in res])
        print(f"| {point} | {name} | {len(res)} | {' | '.join(cells)} | {failed} | {tput} |")
    print("\n| cluster | round | P idle CPU (cores) | D idle CPU (cores) |\n|---|---|---|---|")
    for f in sorted(out.glob("r*__idle__*.json")):
        rnd, _, name = f.stem.split("__")
        idle = json.loads(f.read_text())
        print(f"| {name} | {rnd} | {idle.get('prefill', 0):.2f} | {idle.get('decode', 0):.2f} |")


def _median(values: list[float | None]) -> str:
    present = [v for v in values if v is not None]
    return f"{statistics.median(present):.1f}" if present else "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--vllm-python", help="default: pdserve serve's (.venv-vllm)")
    ap.add_argument("--model", type=Path, default=REPO / "results/ckpt-qwen3-4l256")
    ap.add_argument("--points", nargs="+", default=list(DEFAULT_POINTS), help="LEN:RATE")
    ap.add_argument("--clusters", nargs="+", default=list(DEFAULT_CLUSTERS), choices=CLUSTERS)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--num-prompts", type=int, default=24)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--transport", choices=("tcp", "nixl"), default="tcp", help="pdserve's")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-model-len", type=int, default=9000)
    ap.add_argument("--idle-s", type=float, default=10.0, help="idle CPU measured this long")
    ap.add_argument("--startup-timeout", type=float, default=900.0)
    ap.add_argument("--summary", action="store_true", help="only print OUTDIR's tables")
    a = ap.parse_args()
    if a.summary:
        summary(a.out)
        return
    a.out = a.out.resolve()
    a.out.mkdir(parents=True, exist_ok=True)
    if not a.model.exists():
        make = [sys.executable, "-m", "pdserve", "bench", "make-checkpoint", "--out", str(a.model)]
        subprocess.run(make, cwd=REPO, check=True)
    for r in range(1, a.rounds + 1):
        order = a.clusters if r % 2 else a.clusters[::-1]
        for name in order:
            run_cluster(name, a, r, first=order[0])
    summary(a.out)


if __name__ == "__main__":
    main()
