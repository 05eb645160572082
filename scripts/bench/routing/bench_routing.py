"""Routing benchmarks (issue 10): run under `flock /work/notes/bench.lock`.

  routing:   1P2D (decode-1 slowed: started by tests/fault_serve.py with a step delay, the
             test-only entry point that injects faults), a push cluster and a pull
             cluster both up, one router per policy in front of them; `pdserve bench serve`
             replays the same mixed-length workload against each router, in rotating order.
  crossover: 1P1D push, two routers (--local-prefill-below 0 and 1000000) in front of the
             same P and D; fixed prompt lengths, same workload through both, alternating.

Processes bind 127.0.0.1 on free ports and are stopped by PID at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from pdserve.ports import free_port
from pdserve.transfer.cluster_auth import TOKEN_ENV, route_headers

PY = sys.executable
ROOT = Path(__file__).resolve().parents[3]
FAULT_SERVE = ROOT / "tests" / "fault_serve.py"  # `pdserve serve` with faults injected
# Results go to the repo's results/routing/ (git-ignored), not next to this script.
OUT = ROOT / "results" / "routing"
PROCS: list[subprocess.Popen] = []


def spawn(name: str, args: list[str], cores: str | None, faults: str | None = None) -> str:
    """Start `pdserve ARGS...`; `faults` (JSON of pdserve.faults.Faults): a `serve` with
    those faults injected, through tests/fault_serve.py."""
    port = free_port()
    cmd = [PY, "-m", "pdserve", *args, "--host", "127.0.0.1", "--port", str(port)]
    if faults is not None:
        cmd = [PY, str(FAULT_SERVE), "--faults", faults, *cmd[4:]]
    if cores is not None:
        cmd = ["taskset", "-c", cores, *cmd]
    log = open(OUT / f"log-{name}.txt", "w")  # noqa: SIM115
    log.write(" ".join(cmd) + "\n")
    log.flush()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    PROCS.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env))
    return f"http://127.0.0.1:{port}"


def wait_healthy(urls: list[str], timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    for u in urls:
        while True:
            try:
                if httpx.get(f"{u}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"{u} not healthy")
            time.sleep(0.5)


def stop_all() -> None:
    for p in reversed(PROCS):
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in PROCS:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()


def instance(role: str, mode: str, model: str, cores: str, extra: list[str]) -> list[str]:
    return [
        "serve", "--role", role, "--kv-transfer", mode, "--transport", "tcp",
        "--model", model, "--threads", "1", *extra,
    ]  # fmt: skip


def bench(url: str, label: str, args: list[str], out: Path) -> dict:
    cmd = [
        PY, "-m", "pdserve", "bench", "serve", "--base-url", url, "--label", label,
        "--save-result", str(out), "--disable-tqdm", *args,
    ]  # fmt: skip
    load = os.getloadavg()[0]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    result = json.loads(out.read_text())
    result["loadavg_before"] = load
    out.write_text(json.dumps(result))
    return result


def routing(a: argparse.Namespace) -> None:
    extra = ["--num-kv-blocks", "4096"]
    slow = json.dumps({"step_delay_s": a.delay_ms / 1000})
    clusters = {}
    for mode in ("push", "pull"):
        p = spawn(f"{mode}-p", instance("prefill", mode, a.model, "0", extra), "0")
        d0 = spawn(f"{mode}-d0", instance("decode", mode, a.model, "1", extra), "1")
        d1 = spawn(f"{mode}-d1-slow", instance("decode", mode, a.model, "1", extra), "1", slow)
        clusters[mode] = (p, d0, d1)
    wait_healthy([u for c in clusters.values() for u in c])
    routers = {}
    for mode, policy in a.configs:
        p, d0, d1 = clusters[mode]
        args = ["router", "--prefill", p, "--decode", d0, d1, "--kv-transfer", mode]
        routers[f"{mode}-{policy}"] = spawn(
            f"router-{mode}-{policy}", [*args, "--policy", policy], None
        )
    wait_healthy(list(routers.values()))
    time.sleep(2)
    work = [
        "--input-len", str(a.input_len), "--range-ratio", str(a.range_ratio),
        "--output-len", str(a.output_len), "--num-prompts", str(a.num_prompts),
        "--request-rate", str(a.rate), "--seed", "0", "--num-warmups", "2",
    ]  # fmt: skip
    names = list(routers)
    for rnd in range(a.rounds):
        order = names[rnd % len(names) :] + names[: rnd % len(names)]
        for name in order:
            r = bench(routers[name], name, work, OUT / f"routing-{name}-r{rnd}.json")
            proof = route_headers(os.environ.get(TOKEN_ENV), "/router/instances")
            insts = httpx.get(f"{routers[name]}/router/instances", headers=proof, timeout=10).json()
            (OUT / f"instances-{name}-r{rnd}.json").write_text(json.dumps(insts))
            print(
                f"round {rnd} {name}: ttft p50 {r['median_ttft_ms']:.0f} p99 "
                f"{r['p99_ttft_ms']:.0f} tpot p50 {r['median_tpot_ms']:.1f} p99 "
                f"{r['p99_tpot_ms']:.1f} load {r['loadavg_before']:.1f}",
                flush=True,
            )


def crossover(a: argparse.Namespace) -> None:
    extra = ["--num-kv-blocks", "4096"]
    p = spawn("x-p", instance("prefill", "push", a.model, "0", extra), "0")
    d = spawn("x-d", instance("decode", "push", a.model, "1", extra), "1")
    wait_healthy([p, d])
    routers = {}
    for name, below in (("disagg", 0), ("local", 1_000_000)):
        args = ["router", "--prefill", p, "--decode", d, "--kv-transfer", "push"]
        routers[name] = spawn(
            f"x-router-{name}", [*args, "--local-prefill-below", str(below)], None
        )
    wait_healthy(list(routers.values()))
    time.sleep(2)
    for i, length in enumerate(a.lengths):
        work = [
            "--input-len", str(length), "--output-len", str(a.output_len),
            "--num-prompts", str(min(a.num_prompts, a.crossover_prompts)),
            "--request-rate", str(a.rate), "--seed", str(length), "--num-warmups", "2",
        ]  # fmt: skip
        for name in ("disagg", "local") if i % 2 == 0 else ("local", "disagg"):
            r = bench(routers[name], name, work, OUT / f"crossover-{length}-{name}.json")
            print(
                f"{length} {name}: ttft p50 {r['median_ttft_ms']:.1f} p99 "
                f"{r['p99_ttft_ms']:.1f} tpot p50 {r['median_tpot_ms']:.1f} p99 "
                f"{r['p99_tpot_ms']:.1f} load {r['loadavg_before']:.1f}",
                flush=True,
            )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=("routing", "crossover"))
    ap.add_argument("--model", default="builtin:small")
    ap.add_argument("--delay-ms", type=float, default=40.0)
    ap.add_argument("--input-len", type=int, default=768)
    ap.add_argument("--range-ratio", type=float, default=0.9)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--num-prompts", type=int, default=60)
    ap.add_argument("--rate", type=float, default=2.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--lengths", type=int, nargs="+", default=[32, 64, 128, 256, 512, 1024])
    ap.add_argument("--crossover-prompts", type=int, default=16)
    ap.add_argument(
        "--configs",
        nargs="+",
        default=["push:round_robin", "push:load_aware", "push:least_tokens", "pull:least_loaded"],
    )
    ap.add_argument("--routing-num-prompts", type=int, default=30)
    ap.add_argument("--routing-rate", type=float, default=1.0)
    ap.add_argument("--crossover-only", action="store_true", help="skip the routing half")
    a = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    # `timeout` sends SIGTERM: exit through `finally` so every child is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    a.configs = [tuple(c.split(":")) for c in a.configs]
    try:
        if a.what == "routing":
            routing(a)
        else:
            # One locked run for both (the lock queue is long): the crossover with the
            # given args, then the routing comparison with its own (--routing-*) args.
            crossover(a)
            if a.crossover_only:
                return
            stop_all()
            PROCS.clear()
            a.num_prompts, a.rate, a.input_len = a.routing_num_prompts, a.routing_rate, 512
            routing(a)
    finally:
        stop_all()


if __name__ == "__main__":
    main()
