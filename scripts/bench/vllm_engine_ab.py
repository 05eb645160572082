"""vLLM engine, four KV connectors, one router and one bench client: pdserve's connector (push,
pull) against vLLM's own (NixlConnector; NixlPushConnector as shipped and with NIXL's
progress thread off or delayed), nothing else changed.

Every cluster is `pdserve up --engine vllm --connector C --kv-transfer M` on the same random
Qwen3 checkpoint: 1 prefill + 1 decode instance, one core each (pdserve up's pinning), the
router on P's core, the client (`pdserve bench serve`) unpinned. One cluster is up at a
time (vLLM's busy NIXL progress thread would slow whatever runs beside it); clusters run in
palindromic order per round with the same arrival seed.

Per cluster: the load average (`uptime`'s), start, wait for the router, one warm-up request
(vLLM's first NIXL handshake can take ~30 s), then each instance's idle CPU (its process
tree's CPU seconds over `--idle-s` with no request, in cores), then every point, then the
load average again, then stop.

Saturation: a point may run at most `--point-timeout` seconds (the bench client is killed
after that) and every request `--request-timeout` (the client's own limit). A point that runs
out of time is recorded as saturated, with the router's request counts over the point
(`pdserve_router_requests_total` by status, scraped before and after: completed = 200,
failed = any other outcome, in flight when killed = neither); the cluster's later points
that load P at least as much (a request rate, not `c1`, no lower, prompts no shorter) are then
skipped as saturated too. Every point's JSON carries the same router counts under "driver".

Handoff: the bench client's, from the router's prefill-done time: vLLM's prefill instance
does not say when its prefill ended, so the router takes the time P's answer reached it;
the handoff is then the first token's arrival at the client minus that time, the same
definition for every connector.

Points (`--points`, LEN:RATE): RATE is req/s, `c1` (one at a time: one request in flight),
or `heavy`: the heaviest rate P sustains, taken as 0.8 / (TTFT p50 at LEN:c1) of the round's
first cluster (so LEN:c1 must come before LEN:heavy; every cluster of the round then gets
the same rate; none when that cluster has no LEN:c1 TTFT: the point is skipped), or the
rate `--heavy-rate LEN=RATE` gives (to continue an earlier run with other clusters).

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
       [--point-timeout S] [--request-timeout S] [--num-warmups N] [--vllm-arg=ARG ...]
       [--heavy-rate LEN=RATE ...]
       vllm_engine_ab.py OUTDIR --summary
Run it from the repository root with PYTHONPATH=$PWD and the project's python (the client
and the router run under it; vLLM under --vllm-python). The machine should be otherwise
idle; the load averages in the output say how far it was.
Results: OUTDIR/r<round>__<LEN-RATE>__<cluster>.json (pdserve bench serve's result JSON
plus "driver": the router's counts and mean TTFT and handoff (its own view, from its
histograms), wall time, saturation; only "driver" and the counts
when the point ran out of time), OUTDIR/r<round>__cluster__<cluster>.json (idle CPU per
instance, load averages, seconds to ready), OUTDIR/logs/.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

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
HISTOGRAM_KEYS = {"handoff": "handoff", "time_to_first_token": "ttft"}
HISTOGRAMS = re.compile(
    r"^pdserve_router_(?P<name>handoff|time_to_first_token)_seconds_(?P<part>sum|count)"
    r" (?P<n>\S+)$",
    re.M,
)
STARTED = re.compile(r"^pdserve up: started \S+ \(pid (\d+)\): .* --port (\d+) ", re.M)
REQUESTS = re.compile(
    r'^pdserve_router_requests_total\{[^}]*status="(?P<status>[^"]+)"[^}]*\} (?P<n>\S+)$', re.M
)


class ClusterFailed(RuntimeError):
    """A cluster that did not start or serve its warm-up request (a result: recorded, and
    the run goes on with the next cluster)."""


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
        cmd += [f"--vllm-arg={arg}" for arg in a.vllm_arg]
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
        """The PIDs of the instances once `pdserve up` printed its whole table (its last
        line, the token's, is flushed after the rows)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ClusterFailed(f"{self.name}: pdserve up exited; see {self.stdout}")
            text = self.stdout.read_text(errors="replace")
            if "pdserve up: ready" in text and "cluster token in" in text:
                return {m[1]: int(m[3]) for line in text.splitlines() if (m := ROW.match(line))}
            time.sleep(2)
        raise ClusterFailed(f"{self.name}: not ready after {timeout_s} s; see {self.stdout}")

    def stop(self) -> None:
        """Ctrl-C to `pdserve up` (it stops its children); if it is not gone in 120 s, SIGKILL
        to it and to each child's process group (each is its own session leader)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            for pid, port in STARTED.findall(self.stdout.read_text(errors="replace")):
                kill_group_if_ours(int(pid), port)


def kill_group_if_ours(pid: int, port: str) -> None:
    """SIGKILL process group `pid` if its leader is still the instance started on `port`
    (a PID reused by someone else's process is left alone)."""
    try:
        args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return
    if b"--port" in args and args[args.index(b"--port") + 1 : args.index(b"--port") + 2] == [
        port.encode()
    ]:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)


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
    raise ClusterFailed(f"warm-up at {url} did not complete in {timeout_s} s")


def tree_threads_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) of `pid` and all its descendants, by "process/thread"
    name (the kernel's comm of each; threads of one name added up)."""
    ticks = os.sysconf("SC_CLK_TCK")
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    cpu: dict[str, float] = {}
    todo = [pid]
    while todo:
        p = todo.pop()
        todo += children.get(p, [])
        try:
            proc = (Path(f"/proc/{p}/comm")).read_text().strip()
            tasks = list(Path(f"/proc/{p}/task").iterdir())
        except OSError:
            continue
        for task in tasks:
            try:
                text = (task / "stat").read_text()
            except OSError:
                continue
            thread = text[text.index("(") + 1 : text.rindex(")")]
            fields = text.rsplit(")", 1)[1].split()
            key = f"{proc}/{thread}"
            cpu[key] = cpu.get(key, 0.0) + (int(fields[11]) + int(fields[12])) / ticks
    return cpu


def idle_cpu(pids: dict[str, int], seconds: float) -> tuple[dict[str, float], dict[str, Any]]:
    """Each instance's share of a core while no request runs, and the threads that took
    at least 0.5% of a core (by "process/thread" name)."""
    before = {role: tree_threads_cpu_s(pid) for role, pid in pids.items()}
    time.sleep(seconds)
    after = {role: tree_threads_cpu_s(pid) for role, pid in pids.items()}
    total, threads = {}, {}
    for role in pids:
        used = {k: (v - before[role].get(k, 0.0)) / seconds for k, v in after[role].items()}
        total[role] = sum(used.values())
        top = sorted(((v, k) for k, v in used.items() if v >= 0.005), reverse=True)
        threads[role] = {k: round(v, 4) for v, k in top}
    return total, threads


def router_requests(url: str) -> dict[str, float]:
    """The router's client requests so far by outcome (`status`: HTTP status, stream_error,
    client_disconnect), all modes together, and the sums and counts of its handoff and TTFT
    histograms (`handoff_sum`, `handoff_count`, `ttft_sum`, `ttft_count`)."""
    counts: dict[str, float] = {}
    try:
        text = httpx.get(f"{url}/metrics", timeout=30).text
    except httpx.HTTPError as exc:  # a router too slow to answer is a result, not the end
        print(f"{time.strftime('%T')} {url}/metrics: {exc!r}", flush=True)
        return {"router_unreachable": 1.0}
    for m in REQUESTS.finditer(text):
        counts[m["status"]] = counts.get(m["status"], 0.0) + float(m["n"])
    for m in HISTOGRAMS.finditer(text):
        counts[f"{HISTOGRAM_KEYS[m['name']]}_{m['part']}"] = float(m["n"])
    return counts


def bench(
    url: str, length: str, rate: str, a: argparse.Namespace, seed: int, save: Path
) -> dict[str, Any]:
    """One point: `pdserve bench serve`'s JSON in `save`, with "driver" added (the router's
    counts over the point, wall time, whether it ran out of `--point-timeout`)."""
    cmd = [sys.executable, "-m", "pdserve", "bench", "serve", "--base-url", url]
    cmd += ["--input-len", length, "--output-len", str(a.output_len), "--ignore-eos"]
    cmd += [
        "--seed",
        str(seed),
        "--num-prompts",
        str(a.num_prompts),
        "--num-warmups",
        str(a.num_warmups),
    ]
    cmd += ["--request-timeout", str(a.request_timeout)]
    cmd += ["--disable-tqdm", "--save-result", str(save)]
    if rate == "c1":
        cmd += ["--request-rate", "inf", "--max-concurrency", "1"]
    else:
        cmd += ["--request-rate", rate]
    save.unlink(missing_ok=True)
    before, t0 = router_requests(url), time.monotonic()
    with open(save.with_suffix(".txt"), "w") as log:
        try:
            rc = subprocess.run(
                cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, timeout=a.point_timeout
            ).returncode
        except subprocess.TimeoutExpired:  # run() killed the client
            rc = None
    wall = time.monotonic() - t0
    time.sleep(2)  # the router counts a killed client's requests once it notices
    after = router_requests(url)
    counts = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    driver: dict[str, Any] = {"rc": rc, "wall_s": wall, "saturated": rc is None, "rate": rate}
    for name in HISTOGRAM_KEYS.values():  # the router's own view, also of a point cut short
        n, total = counts.pop(f"{name}_count", 0.0), counts.pop(f"{name}_sum", 0.0)
        driver[f"router_mean_{name}_ms"] = 1000 * total / n if n else None
    driver |= {"router_requests": {k: v for k, v in counts.items() if v}}
    driver["router_completed"] = counts.get("200", 0.0)
    driver["router_failed"] = sum(
        v for k, v in counts.items() if k not in ("200", "router_unreachable")
    )
    result = json.loads(save.read_text()) if save.exists() else {}
    result["driver"] = driver
    save.write_text(json.dumps(result))
    return driver


def resolve(point: str, a: argparse.Namespace, r: int, first: str) -> tuple[str, str | None]:
    """LEN and RATE of a point; `heavy` from --heavy-rate, else from the first cluster's c1
    TTFT in this round (RATE None when that point has no TTFT: the cluster failed or the
    point ran out of time)."""
    length, rate = point.split(":")
    if rate != "heavy":
        return length, rate
    if length in a.heavy_rate:
        return length, a.heavy_rate[length]
    c1 = a.out / f"r{r}__{length}-c1__{first}.json"
    ttft_ms = json.loads(c1.read_text()).get("median_ttft_ms") if c1.exists() else None
    return length, f"{HEAVY_FRACTION * 1000 / ttft_ms:.2f}" if ttft_ms else None


def heavier(length: str, rate: str, than_length: str, than_rate: str) -> bool:
    """Whether a point loads P at least as much as another, one that saturated: no shorter
    prompts and a request rate (c1 counts as none) no lower."""
    if rate == "c1":
        return False
    return int(length) >= int(than_length) and (
        than_rate == "c1" or float(rate) >= float(than_rate)
    )


def run_cluster(name: str, a: argparse.Namespace, r: int, first: str) -> None:
    logs = a.out / "logs" / f"r{r}"
    logs.mkdir(parents=True, exist_ok=True)
    info: dict[str, Any] = {"load_start": os.getloadavg()}
    save_info = a.out / f"r{r}__cluster__{name}.json"
    up = Up(name, a, logs)
    try:
        t0 = time.monotonic()
        pids = {k: v for k, v in up.wait_ready(a.startup_timeout).items() if k != "router"}
        warm_up(up.url, str(a.model))
        info["ready_s"] = time.monotonic() - t0
        print(f"{time.strftime('%T')} r{r} {name} ready in {info['ready_s']:.0f} s", flush=True)
        # vLLM's worker busy-polls its shared-memory queue for 1 s after each read
        # (SpinCondition.busy_loop_s): that second is vLLM's by design, not idle cost.
        time.sleep(a.idle_settle_s)
        info["idle_cpu"], info["idle_threads"] = idle_cpu(pids, a.idle_s)
        save_info.write_text(json.dumps(info))
        saturated: list[tuple[str, str]] = []  # (point, rate) that ran out of time
        for point in a.points:
            length, rate = resolve(point, a, r, first)
            save = a.out / f"r{r}__{length}-{point.split(':')[1]}__{name}.json"
            over = [p for p, pr in saturated if rate and heavier(length, rate, p.split(":")[0], pr)]
            if rate is None or over:
                why = f"saturated at {over[0]}" if rate else f"no {length}:c1 TTFT"
                driver = {"skipped": why, "rate": rate}
                save.write_text(json.dumps({"driver": driver}))
                print(f"{time.strftime('%T')} r{r} {point} {name} skipped", flush=True)
                continue
            d = bench(up.url, length, rate, a, seed=r, save=save)
            if d["saturated"]:
                saturated.append((point, rate))
            print(
                f"{time.strftime('%T')} r{r} {point} ({rate}/s) {name} rc={d['rc']} "
                f"{d['wall_s']:.0f} s, router {d['router_requests']}",
                flush=True,
            )
    finally:
        info["load_end"] = os.getloadavg()
        save_info.write_text(json.dumps(info))
        up.stop()


def summary(out: Path) -> None:
    """Medians over rounds, per point and cluster; each instance's idle CPU and the load."""
    rows: dict[tuple[str, str], list[dict]] = {}
    for f in sorted(out.glob("r*__*__*.json")):
        _, point, name = f.stem.split("__")
        if point not in ("idle", "cluster"):
            rows.setdefault((point, name), []).append(json.loads(f.read_text()))
    keys = ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms")
    keys += ("median_handoff_ms", "p99_handoff_ms")
    head = ["point", "cluster", "rounds", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99"]
    head += ["handoff p50", "handoff p99", "completed", "failed", "req/s", "note"]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for (point, name), res in sorted(rows.items(), key=lambda kv: (_point_key(kv[0][0]), kv[0][1])):
        cells = [_median([x.get(k) for x in res]) for k in keys]
        done = sum(x.get("completed", 0) for x in res)
        failed = sum(x.get("failed", 0) for x in res)
        tput = _median([x.get("request_throughput") for x in res])
        notes = [_note(x.get("driver", {})) for x in res]
        rate = "/".join(sorted({str(x.get("driver", {}).get("rate")) for x in res}))
        note = "; ".join(n for n in notes if n) or f"rate {rate}"
        print(
            f"| {point} | {name} | {len(res)} | {' | '.join(cells)} | {done} | {failed} | "
            f"{tput} | {note} |"
        )
    print(
        "\n| cluster | round | P idle CPU (% core) | D idle CPU (% core) | load start | load end |"
    )
    print("|---|---|---|---|---|---|")
    for f in sorted(out.glob("r*__cluster__*.json")):
        rnd, _, name = f.stem.split("__")
        c = json.loads(f.read_text())
        idle = c.get("idle_cpu", {})
        p, d = (f"{100 * idle[k]:.1f}" if k in idle else "-" for k in ("prefill", "decode"))
        loads = [" ".join(f"{x:.1f}" for x in c.get(k, ())) for k in ("load_start", "load_end")]
        print(f"| {name} | {rnd} | {p} | {d} | {loads[0]} | {loads[1]} |")
    print("\nIdle threads at >= 0.5% of a core (% core):")
    for f in sorted(out.glob("r*__cluster__*.json")):
        rnd, _, name = f.stem.split("__")
        c = json.loads(f.read_text())
        for role, threads in c.get("idle_threads", {}).items():
            top = ", ".join(f"{k} {100 * v:.1f}" for k, v in threads.items())
            print(f"- {name} {rnd} {role}: {top or 'none'}")
        if "error" in c:
            print(f"- {name} {rnd}: failed: {c['error']}")


def _router_means(d: dict[str, Any]) -> str:
    """The router's mean TTFT and handoff over a point, where it recorded them."""
    means = [(k, d.get(f"router_mean_{k}_ms")) for k in ("ttft", "handoff")]
    return "".join(f", router mean {k} {v:.0f} ms" for k, v in means if v is not None)


def _point_key(point: str) -> tuple[int, int]:
    length, rate = point.split("-")
    return int(length), {"c1": 0, "heavy": 2}.get(rate, 1)


def _note(d: dict[str, Any]) -> str:
    """What the router saw at a point the client did not finish (empty when it did)."""
    if "skipped" in d:
        return f"skipped: {d['skipped']}"
    if d.get("saturated"):
        return (
            f"saturated: ran out of {d['wall_s']:.0f} s at {d['rate']}/s; router: "
            f"{d['router_completed']:.0f} completed, {d['router_failed']:.0f} failed "
            f"({d['router_requests']}){_router_means(d)}"
        )
    return ""


def _median(values: list[float | None]) -> str:
    present = [v for v in values if v is not None]
    return f"{statistics.median(present):.1f}" if present else "-"


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def main() -> None:
    first, rest = __doc__.split("\n\n", 1)
    ap = argparse.ArgumentParser(
        description=first, epilog=rest, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("out", type=Path)
    ap.add_argument("--vllm-python", help="default: pdserve serve's (.venv-vllm)")
    ap.add_argument("--model", type=Path, default=REPO / "results/ckpt-qwen3-4l256")
    ap.add_argument("--points", nargs="+", default=list(DEFAULT_POINTS), help="LEN:RATE")
    ap.add_argument("--clusters", nargs="+", default=list(DEFAULT_CLUSTERS), choices=CLUSTERS)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--num-prompts", type=int, default=24)
    ap.add_argument(
        "--heavy-rate",
        action="append",
        default=[],
        metavar="LEN=RATE",
        help="LEN:heavy at this req/s (e.g. from an earlier run's first cluster) instead of "
        "from this round's first cluster",
    )
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--num-warmups", type=int, default=2, help="the client's, per point")
    ap.add_argument("--transport", choices=("tcp", "nixl"), default="tcp", help="pdserve's")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument(
        "--vllm-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more argument for every vLLM instance, e.g. --vllm-arg=--enforce-eager "
        "(no torch.compile warm-up: minutes less per start on a loaded machine)",
    )
    ap.add_argument("--max-model-len", type=int, default=9000)
    ap.add_argument("--idle-s", type=float, default=10.0, help="idle CPU measured this long")
    ap.add_argument(
        "--idle-settle-s",
        type=float,
        default=3.0,
        help="wait this long after the warm-up before measuring idle CPU (vLLM's worker "
        "busy-polls its queue for 1 s after each step)",
    )
    ap.add_argument("--startup-timeout", type=float, default=900.0)
    ap.add_argument(
        "--point-timeout", type=float, default=240.0, help="a point's wall-time limit (s)"
    )
    ap.add_argument(
        "--request-timeout", type=float, default=120.0, help="the client's, per request (s)"
    )
    ap.add_argument("--summary", action="store_true", help="only print OUTDIR's tables")
    a = ap.parse_args()
    # Started in the background, a shell leaves SIGINT ignored: SIGINT and SIGTERM both stop
    # the run through the clusters' `finally` (each `pdserve up` is stopped).
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _interrupt)
    if a.summary:
        summary(a.out)
        return
    a.heavy_rate = dict(x.split("=", 1) for x in a.heavy_rate)
    for i, point in enumerate(a.points):
        length, rate = point.split(":")
        if rate == "heavy" and length not in a.heavy_rate and f"{length}:c1" not in a.points[:i]:
            ap.error(f"{point} needs {length}:c1 before it in --points")
    a.out = a.out.resolve()
    a.out.mkdir(parents=True, exist_ok=True)
    if not a.model.exists():
        make = [sys.executable, "-m", "pdserve", "bench", "make-checkpoint", "--out", str(a.model)]
        subprocess.run(make, cwd=REPO, check=True)
    for r in range(1, a.rounds + 1):
        order = a.clusters if r % 2 else a.clusters[::-1]
        for name in order:
            try:
                run_cluster(name, a, r, first=order[0])
            except ClusterFailed as exc:
                print(f"{time.strftime('%T')} r{r} {name} failed: {exc}", flush=True)
                info_path = a.out / f"r{r}__cluster__{name}.json"
                info = json.loads(info_path.read_text()) if info_path.exists() else {}
                info_path.write_text(json.dumps(info | {"error": str(exc)}))
    summary(a.out)


if __name__ == "__main__":
    main()
