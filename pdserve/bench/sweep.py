"""`pdserve bench sweep`: a grid of input lengths x request rates x modes, with a report.

For each mode in turn (pull, push, monolithic by default; `mono1` is a monolithic instance
on the prefill instance's core only) the sweep starts a local cluster
with the launcher (`pdserve up`), or uses a URL given with `--base-url MODE=URL`, warms it
(two requests at each input length, one at a time), runs every (input length, rate) point
with `run_benchmark`, and stops the cluster by PID, also on Ctrl-C, SIGTERM or an error.
Every point of every mode gets the same seed (derived from `--seed`, the input length and
the rate), so all modes see identical prompts and arrival times. Each point's result is
saved as `<mode>-in<L>-r<R>.json` with metadata mode / input_len / rate / prefill_util; a
point that cannot run at all (cluster did not start or died, endpoint unusable) is
recorded as failed and the sweep goes on. With `--interleave` every mode's cluster is up
at once and the modes take turns at each point (order rotating), so that drifting
background load on a shared machine hits every mode alike. At the end `sweep.md` (table
with the prefill utilisation, push/pull ratios, failed points), `sweep.json` (the
manifest), and the generic `report.md` plus PNG plots (`report.write_report`) are written
next to the JSONs.

Utilisation (see `pdserve.bench.capacity`): offered prefill tokens/s of a point over the
prefill tokens/s one engine reaches on the prefill instance's core, measured before the
first cluster starts.

The sweep owns the clusters it starts and nothing else; endpoints given by URL are only
sent requests.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import signal
import subprocess
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

from pdserve.bench.arrivals import ArrivalConfig
from pdserve.bench.capacity import PrefillCapacity, measure_prefill_capacity, utilisation
from pdserve.bench.client import EndpointError
from pdserve.bench.dataset import RandomDatasetConfig
from pdserve.bench.metrics import BenchResult, save_result
from pdserve.bench.serve import BenchConfig, run_benchmark
from pdserve.bench.sweep_report import (
    PointOutcome,
    SweepManifest,
    SweepReportFiles,
    rate_label,
    summary_text,
    write_sweep_report,
)
from pdserve.config import TransportKind
from pdserve.launcher import Cluster, ClusterConfig, ClusterError, assign_cores
from pdserve.options import add_options, group_titled, option

# mono1: one monolithic instance on the prefill instance's core(s) alone, so its TTFT has P's
# compute and no transfer: the floor that issue 8's light-load TTFT target compares push with.
MONO1 = "mono1"
LOCAL_MODES = ("pull", "push", "monolithic", MONO1)
DEFAULT_MODES = ("pull", "push", "monolithic")
# builtin:small on one core: prefill from ~0.1 (1024 at 0.5 req/s) to ~6 (4096 at 4 req/s)
GRID_GROUP, ENDPOINTS_GROUP = "grid", "endpoints"  # `--help`'s groups
OUTPUT_GROUP = "utilisation and output"
DEFAULT_INPUT_LENS = (1024, 2048, 4096)
DEFAULT_RATES = (0.5, 1.0, 2.0, 4.0)
WARMUP_PROMPTS_PER_LEN = 2
WARMUP_OUTPUT_LEN = 8


def _mode_url(item: str) -> tuple[str, str]:
    mode, sep, url = item.partition("=")
    if not sep or not mode.strip() or not url.strip():
        raise argparse.ArgumentTypeError(f"expected MODE=URL, got {item!r}")
    return mode.strip(), url.strip()


def _len_tok_s(item: str) -> tuple[int, float]:
    length, _, tok_s = item.partition("=")
    try:
        return int(length), float(tok_s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LEN=TOKENS_PER_S, got {item!r}") from None


@dataclass(frozen=True)
class SweepConfig:
    """One sweep. `base_urls` maps a mode to a running endpoint (not started or stopped);
    other modes must be local ones (pull, push, monolithic, mono1). `prefill_tok_s` (length,
    tokens/s) gives the prefill capacity instead of measuring it; `calibrate=False` and
    no `prefill_tok_s`: no utilisation column."""

    out_dir: Path = option(
        flag="--out-dir",
        required=False,
        group=OUTPUT_GROUP,
        help="default: results/sweep-<date>-<time>",
    )
    input_lens: tuple[int, ...] = option(
        DEFAULT_INPUT_LENS,
        flag="--input-len",
        nargs="+",
        group=GRID_GROUP,
        metavar="TOKENS",
        help="prompt lengths of the grid, random tokens (default: %(default)s)",
    )
    rates: tuple[float, ...] = option(
        DEFAULT_RATES,
        flag="--request-rate",
        nargs="+",
        group=GRID_GROUP,
        metavar="REQ_S",
        help="mean arrival rates of the grid, req/s (default: %(default)s)",
    )
    modes: tuple[str, ...] = option(
        DEFAULT_MODES,
        nargs="+",
        group=GRID_GROUP,
        metavar="MODE",
        help="clusters to compare: pull, push (1P1D + router), monolithic (one instance on "
        "every core), mono1 (one instance on P's core only: the light-load TTFT floor), or "
        "any name given a --base-url (default: %(default)s)",
    )
    output_len: int = option(
        64,
        group=GRID_GROUP,
        metavar="TOKENS",
        help="tokens to generate per request (default: %(default)s)",
    )
    num_prompts: int = option(
        32, group=GRID_GROUP, help="requests per point (default: %(default)s)"
    )
    model: str = option(
        "builtin:small",
        group=ENDPOINTS_GROUP,
        help="of the local clusters: builtin:tiny|small or a checkpoint directory "
        "(default: %(default)s)",
    )
    transport: TransportKind = option(
        "tcp",
        group=ENDPOINTS_GROUP,
        help="KV transport of the local P/D clusters (default: %(default)s)",
    )
    base_urls: tuple[tuple[str, str], ...] = option(
        (),
        flag="--base-url",
        nargs="+",
        parse=_mode_url,
        group=ENDPOINTS_GROUP,
        metavar="MODE=URL",
        help="use this running endpoint for MODE instead of starting a cluster",
    )
    seed: int = option(
        0,
        group=GRID_GROUP,
        help="prompts and arrivals; every mode gets the same ones (default: %(default)s)",
    )
    burstiness: float = option(
        1.0,
        group=GRID_GROUP,
        help="gamma shape of the inter-arrival times; 1: Poisson (default: %(default)s)",
    )
    num_warmups: int = option(
        1,
        group=GRID_GROUP,
        help="requests per point before the measured ones (default: %(default)s)",
    )
    request_timeout_s: float = option(
        300.0,
        flag="--request-timeout",
        group=GRID_GROUP,
        metavar="S",
        help="a request still unanswered after S seconds counts as failed (default: %(default)s)",
    )
    instance_args: tuple[str, ...] = ()
    calibrate: bool = option(
        True, flag="--no-calibrate", group=OUTPUT_GROUP, help="no utilisation column"
    )
    prefill_tok_s: tuple[tuple[int, float], ...] = option(
        (),
        flag="--prefill-capacity",
        nargs="+",
        parse=_len_tok_s,
        group=OUTPUT_GROUP,
        metavar="LEN=TOK_S",
        help="prefill tokens/s of the P instance by input length (default: measured)",
    )
    interleave: bool = option(  # all modes up at once, alternating at each point
        False,
        group=GRID_GROUP,
        help="start every mode's cluster at once and run the modes in turn at each point "
        "(default: one mode after the other, one cluster at a time)",
    )
    disable_tqdm: bool = option(
        False, group=OUTPUT_GROUP, help="no per-request bar (off unless a terminal)"
    )

    def __post_init__(self) -> None:
        if not self.input_lens or not self.rates or not self.modes:
            raise ValueError("need at least one input length, one rate and one mode")
        if min(self.input_lens) < 1 or not min(self.rates) > 0:
            raise ValueError("input lengths must be >= 1 and rates > 0")
        for name, values in (("mode", self.modes), ("input length", self.input_lens)):
            if len(set(values)) != len(values):
                raise ValueError(f"a {name} is listed twice: {list(values)}")
        if len({rate_label(r) for r in self.rates}) != len(self.rates):
            raise ValueError(f"a rate is listed twice: {list(self.rates)}")
        urls = dict(self.base_urls)
        if bad := [m for m in self.modes if m not in LOCAL_MODES and m not in urls]:
            raise ValueError(f"modes {bad} need --base-url MODE=URL (local: {LOCAL_MODES})")

    def base_url(self, mode: str) -> str | None:
        """The given endpoint of `mode`; None: the sweep starts a local cluster."""
        return dict(self.base_urls).get(mode)


@dataclass(frozen=True)
class SweepPoint:
    """One run of the grid."""

    mode: str
    input_len: int
    rate: float

    @property
    def stem(self) -> str:
        """File name of its result, without `.json`."""
        return f"{self.mode}-in{self.input_len}-r{rate_label(self.rate)}"

    @property
    def label(self) -> str:
        return f"{self.mode} in={self.input_len} rate={rate_label(self.rate)}"


def _json_float(value: float | None) -> float | str | None:
    return "inf" if value is not None and math.isinf(value) else value


def expand_grid(cfg: SweepConfig) -> list[SweepPoint]:
    """Every point, mode by mode (one cluster each), then by input length and rate."""
    return [
        SweepPoint(mode, input_len, rate)
        for mode in cfg.modes
        for input_len in cfg.input_lens
        for rate in cfg.rates
    ]


def point_seed(seed: int, input_len: int, rate: float) -> int:
    """The benchmark seed of a point: equal across modes, different across points (so a
    server with a prefix cache never sees a prompt of an earlier point again)."""
    return zlib.crc32(f"{seed}/{input_len}/{rate_label(rate)}".encode())


def point_metadata(point: SweepPoint, util: float | None) -> tuple[tuple[str, str], ...]:
    """Labels saved in the point's result JSON; the report groups series by `mode`."""
    meta = [("mode", point.mode), ("input_len", str(point.input_len))]
    meta.append(("rate", rate_label(point.rate)))
    if util is not None:
        meta.append(("prefill_util", "inf" if math.isinf(util) else f"{util:.3f}"))
    return tuple(meta)


def bench_config(
    cfg: SweepConfig, point: SweepPoint, base_url: str, util: float | None
) -> BenchConfig:
    """The `bench serve` run of a point."""
    return BenchConfig(
        base_url=base_url,
        random=RandomDatasetConfig(input_len=point.input_len, output_len=cfg.output_len),
        num_prompts=cfg.num_prompts,
        arrivals=ArrivalConfig(request_rate=point.rate, burstiness=cfg.burstiness),
        seed=point_seed(cfg.seed, point.input_len, point.rate),
        num_warmups=cfg.num_warmups,
        request_timeout_s=cfg.request_timeout_s,
        metadata=point_metadata(point, util),
        disable_tqdm=cfg.disable_tqdm,
    )


def cluster_config(cfg: SweepConfig, mode: str, log_dir: Path) -> ClusterConfig:
    """The local cluster of a mode: 1 P + 1 D + router, one monolithic instance on every
    core, or (mono1) one on the prefill instance's cores."""
    mono = mode in ("monolithic", MONO1)
    return ClusterConfig(
        kv_transfer=None if mono else mode,  # type: ignore[arg-type]
        cores=prefill_cores() if mode == MONO1 else None,
        transport=cfg.transport,  # type: ignore[arg-type]
        model=cfg.model,
        port=None,
        log_dir=log_dir,
        instance_args=cfg.instance_args,
        request_timeout_s=cfg.request_timeout_s,
        # The sweep compares the transfer modes: every prompt is disaggregated, however short.
        local_prefill_below=0,
    )


@contextlib.contextmanager
def endpoint(cfg: SweepConfig, mode: str) -> Iterator[tuple[str, Cluster | None]]:
    """(URL, cluster) of a mode for the duration of the block; a local cluster is started
    here and stopped by PID on exit, whatever the exit (Cluster.start cleans up itself)."""
    url = cfg.base_url(mode)
    if url is not None:
        yield url, None
        return
    with Cluster(cluster_config(cfg, mode, cfg.out_dir / "logs" / mode)) as cluster:
        yield cluster.router_url, cluster


def warm_up(cfg: SweepConfig, base_url: str) -> None:
    """A few short requests at each input length, one at a time, so the first point does
    not pay first-use costs (allocations at new sizes, KV-transport handshakes).
    Raises EndpointError if none of them completes."""
    for input_len in cfg.input_lens:
        warm = BenchConfig(
            base_url=base_url,
            random=RandomDatasetConfig(input_len=input_len, output_len=WARMUP_OUTPUT_LEN),
            num_prompts=WARMUP_PROMPTS_PER_LEN,
            max_concurrency=1,
            num_warmups=0,
            seed=cfg.seed + 1,
            request_timeout_s=cfg.request_timeout_s,
            disable_tqdm=True,
        )
        result = asyncio.run(run_benchmark(warm))
        if result.completed == 0:
            raise EndpointError(f"warm-up at input {input_len} failed: {result.errors[0]}")


def prefill_cores() -> tuple[int, ...] | None:
    """The cores the launcher gives the prefill instance of a 1P1D cluster; None when it
    would not pin (fewer than 2 cores)."""
    shares = assign_cores(2, sorted(os.sched_getaffinity(0)))
    return shares[0] if shares else None


def prefill_capacity(cfg: SweepConfig) -> PrefillCapacity | None:
    """Given or measured capacity; None when neither (no utilisation column).

    Measured on the core the launcher gives the prefill instance of a 1P1D cluster, with
    as many threads as it gets, before any cluster runs."""
    if cfg.prefill_tok_s:
        return PrefillCapacity(model=cfg.model, threads=0, tok_s=dict(cfg.prefill_tok_s))
    if not cfg.calibrate:
        return None
    cores = prefill_cores()
    threads = len(cores) if cores else 1
    return measure_prefill_capacity(cfg.model, cfg.input_lens, threads=threads, cores=cores)


Progress = Callable[[str], None]


def _outcome(
    point: SweepPoint, util: float | None, result: BenchResult | None, **kw: str | None
) -> PointOutcome:
    return PointOutcome(
        mode=point.mode,
        input_len=point.input_len,
        rate=_json_float(point.rate),  # type: ignore[arg-type]
        prefill_util=_json_float(util),
        completed=result.completed if result else 0,
        failed=result.failed if result else 0,
        **kw,
    )


def _point_line(n: int, total: int, point: SweepPoint, util: float | None) -> str:
    u = "-" if util is None else ("inf" if math.isinf(util) else f"{util:.2f}")
    return f"[{n}/{total}] {point.label} (P util {u}): "


def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.0f} ms" if value >= 100 else f"{value:.1f} ms"


def _result_summary(r: BenchResult) -> str:
    return (
        f"{r.completed} ok / {r.failed} failed, TTFT p50 {_ms(r.median_ttft_ms)} "
        f"p99 {_ms(r.p99_ttft_ms)}, TPOT p50 {_ms(r.median_tpot_ms)}, {r.duration:.1f} s"
    )


@dataclass
class SweepRun:
    """A sweep while it runs: owns the manifest being filled and the results so far."""

    cfg: SweepConfig
    capacity: PrefillCapacity | None
    manifest: SweepManifest
    progress: Progress
    results: list[BenchResult] = field(default_factory=list)
    recorded: set[SweepPoint] = field(default_factory=set)

    def util(self, point: SweepPoint) -> float | None:
        return utilisation(point.input_len, point.rate, self.capacity)

    def _record(self, point: SweepPoint, result: BenchResult | None, **kw: str | None) -> str:
        """Add the point's outcome; returns the head of its progress line."""
        self.recorded.add(point)
        util = self.util(point)
        self.manifest.points.append(_outcome(point, util, result, **kw))
        return _point_line(len(self.recorded), self.total, point, util)

    @property
    def total(self) -> int:
        return len(self.cfg.modes) * len(self.cfg.input_lens) * len(self.cfg.rates)

    def fail(self, point: SweepPoint, error: str) -> None:
        """Record a point that could not run at all."""
        head = self._record(point, None, error=error)
        self.progress(f"{head}FAILED {error.splitlines()[0] if error else ''}")

    def run_point(self, point: SweepPoint, url: str) -> None:
        """Run, save and record one point; any error is recorded, not raised, so that the
        sweep goes on (a KeyboardInterrupt still stops it)."""
        try:
            cfg = bench_config(self.cfg, point, url, self.util(point))
            result = asyncio.run(run_benchmark(cfg))
        except Exception as exc:  # one bad point must not end the sweep
            self.fail(point, f"{type(exc).__name__}: {exc}")
            return
        path = self.cfg.out_dir / f"{point.stem}.json"
        save_result(result, path)
        self.results.append(result)
        head = self._record(point, result, result_file=path.name)
        self.progress(head + _result_summary(result))

    def _fail_rest(self, mode: str, error: str) -> None:
        for point in expand_grid(self.cfg):
            if point.mode == mode and point not in self.recorded:
                self.fail(point, error)

    def start_endpoint(
        self, stack: contextlib.ExitStack, mode: str
    ) -> tuple[str, Cluster | None] | None:
        """Start (or reach) and warm the mode's endpoint, kept until `stack` closes. If it
        cannot start or be used, it is stopped at once, its points are recorded as failed
        and None is returned."""
        self.progress(f"== {mode}: {self.cfg.base_url(mode) or 'starting a local cluster'}")
        try:
            with contextlib.ExitStack() as this:
                url, cluster = this.enter_context(endpoint(self.cfg, mode))
                warm_up(self.cfg, url)
                stack.push(this.pop_all())
        except (ClusterError, EndpointError, OSError, ValueError) as exc:
            self._fail_rest(mode, f"{type(exc).__name__}: {exc}")
            return None
        return url, cluster

    def run_on(self, point: SweepPoint, url: str, cluster: Cluster | None) -> None:
        """Run a point, unless a process of its cluster has died (then it fails)."""
        dead = cluster.first_dead() if cluster is not None else None
        if dead is None:
            self.run_point(point, url)
            return
        code = dead.popen.returncode
        self.fail(point, f"ClusterError: {dead.name} exited ({code}); log {dead.log_path}")

    def run_mode(self, mode: str) -> None:
        """One mode's endpoint up, all its points, then stopped."""
        with contextlib.ExitStack() as stack:
            opened = self.start_endpoint(stack, mode)
            if opened is None:
                return
            for point in expand_grid(self.cfg):
                if point.mode == mode:
                    self.run_on(point, *opened)

    def run_interleaved(self) -> None:
        """Every mode's endpoint up at once; at each (input length, rate) every mode runs
        in turn, the order rotating from one point to the next, so that a change in the
        machine's background load hits all modes alike instead of one mode's stretch."""
        with contextlib.ExitStack() as stack:
            opened = {m: ep for m in self.cfg.modes if (ep := self.start_endpoint(stack, m))}
            modes = [m for m in self.cfg.modes if m in opened]
            grid = [(n, r) for n in self.cfg.input_lens for r in self.cfg.rates]
            for i, (input_len, rate) in enumerate(grid):
                for mode in modes[i % len(modes) :] + modes[: i % len(modes)]:
                    self.run_on(SweepPoint(mode, input_len, rate), *opened[mode])


def run_sweep(
    cfg: SweepConfig, progress: Progress = print, command: str = ""
) -> tuple[SweepManifest, list[BenchResult]]:
    """Run the whole sweep; returns the manifest and the results (failed points have
    none). Ctrl-C (KeyboardInterrupt) stops it: the running cluster is stopped, the
    manifest is marked interrupted, and what ran so far is returned."""
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    manifest = _manifest(cfg, command)
    try:
        manifest.capacity = prefill_capacity(cfg)
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        manifest.capacity_error = str(exc)
        progress(f"prefill capacity not measured: {exc}")
    if manifest.capacity is not None:
        tok_s = ", ".join(f"{n}: {t:.0f}" for n, t in sorted(manifest.capacity.tok_s.items()))
        progress(f"prefill capacity, tokens/s by input length: {tok_s}")
    run = SweepRun(cfg, manifest.capacity, manifest, progress)
    try:
        if cfg.interleave:
            run.run_interleaved()
        else:
            for mode in cfg.modes:
                run.run_mode(mode)
    except KeyboardInterrupt:
        manifest.interrupted = True
        progress("interrupted: cluster stopped; reporting the points that ran")
    return manifest, run.results


def _manifest(cfg: SweepConfig, command: str) -> SweepManifest:
    return SweepManifest(
        date=datetime.now().astimezone().isoformat(timespec="seconds"),
        command=command,
        model=cfg.model,
        transport=cfg.transport,
        modes=list(cfg.modes),
        input_lens=list(cfg.input_lens),
        rates=[_json_float(r) for r in cfg.rates],  # type: ignore[misc]
        output_len=cfg.output_len,
        num_prompts=cfg.num_prompts,
        seed=cfg.seed,
        burstiness=_json_float(cfg.burstiness),  # type: ignore[arg-type]
        base_urls=dict(cfg.base_urls),
    )


# -- the `pdserve bench sweep` command -------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `pdserve bench sweep` (declared on `SweepConfig`); everything after `--` goes
    to every local instance."""
    add_options(parser, SweepConfig, only=_GRID)
    add_options(parser, SweepConfig, only=("model", "transport", "base_urls"))
    # A positional (options.py declares flags only): handed to `from_args` as computed.
    group_titled(parser, ENDPOINTS_GROUP).add_argument(
        "instance_args", nargs=argparse.REMAINDER, help="-- then extra arguments for instances"
    )
    add_options(parser, SweepConfig, only=_OUTPUT)


_GRID = (
    "input_lens",
    "rates",
    "modes",
    "output_len",
    "num_prompts",
    "burstiness",
    "seed",
    "num_warmups",
    "request_timeout_s",
    "interleave",
)
_OUTPUT = ("prefill_tok_s", "calibrate", "out_dir", "disable_tqdm")


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Within the block SIGTERM and SIGHUP raise KeyboardInterrupt like Ctrl-C, so a killed
    sweep still stops its cluster."""

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    previous = {s: signal.signal(s, interrupt) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def sweep_and_report(
    cfg: SweepConfig, command: str, progress: Progress = print
) -> tuple[SweepManifest, SweepReportFiles]:
    """Run the sweep, write its report, print the summary and where the files are."""
    with sigterm_as_interrupt():
        manifest, results = run_sweep(cfg, progress, command)
    files = write_sweep_report(manifest, results, cfg.out_dir)
    progress("\n" + summary_text(manifest, results))
    progress(f"\nresults and report in {cfg.out_dir}/: {files.markdown.name}, {len(results)} JSON")
    for plot in files.plots:
        progress(f"plot: {plot}")
    return manifest, files


def run(cfg: SweepConfig, command: str) -> int:
    """Run the sweep and its report (`command`: the command line it records); 0 when every
    point ran with no failed request, 1 otherwise, 130 if interrupted."""
    manifest, _ = sweep_and_report(cfg, command)
    if manifest.interrupted:
        return 130
    clean = all(p.error is None and p.failed == 0 for p in manifest.points)
    return 0 if clean else 1
