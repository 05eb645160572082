"""`pdserve bench soak`: minutes of mixed, aborted, fault-interrupted traffic against a local
1P1D cluster, then an audit: failures by cause, KV blocks leaked, wrong outputs.

A soak, in order:

1. start a 1P1D cluster with the launcher (`pdserve.launcher.Cluster`, logs under the
   result directory);
2. warm up, and unless `--request-rate` is given derive the rate from one request's
   latency: `target_load / latency`, which keeps P busy most of the time;
3. release Poisson arrivals for `duration_s` (`soak_traffic`: mixed lengths, greedy, a
   fraction of streams closed by the client at a random point), at most `max_concurrency`
   in flight; at `restart_at` of the duration, SIGKILL the prefill instance by PID and start
   it again on the same ports (a new incarnation);
4. wait for every request, then for every surviving instance to drain (`GET /load` until
   nothing runs, waits or holds a block, bounded by `drain_timeout_s`) and record the
   blocks still used: leaks;
5. stop the cluster, start a monolithic instance of the same model and replay a sample of
   the completed requests one at a time with greedy sampling; compare token ids.

Kill mode (`kill_every_s`, `--kill-every S`) replaces step 3's single restart: the cluster
is supervised as `pdserve up` supervises it (`pdserve.supervisor.Supervisor`, on a thread,
stopped before the cluster is), and every S seconds of the traffic a random process of
`kill_roles` (prefill, decode, router; seeded by `seed`) is SIGKILLed by PID; the
supervisor restarts it on its ports (`pdserve.bench.soak_kills`). The report adds each
kill (when, the PIDs and incarnations, when it was back), the restarts per process and
any process given up or not back, which fails the soak like a leak does.

The soak owns every process it starts (through `Cluster`) and stops them by PID. The exit
status is 1 when any block leaked, any output was wrong or a killed process did not come
back, 2 when the soak could not run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import aiohttp
import msgspec
import numpy as np
from tqdm import tqdm

from pdserve.bench.client import EndpointError, first_model, open_session
from pdserve.bench.soak_kills import (
    KILL_ROLES,
    KillRole,
    plan_kills,
    read_incarnation,
    run_kills,
    soak_restart_policy,
)
from pdserve.bench.soak_report import (
    MAX_FAILED_SAVED,
    FailedRequest,
    InstanceBlocks,
    KillInfo,
    Mismatch,
    RestartInfo,
    SoakResult,
    blocks_from_load,
    count_phases,
    exit_status,
    first_difference,
    format_summary,
    group_causes,
    is_drained,
    latency_percentiles,
    oracle_sample,
    total_leaked,
    unreadable_instance,
)
from pdserve.bench.soak_traffic import (
    SoakOutcome,
    SoakRequest,
    TrafficConfig,
    make_request,
    poisson_arrivals,
    send,
)
from pdserve.config import TransferMode, TransportKind
from pdserve.launcher import Cluster, ClusterConfig, ClusterError
from pdserve.options import add_options, option
from pdserve.supervisor import Event, Supervisor, describe
from pdserve.transfer.cluster_auth import route_headers

PREFILL = "prefill-0"
# After the restarted P answers /health, the router needs its health round (1 s by default)
# and a /kv/info refresh before it routes to P again; requests in that window may get a 503.
# The 'after' phase starts once the router is seen to have done so, and not before this.
SETTLE_S = 5.0
_TAKEN_BACK_TIMEOUT_S = 120.0  # waiting for the router to take P back, at most
WARMUP_TOKENS = 4
_TIMEOUT_MARGIN_S = 30.0  # the router's own bound sits above the client's
_LOAD_TIMEOUT = aiohttp.ClientTimeout(sock_connect=5.0, sock_read=5.0)  # each /load read


def _kill_roles(text: str) -> tuple[KillRole, ...]:
    roles = tuple(r.strip() for r in text.split(",") if r.strip())
    if not roles or not set(roles) <= set(KILL_ROLES):
        raise argparse.ArgumentTypeError(f"roles from {','.join(KILL_ROLES)}, got {text!r}")
    return roles  # type: ignore[return-value]


@dataclass(frozen=True)
class SoakConfig:
    """One soak. `request_rate` None: derived from a warm-up request (see module doc)."""

    mode: TransferMode = option("push", help="P/D transfer mode (default: %(default)s)")
    transport: TransportKind = option("tcp", help="KV transport (default: %(default)s)")
    model: str = option("builtin:small", help="the instances' model (default: %(default)s)")
    duration_s: float = 600.0  # `--duration-min` (minutes)
    request_rate: float | None = option(
        None, help="req/s (default: --target-load / warm-up latency)"
    )
    target_load: float = option(
        0.9, help="without --request-rate: the rate is this over one warm-up request's latency"
    )
    traffic: TrafficConfig = field(default_factory=TrafficConfig)
    restart_at: float | None = option(  # fraction of duration_s; None: no restart
        0.5, metavar="FRACTION", help="restart the prefill instance at this fraction of the run"
    )
    # Kill mode: every kill_every_s a random process of kill_roles is SIGKILLed and the
    # supervised cluster restarts it (pdserve.bench.soak_kills); None: off. Excludes
    # restart_at.
    kill_every_s: float | None = option(
        None,
        flag="--kill-every",
        metavar="S",
        help="kill mode: every S seconds, SIGKILL a random process of --kill-roles (drawn "
        "with --seed) of a cluster supervised as by 'pdserve up', which restarts it; the "
        "report adds the kills, restarts and processes not back. Replaces the single "
        "prefill restart (--restart-at)",
    )
    kill_roles: tuple[KillRole, ...] = option(
        KILL_ROLES,
        parse=_kill_roles,
        metavar="LIST",
        help=f"roles the kill mode draws from, comma-separated (default: {','.join(KILL_ROLES)})",
    )
    max_concurrency: int = option(32, help="most requests in flight")
    oracle_sample: float = option(
        0.1,
        metavar="FRACTION",
        help="fraction of the completed requests replayed on a monolithic instance, whose "
        "token ids must be the same",
    )
    request_timeout_s: float = option(
        120.0, flag="--request-timeout", metavar="S", help="seconds for one whole request"
    )
    drain_timeout_s: float = option(  # above D's default --kv-recv-timeout (120 s)
        150.0,
        flag="--drain-timeout",
        metavar="S",
        help="after the traffic, wait at most this long for every instance to drain",
    )
    seed: int = option(0, help="seeds the traffic and the kills")
    out_dir: Path = option(Path("results/soak"), help="the result and the cluster's logs")
    instance_args: tuple[str, ...] = ()
    pin_cores: bool = option(True, flag="--no-pin", help="do not pin instances to cores")
    progress: bool | None = None  # None: when stderr is a terminal

    def __post_init__(self) -> None:
        if not self.duration_s > 0 or self.max_concurrency < 1:
            raise ValueError("duration must be > 0 and max_concurrency >= 1")
        if self.request_rate is not None and not self.request_rate > 0:
            raise ValueError("request_rate must be > 0")
        if self.restart_at is not None and not 0.0 < self.restart_at < 1.0:
            raise ValueError("restart_at must be a fraction in (0, 1)")
        if not 0.0 <= self.oracle_sample <= 1.0 or not self.target_load > 0:
            raise ValueError("oracle_sample must be in [0, 1] and target_load > 0")
        if self.kill_every_s is not None:
            if not self.kill_every_s > 0 or self.restart_at is not None:
                raise ValueError("kill_every_s must be > 0, and excludes restart_at")
            if not self.kill_roles or not set(self.kill_roles) <= set(KILL_ROLES):
                raise ValueError(f"kill_roles: one or more of {', '.join(KILL_ROLES)}")

    @property
    def show_progress(self) -> bool:
        return sys.stderr.isatty() if self.progress is None else self.progress


@dataclass
class _Traffic:
    """What the traffic phase produced (owned by `run_soak`)."""

    model: str
    rate: float
    requests: dict[int, SoakRequest]
    outcomes: list[SoakOutcome]
    restart: RestartInfo | None
    instances: list[InstanceBlocks]
    drain_s: float
    kills: list[KillInfo] = field(default_factory=list)
    restarts: dict[str, int] = field(default_factory=dict)  # per process
    given_up: list[str] = field(default_factory=list)


def _rngs(seed: int) -> list[np.random.Generator]:
    """Independent streams: arrivals, requests, warm-up, oracle sample, kills (adding one
    at the end leaves the others as they were)."""
    return [np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(5)]


def _http(cfg: SoakConfig) -> aiohttp.ClientSession:
    """The soak's session: a pool of at most `max_concurrency` + 4 connections (the
    requests in flight and the soak's own reads); the caller closes it."""
    return open_session(cfg.request_timeout_s, cfg.max_concurrency + 4)


async def _derive_rate(
    http: aiohttp.ClientSession,
    url: str,
    model: str,
    cfg: SoakConfig,
    rng: np.random.Generator,
) -> float:
    """Warm up with two requests of the mean input length; the second one's latency sets
    the rate (`cfg.request_rate` wins when given)."""
    n = int(cfg.traffic.mean_input_len)
    latency = 0.0
    for i in range(2):
        prompt = rng.integers(*cfg.traffic.token_ids, n).tolist()
        req = SoakRequest(index=-1 - i, prompt=prompt, max_tokens=WARMUP_TOKENS, arrival_s=0.0)
        out = await send(http, url, model, req, time.monotonic(), cfg.request_timeout_s)
        if out.status != "completed":
            raise EndpointError(f"warm-up request failed: {out.cause}: {out.detail}")
        latency = out.ended_s - out.sent_s
    return cfg.request_rate or cfg.target_load / latency


async def _restart_prefill(
    cluster: Cluster, http: aiohttp.ClientSession, at_s: float, t0: float
) -> RestartInfo:
    """At `at_s` into the traffic: SIGKILL P by PID, then start it again (same ports)."""
    await asyncio.sleep(max(0.0, at_s - (time.monotonic() - t0)))
    old = cluster.instance(PREFILL)
    old_incarnation = await read_incarnation(http, old.url, cluster.cluster_token)
    await asyncio.to_thread(cluster.kill_instance, PREFILL)
    killed = time.monotonic() - t0
    new = await asyncio.to_thread(cluster.restart_instance, PREFILL)
    ready = time.monotonic() - t0
    new_incarnation = await read_incarnation(http, new.url, cluster.cluster_token)
    taken_back = await _router_took_back(http, cluster, new.url, new_incarnation)
    return RestartInfo(
        instance=PREFILL,
        killed_s=killed,
        ready_s=ready,
        settled_s=max(ready + SETTLE_S, taken_back - t0),
        old_pid=old.pid,
        new_pid=new.pid,
        old_incarnation=old_incarnation,
        new_incarnation=new_incarnation,
    )


async def _router_took_back(
    http: aiohttp.ClientSession, cluster: Cluster, url: str, incarnation: str | None
) -> float:
    """When (time.monotonic()) the router was seen to have admitted the instance at `url`
    again and, in push mode, to know its new incarnation (from /kv/info; a push router
    hands it to D with every request, a pull router does not use it). A fixed delay would
    not do: a health round can take seconds on a loaded machine. Gives up (returns) after
    `_TAKEN_BACK_TIMEOUT_S`; requests failing after that are then counted as 'after'."""
    deadline = time.monotonic() + _TAKEN_BACK_TIMEOUT_S
    proof = route_headers(cluster.cluster_token, "/router/instances")
    while time.monotonic() < deadline:
        try:
            async with http.get(f"{cluster.router_url}/router/instances", headers=proof) as resp:
                rows = json.loads(await resp.read())
            row = next(r for r in rows if r["url"] == url)
            knows = (row["info"] or {}).get("incarnation") == incarnation
            if row["admitted"] and (knows or cluster.config.kv_transfer != "push"):
                return time.monotonic()
        except (
            aiohttp.ClientError,
            asyncio.TimeoutError,
            ValueError,
            KeyError,
            TypeError,
            StopIteration,
        ):
            pass
        await asyncio.sleep(0.1)
    return time.monotonic()


async def _read_blocks(http: aiohttp.ClientSession, cluster: Cluster) -> list[InstanceBlocks]:
    found = []
    for p in cluster.instances:
        try:
            proof = route_headers(cluster.cluster_token, "/load")
            async with http.get(f"{p.url}/load", headers=proof, timeout=_LOAD_TIMEOUT) as resp:
                resp.raise_for_status()
                body = await resp.read()
            found.append(blocks_from_load(p.name, p.pid, p.restarts, body))
        except (aiohttp.ClientError, asyncio.TimeoutError, msgspec.DecodeError) as exc:
            alive = "alive" if p.alive() else f"exited {p.popen.returncode}"
            found.append(unreadable_instance(p.name, p.pid, p.restarts, f"{exc!r} ({alive})"))
    return found


async def drain(
    http: aiohttp.ClientSession, cluster: Cluster, timeout_s: float
) -> list[InstanceBlocks]:
    """Poll every instance's pool until all are drained or `timeout_s` passes; the last
    reading (what is still used then is leaked)."""
    deadline = time.monotonic() + timeout_s
    while True:
        blocks = await _read_blocks(http, cluster)
        if all(is_drained(b) for b in blocks) or time.monotonic() > deadline:
            return blocks
        await asyncio.sleep(0.5)


class _Progress:
    """A time bar over the traffic with live counts (owned by `_run_traffic`)."""

    def __init__(self, cfg: SoakConfig) -> None:
        self.bar = tqdm(
            total=round(cfg.duration_s),
            unit="s",
            disable=not cfg.show_progress,
            file=sys.stderr,
            desc=f"soak {cfg.mode}",
        )
        self.counts = {"sent": 0, "completed": 0, "aborted": 0, "failed": 0}

    def finished(self, out: SoakOutcome) -> None:
        self.counts[out.status] += 1

    async def tick(self, t0: float, duration_s: float) -> None:
        while (elapsed := time.monotonic() - t0) < duration_s:
            self.bar.n = min(round(elapsed), self.bar.total)
            self.bar.set_postfix(self.counts, refresh=True)
            await asyncio.sleep(1.0)
        self.bar.n = self.bar.total
        self.bar.set_postfix(self.counts, refresh=True)

    def close(self) -> None:
        self.bar.close()


async def _release(
    cfg: SoakConfig,
    rate: float,
    rngs: list[np.random.Generator],
    spawn: Callable[[SoakRequest], None],
    t0: float,
) -> None:
    """Make and release each request at its Poisson arrival time."""
    arrival_rng, request_rng = rngs[0], rngs[1]
    for i, at in enumerate(poisson_arrivals(rate, cfg.duration_s, arrival_rng)):
        req = make_request(i, at, cfg.traffic, request_rng)
        delay = at - (time.monotonic() - t0)
        if delay > 0:
            await asyncio.sleep(delay)
        spawn(req)


async def _run_traffic(
    cluster: Cluster, cfg: SoakConfig, supervisor: Supervisor | None = None
) -> _Traffic:
    rngs = _rngs(cfg.seed)
    async with _http(cfg) as http:
        url = f"{cluster.router_url}/v1/completions"
        model = await first_model(http, cluster.router_url)
        rate = await _derive_rate(http, url, model, cfg, rngs[2])
        print(f"soak: {cfg.mode}, {rate:.2f} req/s for {cfg.duration_s:.0f} s", file=sys.stderr)
        slots = asyncio.Semaphore(cfg.max_concurrency)
        progress = _Progress(cfg)
        requests: dict[int, SoakRequest] = {}
        tasks: list[asyncio.Task[SoakOutcome]] = []

        async def one(req: SoakRequest) -> SoakOutcome:
            async with slots:
                progress.counts["sent"] += 1
                out = await send(http, url, model, req, t0, cfg.request_timeout_s)
            progress.finished(out)
            return out

        def spawn(req: SoakRequest) -> None:
            requests[req.index] = req
            tasks.append(asyncio.create_task(one(req)))

        t0 = time.monotonic()
        ticker = asyncio.create_task(progress.tick(t0, cfg.duration_s))
        restart = None
        if cfg.restart_at is not None:
            at = cfg.restart_at * cfg.duration_s
            restart = asyncio.create_task(_restart_prefill(cluster, http, at, t0))
        kills = None
        if supervisor is not None and cfg.kill_every_s is not None:
            times = plan_kills(cfg.kill_every_s, cfg.duration_s)
            back_s = cluster.config.startup_timeout_s
            kills = asyncio.create_task(
                run_kills(supervisor, cfg.kill_roles, times, t0, rngs[4], back_s)
            )
        try:
            await _release(cfg, rate, rngs, spawn, t0)
            await ticker
            outcomes = list(await asyncio.gather(*tasks))
            restart_info = await restart if restart is not None else None
            kill_infos = await kills if kills is not None else []
        finally:
            progress.close()
        instances = await drain(http, cluster, cfg.drain_timeout_s)
        drain_s = time.monotonic() - t0 - cfg.duration_s
    return _Traffic(
        model,
        rate,
        requests,
        outcomes,
        restart_info,
        instances,
        drain_s,
        kills=kill_infos,
        restarts={p.name: p.restarts for p in cluster.processes},
        given_up=supervisor.given_up() if supervisor is not None else [],
    )


async def _replay(
    cfg: SoakConfig, url: str, model: str, sample: list[SoakRequest]
) -> list[list[int] | None]:
    """The oracle's token ids for each sampled request, one request at a time (None: the
    oracle failed to answer)."""
    answers: list[list[int] | None] = []
    async with _http(cfg) as http:
        for req in tqdm(sample, desc="oracle", disable=not cfg.show_progress, file=sys.stderr):
            out = await send(http, url, model, req, time.monotonic(), cfg.request_timeout_s)
            answers.append(out.token_ids if out.status == "completed" else None)
    return answers


def run_oracle(
    cfg: SoakConfig, log_dir: Path, traffic: _Traffic, rng: np.random.Generator
) -> tuple[int, int, int, list[Mismatch]]:
    """(candidates, checked, unanswered, mismatches) against a fresh monolithic instance."""
    done = {o.index: o for o in traffic.outcomes if o.token_ids is not None}
    chosen = oracle_sample(sorted(done), cfg.oracle_sample, rng)
    if not chosen:
        return len(done), 0, 0, []
    mono = ClusterConfig(
        kv_transfer=None,
        model=cfg.model,
        port=None,
        log_dir=log_dir,
        instance_args=cfg.instance_args,
        pin_cores=cfg.pin_cores,
    )
    sample = [traffic.requests[i] for i in chosen]
    with Cluster(mono) as oracle:
        url = f"{oracle.router_url}/v1/completions"
        answers = asyncio.run(_replay(cfg, url, traffic.model, sample))
    mismatches = []
    for req, want in zip(sample, answers, strict=True):
        got = done[req.index].token_ids or []
        at = None if want is None else first_difference(got, want)
        if want is not None and at is not None:
            mismatches.append(
                Mismatch(
                    index=req.index,
                    prompt_len=len(req.prompt),
                    max_tokens=req.max_tokens,
                    first_difference=at,
                    got=got[at : at + 8],
                    want=want[at : at + 8],
                )
            )
    unanswered = sum(a is None for a in answers)
    return len(done), len(chosen), unanswered, mismatches


def _result(
    cfg: SoakConfig,
    t: _Traffic,
    oracle: tuple[int, int, int, list[Mismatch]],
    log_dir: Path,
    date: str,
) -> SoakResult:
    out = t.outcomes
    failed = [o for o in out if o.status == "failed"]
    p50, p99 = latency_percentiles([o.ended_s - o.sent_s for o in out if o.token_ids])
    return SoakResult(
        date=date,
        mode=cfg.mode,
        transport=cfg.transport,
        model=cfg.model,
        duration_s=cfg.duration_s,
        drain_s=t.drain_s,
        request_rate=t.rate,
        rate_derived=cfg.request_rate is None,
        input_len=cfg.traffic.input_len,
        output_len=cfg.traffic.output_len,
        abort_fraction=cfg.traffic.abort_fraction,
        max_concurrency=cfg.max_concurrency,
        seed=cfg.seed,
        sent=len(out),
        completed=sum(o.status == "completed" for o in out),
        aborted=sum(o.status == "aborted" for o in out),
        failed=len(failed),
        output_tokens=sum(o.num_tokens for o in out),
        latency_p50_s=p50,
        latency_p99_s=p99,
        causes=group_causes(o.cause for o in failed),
        phases=count_phases(((o.sent_s, o.status) for o in out), t.restart),
        restart=t.restart,
        instances=t.instances,
        blocks_leaked=total_leaked(t.instances),
        oracle_candidates=oracle[0],
        oracle_checked=oracle[1],
        oracle_failed=oracle[2],
        mismatches=oracle[3],
        failed_requests=[
            FailedRequest(
                index=o.index,
                sent_s=o.sent_s,
                ended_s=o.ended_s,
                cause=o.cause or "",
                detail=o.detail,
            )
            for o in failed[:MAX_FAILED_SAVED]
        ],
        load_average=os.getloadavg(),
        log_dir=str(log_dir),
        kill_every_s=cfg.kill_every_s,
        kill_roles=list(cfg.kill_roles) if cfg.kill_every_s is not None else [],
        kills=t.kills,
        restarts=t.restarts,
        given_up=t.given_up,
    )


def run_soak(cfg: SoakConfig) -> tuple[SoakResult, Path]:
    """Run a whole soak; returns the result and where its JSON was saved. Raises
    ClusterError / EndpointError when the cluster or the oracle cannot be used at all."""
    date = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    run_dir = cfg.out_dir / f"soak-{cfg.mode}-{date}"
    cluster_cfg = ClusterConfig(
        kv_transfer=cfg.mode,
        transport=cfg.transport,
        model=cfg.model,
        port=None,
        request_timeout_s=cfg.request_timeout_s + _TIMEOUT_MARGIN_S,
        log_dir=run_dir / "cluster",
        instance_args=cfg.instance_args,
        pin_cores=cfg.pin_cores,
    )
    with Cluster(cluster_cfg) as cluster:
        if cfg.kill_every_s is None:
            traffic = asyncio.run(_run_traffic(cluster, cfg))
        else:
            policy = soak_restart_policy(cfg.kill_every_s, cfg.duration_s)
            supervisor = Supervisor(cluster, policy, on_event=_log_event)
            with supervisor.background():  # stopped before the cluster is
                traffic = asyncio.run(_run_traffic(cluster, cfg, supervisor))
    oracle = run_oracle(cfg, run_dir / "oracle", traffic, _rngs(cfg.seed)[3])
    result = _result(cfg, traffic, oracle, run_dir, date)
    path = run_dir / "result.json"
    path.write_bytes(msgspec.json.format(msgspec.json.encode(result)))
    return result, path


def _log_event(event: Event) -> None:
    print(f"soak: {describe(event)}", file=sys.stderr, flush=True)


# -- CLI ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SoakCommand:
    """The `pdserve bench soak` flags that are not a `SoakConfig` field as such:
    `pdserve.bench.soak_args` turns them into its fields."""

    duration_min: float = option(SoakConfig.duration_s / 60, help="")  # -> duration_s
    restart: bool = option(True, flag="--no-restart", help="no prefill restart")
    disable_tqdm: bool = option(False, help="")  # -> progress=False


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `pdserve bench soak` (declared on `SoakCommand`, `SoakConfig` and
    `TrafficConfig`); everything after `--` goes to every instance."""
    add_options(parser, SoakCommand, only=("duration_min",))
    add_options(parser, SoakConfig, only=("mode", "transport", "model"))
    add_options(parser, SoakConfig, only=("request_rate", "target_load"))
    add_options(parser, TrafficConfig)
    add_options(parser, SoakConfig, only=("restart_at",))
    add_options(parser, SoakCommand, only=("restart",))
    add_options(parser, SoakConfig, only=_REST)
    add_options(parser, SoakCommand, only=("disable_tqdm",))
    # A positional (options.py declares flags only): handed to `from_args` as computed.
    parser.add_argument("instance_args", nargs=argparse.REMAINDER, help="-- then instance flags")


_REST = (
    "kill_every_s",
    "kill_roles",
    "max_concurrency",
    "oracle_sample",
    "request_timeout_s",
    "drain_timeout_s",
    "seed",
    "out_dir",
    "pin_cores",
)


def run(cfg: SoakConfig) -> int:
    """Run the soak, print the summary; 1 on leaks or wrong outputs, 2 if it could not run."""
    try:
        result, path = run_soak(cfg)
    except (ClusterError, EndpointError, ValueError) as exc:
        print(f"pdserve bench soak: {exc}", file=sys.stderr)
        return 2
    print(format_summary(result))
    print(f"saved {path}; logs in {result.log_dir}")
    return exit_status(result)
