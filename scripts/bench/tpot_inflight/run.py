"""Decode TPOT with KV transfers in flight vs with none (issue 8), push and pull, 1P1D.

Foreground: a fixed decode batch on D (`--max-concurrency` streams of short prompts, long
`--output-len`, ignore_eos). Background (B windows): long prompts with max_tokens=1 through
the same router, so KV lands in D continuously while D only emits P's first token and finishes.
C windows (`--control`): the same background prompts sent straight to P as plain requests, so
P prefills as in B but nothing is transferred: B against C is the transfers' own effect on
D, C against A the effect of P's prefills on the other core (shared cache and memory).
Windows go A, B(, C) in odd rounds and the reverse in even rounds, on one cluster per mode.
Per window this records the bench result, D's `pdserve_kv_received_total` before/after,
D's CPU seconds (/proc/PID/stat) and the load average. One extra unmeasured B window per mode
runs `py-spy record` on D if py-spy exists.

usage: run.py OUTDIR [--modes push pull push-whole] [--rounds 2] [--control]
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
from dataclasses import dataclass, replace
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from procstat import cpu_s, run_delay_s

from pdserve.ports import free_port

REPO = Path(__file__).resolve().parents[3]
PY = str(REPO / ".venv/bin/python")
PYSPY = REPO / ".venv/bin/py-spy"


@dataclass(frozen=True)
class Workload:
    """Foreground and background shapes (tokens, requests, req/s)."""

    fg_in: int = 64
    fg_out: int = 256
    fg_conc: int = 8
    fg_num: int = 16
    bg_in: int = 3072
    bg_rate: float = 0.4
    bg_lead_s: float = 4.0  # background runs this long before the foreground starts
    settle_s: float = 4.0
    isolate: bool = False  # router and bench clients on core 0 (P's), D alone on core 1


@dataclass(frozen=True)
class Cluster:
    """A running `pdserve up` (we own the process and stop it by PID)."""

    popen: subprocess.Popen
    url: str
    decode_url: str
    prefill_url: str
    pids: dict[str, int]  # role -> PID: prefill, decode, router


def start_cluster(
    mode: str,
    out: Path,
    isolate: bool,
    cwd: Path = REPO,
    tag: str | None = None,
    instance_args: tuple[str, ...] = (),
) -> Cluster:
    """Start `pdserve up`; retried because another user may take the free port before it binds.
    `cwd` holds the `pdserve/` tree to run (a copy for code A/Bs); `tag` names its logs;
    `instance_args` go to every instance."""
    tag = tag or mode
    for attempt in range(3):
        c = try_start(mode, out, isolate, cwd, tag, instance_args)
        if c is not None:
            return c
        print(f"cluster {tag} failed (attempt {attempt + 1}); retrying", flush=True)
    sys.exit(f"cluster {tag} failed 3 times; see {out}/up-{tag}.log")


# mode -> (transfer mode, instance flags): push-whole is push without layer-wise streaming
VARIANTS: dict[str, tuple[str, list[str]]] = {
    "push": ("push", []),
    "pull": ("pull", []),
    "push-whole": ("push", ["--no-push-layerwise"]),
}


def try_start(
    mode: str, out: Path, isolate: bool, cwd: Path, tag: str, instance_args: tuple[str, ...]
) -> Cluster | None:
    port = free_port()
    log = open(out / f"up-{tag}.log", "w")  # noqa: SIM115 - lives as long as the cluster
    transfer, flags = VARIANTS[mode]
    cmd = [PY, "-m", "pdserve", "up", "--kv-transfer", transfer, "--model", "builtin:small"]
    cmd += ["--port", str(port), "--log-dir", str(out / f"logs-{tag}")]
    cmd += ["--", "--num-kv-blocks", "4096", *flags, *instance_args]
    popen = subprocess.Popen(cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT)
    text = ""
    for _ in range(300):
        text = (out / f"up-{tag}.log").read_text()
        if "Ctrl-C stops" in text or popen.poll() is not None:
            break
        time.sleep(1)
    found = dict(re.findall(r"^\s+(prefill|decode|router)\s+http://\S+\s+pid (\d+)", text, re.M))
    m = re.search(r"decode\s+(http://\S+)\s+pid", text)
    mp = re.search(r"prefill\s+(http://\S+)\s+pid", text)
    if m is None or mp is None or len(found) != 3:
        popen.send_signal(signal.SIGTERM)
        popen.wait()
        return None
    pids = {role: int(pid) for role, pid in found.items()}
    if isolate:  # everything but D shares P's core, so core 1 runs D (and other users) only
        for tid in os.listdir(f"/proc/{pids['router']}/task"):
            os.sched_setaffinity(int(tid), {0})
    return Cluster(popen, f"http://127.0.0.1:{port}", m.group(1), mp.group(1), pids)


def kv_received(url: str) -> float:
    body = httpx.get(f"{url}/metrics", timeout=10).text
    m = re.search(r"^pdserve_kv_received_total\S*\s+(\S+)", body, re.M)
    return float(m.group(1)) if m else float("nan")


def probe(c: Cluster) -> dict[str, float]:
    snap = {f"cpu_{role}": cpu_s(pid) for role, pid in c.pids.items()}
    snap["rq_decode"] = run_delay_s(c.pids["decode"])
    snap["kv_received"] = kv_received(c.decode_url)
    snap["t"] = time.monotonic()
    return snap


def bench(url: str, args: list[str], save: Path | None, log: Path, core0: bool) -> subprocess.Popen:
    cmd = ["taskset", "-c", "0"] if core0 else []
    cmd += [PY, "-m", "pdserve", "bench", "serve", "--base-url", url, "--disable-tqdm"]
    cmd += ["--num-warmups", "0", "--seed", "0", *args]
    if save is not None:
        cmd += ["--save-result", str(save)]
    return subprocess.Popen(cmd, cwd=REPO, stdout=open(log, "w"), stderr=subprocess.STDOUT)


def fg_args(w: Workload) -> list[str]:
    return [
        "--input-len", str(w.fg_in), "--output-len", str(w.fg_out), "--ignore-eos",
        "--num-prompts", str(w.fg_num), "--max-concurrency", str(w.fg_conc),
        "--request-rate", "inf",
    ]  # fmt: skip


def bg_args(w: Workload, seed: int) -> list[str]:
    return [
        "--input-len", str(w.bg_in), "--output-len", "1", "--num-prompts", "40",
        "--request-rate", str(w.bg_rate), "--seed", str(seed), "--token-offset", "100",
    ]  # fmt: skip


def stop(p: subprocess.Popen) -> None:
    if p.poll() is None:
        p.send_signal(signal.SIGINT)
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def window(c: Cluster, w: Workload, out: Path, tag: str, kind: str, spy: bool) -> dict:
    """One measured foreground run; `kind` A: no background, B: through the router (KV
    transfers), C: straight to P (prefills, no transfers)."""
    bg = None
    if kind != "A":
        # seeded by the round ("1" of "B1"), not the mode or kind: all get the same arrivals
        seed = sum(map(ord, "B" + tag.rsplit("-", 1)[1][1:]))
        url = c.url if kind == "B" else c.prefill_url
        bg = bench(url, bg_args(w, seed=seed), None, out / f"bg-{tag}.log", w.isolate)
        time.sleep(w.bg_lead_s)
    spy_p = None
    if spy and PYSPY.exists():
        svg = out / f"pyspy-{tag}.txt"
        spy_cmd = [str(PYSPY), "record", "-p", str(c.pids["decode"]), "-d", "20", "-r", "50"]
        spy_cmd += ["--format", "raw", "-o", str(svg)]
        spy_p = subprocess.Popen(spy_cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    s0 = probe(c)
    load0 = Path("/proc/loadavg").read_text().split()[:3]
    fg = bench(c.url, fg_args(w), out / f"fg-{tag}.json", out / f"fg-{tag}.log", w.isolate)
    fg.wait()
    s1 = probe(c)
    load1 = Path("/proc/loadavg").read_text().split()[:3]
    if spy_p is not None:
        spy_p.wait()
    if bg is not None:
        stop(bg)
    time.sleep(w.settle_s)
    res = json.loads((out / f"fg-{tag}.json").read_text()) if fg.returncode == 0 else {}
    row = {
        "tag": tag,
        "background": kind != "A",
        "window": kind,
        "fg_rc": fg.returncode,
        "completed": res.get("completed"),
        "tpot_p50": res.get("median_tpot_ms"),
        "tpot_p99": res.get("p99_tpot_ms"),
        "itl_p50": res.get("median_itl_ms"),
        "itl_p99": res.get("p99_itl_ms"),
        "ttft_p50": res.get("median_ttft_ms"),
        "fg_duration_s": res.get("duration"),
        **{k: round(s1[k] - s0[k], 3) for k in s0},
        "load_before": load0,
        "load_after": load1,
    }
    print(json.dumps(row), flush=True)
    return row


def run_mode(
    mode: str, rounds: int, w: Workload, out: Path, spy: bool, kinds: str = "AB"
) -> list[dict]:
    c = start_cluster(mode, out, w.isolate)
    rows = []
    try:
        print(f"== {mode} up {time.strftime('%T')} pids {c.pids}", flush=True)
        warm = replace(w, fg_num=w.fg_conc)
        bench(c.url, fg_args(warm), None, out / f"warm-{mode}.log", w.isolate).wait()
        for r in range(1, rounds + 1):
            for kind in kinds if r % 2 else kinds[::-1]:
                tag = f"{mode}-{kind}{r}"
                rows.append({"mode": mode, **window(c, w, out, tag, kind, spy=False)})
        if spy and PYSPY.exists():
            window(c, w, out, f"{mode}-Bspy", "B", spy=True)
    finally:
        c.popen.send_signal(signal.SIGINT)
        try:
            c.popen.wait(30)
        except subprocess.TimeoutExpired:
            c.popen.terminate()
            c.popen.wait()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--modes", nargs="+", default=["push", "pull"], choices=sorted(VARIANTS))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--bg-rate", type=float, default=0.4)
    ap.add_argument("--bg-in", type=int, default=3072)
    ap.add_argument("--fg-out", type=int, default=256)
    ap.add_argument("--isolate", action="store_true")
    ap.add_argument("--no-spy", action="store_true")
    ap.add_argument("--control", action="store_true", help="add C windows (see above)")
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    w = Workload(bg_rate=a.bg_rate, bg_in=a.bg_in, fg_out=a.fg_out, isolate=a.isolate)
    print(f"start {time.strftime('%F %T')} load {Path('/proc/loadavg').read_text().strip()}")
    kinds = "ABC" if a.control else "AB"
    rows = [
        row for mode in a.modes for row in run_mode(mode, a.rounds, w, a.out, not a.no_spy, kinds)
    ]
    (a.out / "rows.json").write_text(json.dumps(rows, indent=1))
    print(f"end {time.strftime('%F %T')} load {Path('/proc/loadavg').read_text().strip()}")


if __name__ == "__main__":
    main()
