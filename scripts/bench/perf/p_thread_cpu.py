"""P's CPU per request by thread (precise: schedstat's run time), push vs pull vs push-whole.

Starts one `pdserve up` cluster per variant (P on core 0, D on core 1, router on core 0),
measures every thread's CPU while the cluster is idle (`--idle-s`) and during a bench run of
`--num-prompts` requests at `--rate` (after two warm-ups), and prints per-request CPU by
thread name of P, D's total, the router's, and the run's TTFT/handoff medians.

usage: p_thread_cpu.py OUTDIR [--variants push pull push-whole] [--rounds 2]
       [--input-len 1024] [--rate 1] [--num-prompts 24] [--model builtin:small] [-- ARGS]
       (run under flock /work/notes/bench.lock)
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from procstat import run_ns, thread_names

from pdserve.ports import free_port

REPO = Path(__file__).resolve().parents[3]
PY = str(REPO / ".venv/bin/python")
VARIANTS = {
    "push": ("push", ()),
    "pull": ("pull", ()),
    "push-whole": ("push", ("--no-push-layerwise",)),
}


def start(variant: str, out: Path, a: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    port = free_port()
    mode, extra = VARIANTS[variant]
    log = open(out / f"up-{variant}.log", "w")  # noqa: SIM115 - lives as long as the cluster
    cmd = [PY, "-m", "pdserve", "up", "--kv-transfer", mode, "--model", a.model]
    cmd += ["--port", str(port), "--log-dir", str(out / f"logs-{variant}")]
    cmd += ["--", "--kv-cache-memory", "1", *extra, *a.instance_args]
    popen = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    return popen, f"http://127.0.0.1:{port}"


def pids_of(log: Path, popen: subprocess.Popen) -> dict[str, int]:
    for _ in range(300):
        text = log.read_text()
        if "Ctrl-C stops" in text:
            found = re.findall(r"started (prefill-0|decode-0|router) \(pid (\d+)\)", text)
            return {name.split("-")[0]: int(pid) for name, pid in found}
        if popen.poll() is not None:
            raise RuntimeError(f"cluster exited:\n{text[-2000:]}")
        time.sleep(1)
    raise RuntimeError("cluster not up in 300 s")


def bench(url: str, a: argparse.Namespace, n: int, seed: int, save: Path | None) -> None:
    cmd = [PY, "-m", "pdserve", "bench", "serve", "--base-url", url, "--disable-tqdm"]
    cmd += ["--input-len", str(a.input_len), "--output-len", "64", "--num-prompts", str(n)]
    cmd += ["--request-rate", str(a.rate), "--seed", str(seed)]
    if save is not None:
        cmd += ["--save-result", str(save)]
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True)


def snapshot(pids: dict[str, int]) -> dict[str, dict[str, int]]:
    return {role: run_ns(pid) for role, pid in pids.items()}


def per_thread(before: dict, after: dict, names: dict[str, str]) -> Counter:
    agg: Counter = Counter()
    for tid, ns in after.items():
        name = re.sub(r"-[0-9a-f]{8}.*", "", names.get(tid, "other"))
        agg[name] += ns - before.get(tid, 0)
    return agg


def measure(variant: str, rnd: int, a: argparse.Namespace) -> dict:
    popen, url = start(variant, a.out, a)
    try:
        pids = pids_of(a.out / f"up-{variant}.log", popen)
        bench(url, a, 2, 99, None)  # warm-up
        names = {role: thread_names(pid) for role, pid in pids.items()}
        s0 = snapshot(pids)
        time.sleep(a.idle_s)
        s1 = snapshot(pids)
        result = a.out / f"r{rnd}-{variant}.json"
        bench(url, a, a.num_prompts, rnd, result)
        s2 = snapshot(pids)
    finally:
        popen.send_signal(signal.SIGTERM)
        popen.wait(timeout=60)
    res = json.loads(result.read_text())
    n = a.num_prompts
    idle_s = a.idle_s
    row = {"variant": variant, "round": rnd, "ttft": res["median_ttft_ms"]}
    row["handoff"] = res.get("median_handoff_ms")
    row["run_s"] = res.get("duration")
    for role in pids:
        idle = per_thread(s0[role], s1[role], names[role])
        busy = per_thread(s1[role], s2[role], names[role])
        dur = res.get("duration") or 0.0
        # per request: run CPU minus what the idle cluster would have used in that time
        row[role] = {k: round((busy[k] - idle.get(k, 0) * dur / idle_s) / n / 1e6, 2) for k in busy}
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--rate", type=float, default=1.0)
    p.add_argument("--num-prompts", type=int, default=24)
    p.add_argument("--idle-s", type=float, default=10.0)
    p.add_argument("--model", default="builtin:small")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    a = p.parse_args(argv[:cut])
    a.instance_args = argv[cut + 1 :]
    a.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for rnd in range(1, a.rounds + 1):
        order = a.variants if rnd % 2 else a.variants[::-1]
        for v in order:
            row = measure(v, rnd, a)
            rows.append(row)
            print(json.dumps(row), flush=True)
    (a.out / "rows.json").write_text(json.dumps(rows, indent=1))
    for role in ("prefill", "decode", "router"):
        print(f"\n{role}: CPU ms per request by thread (idle use subtracted)")
        for row in rows:
            top = sorted(row[role].items(), key=lambda kv: -kv[1])[:9]
            total = sum(row[role].values())
            cells = "  ".join(f"{k}={v}" for k, v in top)
            print(f"r{row['round']} {row['variant']:11s} total={total:.1f}  {cells}")
    for row in rows:
        print(
            f"r{row['round']} {row['variant']:11s} TTFT p50 {row['ttft']:.1f}  "
            f"handoff p50 {row['handoff']}"
        )


if __name__ == "__main__":
    main()
