"""Push vs pull decode TPOT under load (issue 8), with D's per-step trace and thread CPU.

Both clusters (`pdserve up --kv-transfer push` and `... pull`) are up for the whole run (P on
core 0, D on core 1, router on P's core, bench client unpinned as a user would run it).
Instances run with `--log-level debug`, so every engine step writes a `pdserve.engine.steps`
record (pdserve/engine/steptrace.py) to the instance's log. Modes alternate in palindromic order
per round; a round's modes get the same arrival seed. Per run this saves the bench result and,
before/after, each thread's CPU seconds of P, D and the router (/proc/PID/task/*/stat; names
from `py-spy dump`) and time.monotonic() (the clock of the step records), so overlap.py can cut
the step trace per run.

usage: run.py OUTDIR [--rounds 3] [--input-len 1024] [--rate 4] [--num-prompts 32]
       [--modes push pull push-whole]
       (run under flock /work/notes/bench.lock)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from procstat import run_delay_s, thread_cpu, thread_names

from pdserve.ports import free_port

REPO = Path(__file__).resolve().parents[3]
PY = str(REPO / ".venv/bin/python")
# variant name -> (transfer mode, extra instance flags); "push-whole" is push without
# layer-wise streaming (P writes the whole prompt once it is computed)
VARIANTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "push": ("push", ()),
    "pull": ("pull", ()),
    "push-whole": ("push", ("--no-push-layerwise",)),
    "push-rx0": ("push", ()),  # then D's transport threads are moved to P's core 0
}


def move_transport_threads(names: dict[str, str], core: int) -> list[str]:
    """Pin D's tcp transport threads (by Python name, tid -> name) to `core`: does the
    receive's cost on D come from sharing D's core, or from the GIL it still shares?"""
    moved = [tid for tid, name in names.items() if name.startswith("tcp")]
    for tid in moved:
        os.sched_setaffinity(int(tid), {core})
    return moved


def start(mode: str, out: Path, model: str, dtype: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    kv_transfer, extra = VARIANTS[mode]
    log = open(out / f"up-{mode}.log", "w")  # noqa: SIM115 - lives as long as the cluster
    cmd = [PY, "-m", "pdserve", "up", "--kv-transfer", kv_transfer, "--model", model]
    cmd += ["--port", str(port), "--log-dir", str(out / f"logs-{mode}")]
    cmd += ["--", "--dtype", dtype, "--kv-cache-memory", "1", "--log-level", "debug", *extra]
    popen = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    return popen, f"http://127.0.0.1:{port}"


def wait_ready(mode: str, out: Path, popen: subprocess.Popen) -> dict[str, int]:
    text = ""
    for _ in range(300):
        text = (out / f"up-{mode}.log").read_text()
        if "Ctrl-C stops" in text or popen.poll() is not None:
            break
        time.sleep(1)
    found = dict(re.findall(r"^\s+(prefill|decode|router)\s+http://\S+\s+pid (\d+)", text, re.M))
    if len(found) != 3:
        sys.exit(f"cluster {mode} did not start; see {out}/up-{mode}.log")
    return {role: int(pid) for role, pid in found.items()}


def snapshot(pids: dict[str, int], idle: dict[str, int]) -> dict:
    """Thread CPU of the measured cluster's processes, process CPU of the idle cluster's."""
    return {
        "t": time.monotonic(),
        "wall": time.time(),
        "load": Path("/proc/loadavg").read_text().split()[:3],
        "cpu": {role: thread_cpu(pid) for role, pid in pids.items()},
        "runq": {role: run_delay_s(pid) for role, pid in pids.items()},
        "idle_cpu": {role: sum(thread_cpu(pid).values()) for role, pid in idle.items()},
    }


def bench(
    url: str, a: argparse.Namespace, seed: int, save: Path | None, log: Path
) -> tuple[int, float]:
    """Run `pdserve bench serve` (unpinned); returns its exit status and CPU seconds."""
    cmd = [PY, "-m", "pdserve", "bench", "serve", "--base-url", url, "--disable-tqdm"]
    cmd += ["--input-len", str(a.input_len), "--output-len", "64", "--ignore-eos"]
    cmd += ["--num-prompts", str(a.num_prompts if save else 4), "--request-rate", str(a.rate)]
    cmd += ["--seed", str(seed), "--num-warmups", "2"]
    if save is not None:
        cmd += ["--save-result", str(save)]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        return proc.returncode, usage.ru_utime + usage.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--rate", type=float, default=4.0)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--model", default="results/ckpt-qwen3-4l256")
    ap.add_argument("--dtype", default="float32", help="every instance's --dtype")
    ap.add_argument("--modes", nargs="+", choices=sorted(VARIANTS), default=["push", "pull"])
    a = ap.parse_args()
    modes = tuple(a.modes)
    a.out.mkdir(parents=True, exist_ok=True)
    print(f"start {time.strftime('%F %T')} load {Path('/proc/loadavg').read_text().strip()}")
    started = {m: start(m, a.out, a.model, a.dtype) for m in modes}
    clusters = {}
    try:
        for m, (popen, url) in started.items():
            clusters[m] = (popen, url, wait_ready(m, a.out, popen))
        names = {}
        for m, (_, url, pids) in clusters.items():
            # the transfer threads start with the first requests
            bench(url, a, seed=99, save=None, log=a.out / f"warm-{m}.txt")
            names[m] = {role: thread_names(pid) for role, pid in pids.items()}
            if m.endswith("-rx0"):
                print(f"{m}: moved D threads {move_transport_threads(names[m]['decode'], 0)}")
        pids = {m: c[2] for m, c in clusters.items()}
        (a.out / "threads.json").write_text(json.dumps({"pids": pids, "names": names}))
        rows = []
        for r in range(1, a.rounds + 1):
            order = modes if r % 2 else modes[::-1]
            for m in order:
                _, url, pids = clusters[m]
                idle = {  # every other cluster's processes
                    f"{k}:{role}": pid
                    for k, c in clusters.items()
                    if k != m
                    for role, pid in c[2].items()
                }
                tag = f"r{r}-{m}"
                s0 = snapshot(pids, idle)
                rc, client_cpu = bench(url, a, r, a.out / f"{tag}.json", a.out / f"{tag}.txt")
                s1 = snapshot(pids, idle)
                row = {"tag": tag, "mode": m, "rc": rc, "client_cpu": client_cpu}
                rows.append({**row, "before": s0, "after": s1})
                print(f"{time.strftime('%T')} {tag} rc={rc} load {s1['load'][0]}", flush=True)
                time.sleep(2)
        (a.out / "rows.json").write_text(json.dumps(rows))
    finally:
        for popen, _ in started.values():
            popen.send_signal(signal.SIGINT)
        for popen, _ in started.values():
            try:
                popen.wait(30)
            except subprocess.TimeoutExpired:
                popen.terminate()
                popen.wait()
    print(f"end {time.strftime('%F %T')} load {Path('/proc/loadavg').read_text().strip()}")


if __name__ == "__main__":
    main()
