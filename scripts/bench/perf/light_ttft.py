"""Light-load TTFT of push vs pull vs mono1, one request at a time (or at a Poisson
`--rate`), with a per-hop split.

Issue 8's target: push TTFT median within 10% of the monolithic instance with P's compute
(`mono1`: one instance on P's core). Every cluster is up for the whole run (`pdserve up`:
P on core 0, D on core 1, the router on core 0, or on core 1 in `push-routerD`; mono1 on
core 0); the modes take turns in palindromic order per round, each sending `--num-prompts`
requests one at a time (`bench serve --max-concurrency 1`; with `--rate R`, Poisson
arrivals at R req/s as the sweep sends them), the same prompts per round for every mode.
Instances and the router log the handoff trace (`--log-level debug`), so each request's TTFT is cut
into: client -> router (P/D) or instance (mono1), HTTP handler -> engine, engine ->
prompt done (queue + prefill step), prompt done -> client's first token.

usage: light_ttft.py OUTDIR [--modes push pull mono1] [--rounds 3] [--num-prompts 30]
       [--input-len 1024] [--output-len 16] [--rate R] [--model builtin:small]
       [--client-cpus 1] [--baseline DIR [--baseline-client]]
       [-- INSTANCE ARGS, e.g. --dtype bfloat16]
       (run under flock /work/notes/bench.lock)

`--baseline DIR` (a checkout of other code, e.g. `git worktree add DIR HEAD~1`) adds, for
every P/D mode M, a mode `M@base`: the same cluster started from DIR's code (this
checkout's venv), taking its turns in the same rounds, so that one run compares two
versions under the same conditions. With `--baseline-client` the `@base` modes also run
DIR's bench client, and mono1 gets a `mono1@base` too (to compare two bench clients).
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

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))
from pdserve.ports import free_port  # noqa: E402
from pdserve.tracelog import parse_hop_line  # noqa: E402

PY = str(REPO / ".venv/bin/python")
MODES = {
    "push": ["--kv-transfer", "push"],
    "pull": ["--kv-transfer", "pull"],
    "push-whole": ["--kv-transfer", "push"],
    "push-routerD": ["--kv-transfer", "push"],  # then the router is moved to D's core
    "mono1": ["--monolithic", "--cores", "0"],
}

INSTANCE_FLAGS = {
    "push-whole": ["--no-push-layerwise"],
}


def start(mode: str, a: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    kind, _, base = mode.partition("@")
    tree = a.baseline if base else REPO
    port = free_port()
    log = open(a.out / f"up-{mode}.log", "w")  # noqa: SIM115 - lives as long as the cluster
    cmd = [PY, "-m", "pdserve", "up", *MODES[kind], "--model", a.model, "--port", str(port)]
    cmd += ["--log-dir", str(a.out / f"logs-{mode}")]
    if kind != "mono1":
        cmd += ["--router-log-level", "debug", "--local-prefill-below", "0"]
    extra = INSTANCE_FLAGS.get(kind, [])
    cmd += ["--", "--log-level", "debug", "--kv-cache-memory", "1", *extra, *a.instance_args]
    # `-m pdserve` imports the package from the working directory, before the venv's.
    return subprocess.Popen(cmd, cwd=tree, stdout=log, stderr=subprocess.STDOUT), (
        f"http://127.0.0.1:{port}"
    )


def wait_up(mode: str, a: argparse.Namespace, popen: subprocess.Popen) -> None:
    for _ in range(300):
        if "Ctrl-C stops" in (text := (a.out / f"up-{mode}.log").read_text()):
            if mode.startswith("push-routerD"):
                move_router(text, core=1)
            return
        if popen.poll() is not None:
            raise RuntimeError(f"{mode} cluster exited; see up-{mode}.log")
        time.sleep(1)
    raise RuntimeError(f"{mode} cluster not up in 300 s")


def move_router(up_log: str, core: int) -> None:
    """Pin every thread of the cluster's router (its pid from `pdserve up`'s table) to
    `core`, D's, instead of P's where `pdserve up` put it."""
    pid = int(re.search(r"^  router .* pid (\d+)", up_log, re.M).group(1))  # type: ignore[union-attr]
    for task in Path(f"/proc/{pid}/task").iterdir():
        os.sched_setaffinity(int(task.name), {core})


def bench(mode: str, url: str, a: argparse.Namespace, n: int, seed: int, save: Path | None) -> None:
    cmd = [PY, "-m", "pdserve", "bench", "serve", "--base-url", url, "--disable-tqdm"]
    cmd += ["--input-len", str(a.input_len), "--output-len", str(a.output_len)]
    cmd += ["--num-prompts", str(n), "--seed", str(seed), "--num-warmups", "0"]
    if a.rate is None or save is None:  # warm-ups go one at a time
        cmd += ["--max-concurrency", "1", "--request-rate", "inf"]
    else:
        cmd += ["--request-rate", str(a.rate)]
    if a.client_cpus:
        cmd += ["--cpus", a.client_cpus]
    if save is not None:
        cmd += ["--save-result", str(save)]
    tree = a.baseline if a.baseline_client and mode.endswith("@base") else REPO
    subprocess.run(cmd, cwd=tree, check=True, capture_output=True)


def hops(log_dir: Path) -> dict[str, list]:
    """name -> [(t, key, process)] from every log of a cluster."""
    out: dict[str, list] = {}
    for f in log_dir.glob("*.log"):
        for line in f.read_text(errors="replace").splitlines():
            h = parse_hop_line(line)
            if h is not None:
                out.setdefault(h.name, []).append((h.t, h.key, f.stem))
    return out


def first_after(items: list, t: float, proc: str | None = None, key: str | None = None):
    best = None
    for ht, hk, hp in items:
        ok = ht >= t and (proc is None or hp == proc) and (key is None or hk == key)
        if ok and (best is None or ht < best[0]):
            best = (ht, hk, hp)
    return best


def split(mode: str, result: dict, h: dict[str, list]) -> list[dict[str, float]]:
    """Per request: ms in each part of its TTFT."""
    rows = []
    mono = mode.partition("@")[0] == "mono1"
    t0 = result["start_time_unix"]
    for start, ttft in zip(result["start_times"], result["ttfts"], strict=True):
        if ttft is None:
            continue
        sent = t0 + start
        first = sent + ttft
        p = "both-0" if mono else "prefill-0"
        handler = first_after(h.get("d.http_handler", []), sent, p)
        if handler is None:
            continue
        rid = handler[1]
        add = first_after(h.get("d.engine_add", []), handler[0], p, f"cmpl-{rid}")
        if mono:
            done = first_after(h.get("d.deliver", []), handler[0], p, f"cmpl-{rid}")
        else:
            done = first_after(h.get("p.prefill_done", []), handler[0], p)
        if add is None or done is None:
            continue
        row = {"to_handler": handler[0] - sent, "handler_to_engine": add[0] - handler[0]}
        row["engine_to_done"] = done[0] - add[0]
        row["done_to_first"] = first - done[0]
        row["ttft"] = ttft
        if not mono:
            got = first_after(h.get("r.received", []), sent, "router", rid)
            if got is not None:
                row["to_router"] = got[0] - sent
        rows.append({k: v * 1000 for k, v in row.items()})
    return rows


PARTS = ["to_router", "to_handler", "handler_to_engine", "engine_to_done", "done_to_first", "ttft"]


def med(rows: list[dict], k: str) -> str:
    vals = [r[k] for r in rows if k in r]
    return f"{statistics.median(vals):.1f}" if vals else "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("out", type=Path)
    ap.add_argument("--modes", nargs="+", default=["push", "pull", "mono1"], choices=list(MODES))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=30)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--rate", type=float, help="Poisson arrivals at this many req/s")
    ap.add_argument("--model", default="builtin:small")
    ap.add_argument("--client-cpus", help="pin the bench client (bench serve --cpus)")
    ap.add_argument("--baseline", type=Path, help="also run every P/D mode from this checkout")
    ap.add_argument(
        "--baseline-client", action="store_true", help="and the @base modes' bench client"
    )
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    a = ap.parse_args(argv[:cut])
    a.instance_args = argv[cut + 1 :]
    a.out = a.out.resolve()  # the baseline's clusters run in another directory
    a.out.mkdir(parents=True, exist_ok=True)
    if a.baseline is not None:
        a.modes += [f"{m}@base" for m in a.modes if m != "mono1" or a.baseline_client]
    clusters = {m: start(m, a) for m in a.modes}
    try:
        for m, (popen, _) in clusters.items():
            wait_up(m, a, popen)
        for m, (_, url) in clusters.items():
            bench(m, url, a, 3, 999, None)  # warm-up
        for rnd in range(1, a.rounds + 1):
            for m in a.modes if rnd % 2 else a.modes[::-1]:
                bench(m, clusters[m][1], a, a.num_prompts, rnd, a.out / f"r{rnd}-{m}.json")
                print(f"round {rnd} {m} done", flush=True)
    finally:
        for popen, _ in clusters.values():
            popen.send_signal(signal.SIGTERM)
        for popen, _ in clusters.values():
            popen.wait(timeout=60)
    report(a)


def reference(a: argparse.Namespace, mode: str) -> str:
    """The mono1 run a mode's TTFT is compared with: the one with the same bench client."""
    return "mono1@base" if mode.endswith("@base") and "mono1@base" in a.modes else "mono1"


def ratios(a: argparse.Namespace, per_round: dict, pooled: dict[str, list]) -> str:
    """TTFT p50 over the reference mono1's, per round and pooled."""
    others = [m for m in a.modes if not m.startswith("mono1")]

    def ttft(m: str) -> float:
        return statistics.median(r["ttft"] for r in pooled[m])

    def one_round(r: int) -> str:
        cells = (f"{m} {per_round[(r, m)] / per_round[(r, reference(a, m))]:.2f}" for m in others)
        return f"r{r} " + ", ".join(cells)

    rounds = "; ".join(one_round(r) for r in range(1, a.rounds + 1))
    total = ", ".join(f"{m} {ttft(m) / ttft(reference(a, m)):.2f}" for m in others)
    return f"TTFT p50 over mono1's, per round: {rounds}\n\npooled: {total}"


def report(a: argparse.Namespace) -> None:
    head = "| round | mode | " + " | ".join(PARTS) + " | n | steal |"
    lines = [head, "|" + "---|" * (len(PARTS) + 4)]
    pooled: dict[str, list] = {}
    per_round: dict[tuple[int, str], float] = {}
    for m in a.modes:
        h = hops(a.out / f"logs-{m}")
        for rnd in range(1, a.rounds + 1):
            res = json.loads((a.out / f"r{rnd}-{m}.json").read_text())
            rows = split(m, res, h)
            pooled.setdefault(m, []).extend(rows)
            per_round[(rnd, m)] = res["median_ttft_ms"]
            cells = [med(rows, k) for k in PARTS]
            steal = f"{res.get('host_cpu_steal', float('nan')):.0%}"
            lines.append(f"| {rnd} | {m} | " + " | ".join(cells) + f" | {len(rows)} | {steal} |")
    for m, rows in pooled.items():
        cells = [med(rows, k) for k in PARTS]
        lines.append(f"| all | {m} | " + " | ".join(cells) + f" | {len(rows)} | |")
    if "mono1" in a.modes:
        lines += ["", ratios(a, per_round, pooled)]
    text = "\n".join(lines)
    (a.out / "report.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
