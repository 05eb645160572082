"""Inter-token latency through the router against the same decode instance read directly.

Question: does relaying a stream through the router bunch its tokens (inter-token gaps of
~0 ms, the tokens arriving in bursts) or stretch them, compared with reading D directly?

Method: one 1P1D push cluster (`pdserve.launcher.Cluster`: P and the router pinned to one
core, D to the other). With `--method local` (the default) the router's
`--local-prefill-below` is set above every prompt, so a request through the router is one
plain request to D, which prefills and decodes it itself: exactly what a request sent
straight to D does. Both paths then cost D the same and differ only by the relay. With
`--method disagg` the router disaggregates (P prefills, KV pushed to D) while direct
requests still prefill on D: the decode phase is the same, the prefill interference is not.

Requests are sent in rounds: per round, `c` concurrent requests through the router and `c`
straight to D, the order alternating between rounds, so both paths see the same machine
(other tenants, thermal state) in turn. Timing is the bench client's (`pdserve bench serve`:
aiohttp, a token's time is when the chunk completing its event was read), pinned with
`--client-cpus` (default: the router's core, as `bench serve --cpus` advises).

Output, per concurrency and path: ITL p50/p90/p99, the number of ~0 ms gaps per request
(`--zero-ms`, default 0.05: what prints as 0.0 ms), the router's CPU per relayed token, and
the host's load and CPU share; `--json FILE` saves it all. Run from the repository root:

    PYTHONPATH=$PWD python scripts/bench/relay_itl.py --concurrency 1 4 --rounds 20

Processes bind 127.0.0.1 on free ports and are stopped by the cluster (by PID).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import random
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.bench.client import ClientConfig, RunClock, open_session, send_request
from pdserve.bench.dataset import BenchRequest
from pdserve.bench.hostcpu import read_cpu_times, shares
from pdserve.bench.metrics import RequestRecord
from pdserve.launcher import Cluster, ClusterConfig

ALL_LOCAL = 1 << 30  # a --local-prefill-below above any prompt: every request local on D


@dataclass
class PathResult:
    """The records of one path (router or direct) at one concurrency."""

    records: list[RequestRecord] = field(default_factory=list)

    def summary(self, zero_ms: float) -> dict[str, object]:
        ok = [r for r in self.records if r.success]
        itl_ms = [g * 1000 for r in ok for g in r.itl]
        zeros = [sum(1 for g in r.itl if g * 1000 < zero_ms) for r in ok]
        q = statistics.quantiles(itl_ms, n=100) if len(itl_ms) > 1 else [float("nan")] * 99
        return {
            "requests": len(self.records),
            "failed": len(self.records) - len(ok),
            "gaps_per_request": max((len(r.itl) for r in ok), default=0),
            "itl_p50_ms": round(q[49], 3),
            "itl_p90_ms": round(q[89], 3),
            "itl_p99_ms": round(q[98], 3),
            "itl_mean_ms": round(statistics.fmean(itl_ms), 3) if itl_ms else None,
            "zero_gaps_mean": round(statistics.fmean(zeros), 2) if zeros else None,
            "zero_gaps_min_med_max": [min(zeros), statistics.median(zeros), max(zeros)]
            if zeros
            else None,
        }


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    doc = __doc__ or ""
    p = argparse.ArgumentParser(
        description=doc.split("\n\n")[0],
        epilog=doc.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="builtin:tiny", help="default: %(default)s")
    p.add_argument("--method", choices=("local", "disagg"), default="local")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    p.add_argument("--rounds", type=int, default=20, help="rounds per concurrency")
    p.add_argument("--warmup-rounds", type=int, default=2)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--zero-ms", type=float, default=0.05, help="a gap below this is ~0 ms")
    p.add_argument(
        "--client-cpus",
        default=None,
        help="cores for this client, e.g. 0 (default: the router's; 'any': unpinned)",
    )
    p.add_argument(
        "--router-nice",
        type=int,
        default=None,
        help="set the router's main thread to this nice value after start (negative: more "
        "eager to preempt P on its shared core; needs privileges)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="save the figures here")
    return p.parse_args(argv)


def _requests(rng: random.Random, n: int, args: argparse.Namespace) -> list[BenchRequest]:
    # Token ids 10..255: valid for the built-in byte-level tokenizer, clear of specials.
    return [
        BenchRequest(
            prompt=[rng.randrange(10, 256) for _ in range(args.input_len)],
            prompt_len=args.input_len,
            output_len=args.output_len,
        )
        for _ in range(n)
    ]


def _cpu_ticks(pid: int) -> int:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


async def _measure(
    cluster: Cluster, args: argparse.Namespace
) -> tuple[dict[int, dict[str, PathResult]], dict[int, float]]:
    model = args.model
    urls = {"router": cluster.router_url, "direct": cluster.instances[1].url}
    configs = {k: ClientConfig(url=f"{u}/v1/completions", model=model) for k, u in urls.items()}
    rng = random.Random(args.seed)
    clock = RunClock.start()
    results: dict[int, dict[str, PathResult]] = {}
    router_ms_per_token: dict[int, float] = {}
    assert cluster.router is not None
    async with open_session(timeout_s=300.0) as http:
        for c in args.concurrency:
            results[c] = {k: PathResult() for k in urls}
            ticks, tokens = 0, 0
            for rnd in range(args.warmup_rounds + args.rounds):
                order = list(urls) if rnd % 2 == 0 else list(urls)[::-1]
                for path in order:
                    reqs = _requests(rng, c, args)
                    before = _cpu_ticks(cluster.router.pid)
                    recs = await asyncio.gather(
                        *(send_request(http, configs[path], r, clock) for r in reqs)
                    )
                    if rnd < args.warmup_rounds:
                        continue
                    results[c][path].records += recs
                    if path == "router":
                        ticks += _cpu_ticks(cluster.router.pid) - before
                        tokens += sum(r.output_len for r in recs if r.success)
            hz = os.sysconf("SC_CLK_TCK")
            router_ms_per_token[c] = round(1000 * ticks / hz / max(1, tokens), 4)
    return results, router_ms_per_token


def _pin_client(args: argparse.Namespace, cluster: Cluster) -> str:
    if args.client_cpus == "any":
        return "any"
    if args.client_cpus is not None:
        cpus = {int(x) for x in args.client_cpus.split(",")}
    else:
        assert cluster.router is not None
        cpus = os.sched_getaffinity(cluster.router.pid)
    os.sched_setaffinity(0, cpus)
    return ",".join(map(str, sorted(cpus)))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    below = ALL_LOCAL if args.method == "local" else 0
    config = ClusterConfig(
        kv_transfer="push", model=args.model, local_prefill_below=below, router_log_level="warning"
    )
    with Cluster(config) as cluster:
        client_cpus = _pin_client(args, cluster)
        if args.router_nice is not None:
            assert cluster.router is not None
            os.setpriority(os.PRIO_PROCESS, cluster.router.pid, args.router_nice)
        load_before = os.getloadavg()
        cpu_before = read_cpu_times()
        results, router_cost = asyncio.run(_measure(cluster, args))
        busy, steal = shares(cpu_before, read_cpu_times())
    report = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": {
            "cpus": os.cpu_count(),
            "cpu_model": _cpu_model(),
            "python": platform.python_version(),
            "loadavg_before": [round(x, 2) for x in load_before],
            "loadavg_after": [round(x, 2) for x in os.getloadavg()],
            "cpu_busy": busy,
            "cpu_steal": steal,
        },
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "client_cpus": client_cpus,
        "results": {
            str(c): {
                **{p: r.summary(args.zero_ms) for p, r in paths.items()},
                "router_cpu_ms_per_token": router_cost[c],
            }
            for c, paths in results.items()
        },
    }
    _print(report)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _print(report: dict) -> None:
    host = report["host"]
    where = f"{host['cpus']} x {host['cpu_model']}, client on {report['client_cpus']}"
    print(f"{report['date']}  {where}")
    print(
        f"load {host['loadavg_before']} -> {host['loadavg_after']}, "
        f"busy {host['cpu_busy']}, steal {host['cpu_steal']}"
    )
    head = "conc path    reqs  ITL p50   p90    p99   ~0ms gaps/req mean [min med max]"
    print(head)
    for c, paths in report["results"].items():
        for path in ("router", "direct"):
            s = paths[path]
            itl = f"{s['itl_p50_ms']:>7.3f} {s['itl_p90_ms']:>6.3f} {s['itl_p99_ms']:>6.3f}"
            zeros = f"{s['zero_gaps_mean']!s:>5} {s['zero_gaps_min_med_max']}"
            n = f"(of {s['gaps_per_request']}, failed {s['failed']})"
            print(f"{c:>4} {path:<7} {s['requests']:>4} {itl}   {zeros}  {n}")
        r, d = paths["router"]["itl_p50_ms"], paths["direct"]["itl_p50_ms"]
        print(
            f"     router/direct ITL p50 {r / d:.3f}; "
            f"router CPU {paths['router_cpu_ms_per_token']} ms/token"
        )


if __name__ == "__main__":
    sys.exit(main())
