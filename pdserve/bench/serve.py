"""`pdserve bench serve`: replay a workload against an OpenAI-compatible endpoint.

Works against pdserve's router or one instance, or any other server with a streaming
`/v1/completions` (vLLM included). `run_benchmark(BenchConfig)` is the programmatic entry
(the sweep and the tests call it); `main(args)` is the CLI around it.

A run: build the requests (random dataset or trace), resolve the model, send the warm-up
requests one after another (they pay first-request costs such as KV-transport handshakes and
use their own random prompts so they warm no prefix cache for the measured ones), then
release the measured requests on the arrival schedule, at most `max_concurrency` in flight,
and aggregate. The random streams of dataset, warm-ups and arrivals are spawned from `seed`
independently, so changing one setting does not reshuffle the others.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import sys
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import aiohttp
import msgspec
import numpy as np
from tqdm import tqdm

from pdserve.bench.arrivals import ArrivalConfig, arrival_offsets
from pdserve.bench.client import (
    ClientConfig,
    EndpointError,
    RunClock,
    first_model,
    open_session,
    send_request,
)
from pdserve.bench.dataset import (
    BenchRequest,
    RandomDatasetConfig,
    TraceError,
    load_trace,
    sample_random,
)
from pdserve.bench.hostcpu import read_cpu_times, shares
from pdserve.bench.metrics import (
    SLO_METRICS,
    BenchResult,
    RequestRecord,
    compute_metrics,
    json_number,
    parse_goodput,
    per_request_arrays,
    save_result,
)

DEFAULT_NUM_PROMPTS = 100
WARMUP_MAX_TOKENS = 16  # enough to go through prefill, KV handoff and a few decode steps


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark run. `trace_path` None: random dataset of `num_prompts` (default 100)."""

    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = "/v1/completions"
    model: str | None = None  # None: the first model of GET /v1/models
    label: str | None = None
    random: RandomDatasetConfig = field(default_factory=RandomDatasetConfig)
    trace_path: Path | None = None
    use_trace_timing: bool = True  # replay a trace's arrival times when it has them
    num_prompts: int | None = None  # None: DEFAULT_NUM_PROMPTS, or the whole trace
    arrivals: ArrivalConfig = field(default_factory=ArrivalConfig)
    max_concurrency: int | None = None
    seed: int = 0
    num_warmups: int = 1
    goodput: tuple[tuple[str, float], ...] = ()  # (metric, ms) SLOs
    ignore_eos: bool = True
    temperature: float | None = None
    request_timeout_s: float = 300.0
    api_key: str | None = None
    metadata: tuple[tuple[str, str], ...] = ()  # labels saved with the result (mode=push)
    disable_tqdm: bool = False

    def __post_init__(self) -> None:
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("max_concurrency must be >= 1")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise ValueError("num_prompts must be >= 1")
        if self.num_warmups < 0 or not self.request_timeout_s > 0:
            raise ValueError("num_warmups must be >= 0 and request_timeout_s > 0")
        if bad := [name for name, _ in self.goodput if name not in SLO_METRICS]:
            raise ValueError(f"unknown goodput metrics {bad}; use {SLO_METRICS}")


def workload_rngs(seed: int) -> tuple[np.random.Generator, ...]:
    """The (dataset, warm-up, arrival) random streams of a run with `seed`: independent,
    so changing one setting does not reshuffle the others. `pdserve sim` draws from the
    same streams to replay the same requests."""
    return tuple(np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(3))


def build_requests(cfg: BenchConfig, rng: np.random.Generator) -> list[BenchRequest]:
    """The measured requests, in release order."""
    if cfg.trace_path is not None:
        return load_trace(cfg.trace_path, cfg.num_prompts)
    return sample_random(cfg.random, cfg.num_prompts or DEFAULT_NUM_PROMPTS, rng)


def _trace_timed(cfg: BenchConfig, requests: list[BenchRequest]) -> bool:
    return cfg.use_trace_timing and requests[0].arrival_offset_s is not None


def release_offsets(
    cfg: BenchConfig, requests: list[BenchRequest], rng: np.random.Generator
) -> np.ndarray:
    """Seconds from the run start at which each request is released."""
    if _trace_timed(cfg, requests):
        return np.asarray([r.arrival_offset_s or 0.0 for r in requests])
    return arrival_offsets(len(requests), cfg.arrivals, rng)


def _http_client(cfg: BenchConfig) -> aiohttp.ClientSession:
    headers = {"authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    return open_session(cfg.request_timeout_s, cfg.max_concurrency, headers)


async def _warm_up(
    http: aiohttp.ClientSession, client: ClientConfig, cfg: BenchConfig, rng: np.random.Generator
) -> None:
    if cfg.num_warmups == 0:
        return
    requests = [
        msgspec.structs.replace(r, output_len=min(r.output_len, WARMUP_MAX_TOKENS))
        for r in sample_random(cfg.random, cfg.num_warmups, rng)
    ]
    clock = RunClock.start()
    errors = [(await send_request(http, client, r, clock)).error for r in requests]
    if all(errors):
        raise EndpointError(f"all {len(errors)} warm-up requests failed; first: {errors[0]}")


async def _dispatch(
    http: aiohttp.ClientSession,
    client: ClientConfig,
    cfg: BenchConfig,
    requests: list[BenchRequest],
    offsets: np.ndarray,
    clock: RunClock,
) -> list[RequestRecord]:
    """Release requests at their offsets; each waits for a concurrency slot, then is sent."""
    slots = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None

    with tqdm(total=len(requests), disable=cfg.disable_tqdm, unit="req", file=sys.stderr) as bar:

        async def one(req: BenchRequest, arrival: float) -> RequestRecord:
            async with slots or contextlib.nullcontext():
                record = await send_request(http, client, req, clock, arrival)
            bar.update(1)
            return record

        tasks = []
        for req, offset in zip(requests, offsets.tolist(), strict=True):
            delay = offset - clock.now()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(req, clock.now())))
        return list(await asyncio.gather(*tasks))


def _offered(
    cfg: BenchConfig, requests: list[BenchRequest], offsets: np.ndarray
) -> tuple[float | str, float | str | None]:
    """(request_rate, burstiness) as saved; a timed trace saves its mean rate and None."""
    if not _trace_timed(cfg, requests):
        return json_number(cfg.arrivals.request_rate), json_number(cfg.arrivals.burstiness)
    span = float(offsets[-1] - offsets[0]) if len(offsets) > 1 else 0.0
    return json_number((len(offsets) - 1) / span if span > 0 else math.inf), None


def result_header(
    cfg: BenchConfig,
    requests: list[BenchRequest],
    offsets: np.ndarray,
    *,
    model: str,
    base_url: str,
    start_time_unix: float,
) -> dict[str, object]:
    """A result's fields that describe the run rather than measure it (workload, seed,
    labels, date), as keyword arguments of `BenchResult`. `pdserve sim` builds its results
    with the same function so simulated and measured JSONs have the same header."""
    rate, burstiness = _offered(cfg, requests, offsets)
    is_random = cfg.trace_path is None
    return {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "label": cfg.label,
        "model_id": model,
        "base_url": base_url,
        "endpoint": cfg.endpoint,
        "dataset_name": "random" if is_random else "trace",
        "dataset_path": None if is_random else str(cfg.trace_path),
        "num_prompts": len(requests),
        "input_len": cfg.random.input_len if is_random else None,
        "output_len": cfg.random.output_len if is_random else None,
        "range_ratio": cfg.random.range_ratio if is_random else None,
        "request_rate": rate,
        "burstiness": burstiness,
        "max_concurrency": cfg.max_concurrency,
        "seed": cfg.seed,
        "num_warmups": cfg.num_warmups,
        "goodput_config": dict(cfg.goodput) or None,
        "metadata": dict(cfg.metadata),
        "start_time_unix": start_time_unix,
    }


def _result(
    cfg: BenchConfig,
    model: str,
    requests: list[BenchRequest],
    offsets: np.ndarray,
    records: list[RequestRecord],
    duration: float,
    clock: RunClock,
    host_cpu: tuple[float | None, float | None],
) -> BenchResult:
    return BenchResult(
        **msgspec.structs.asdict(compute_metrics(records, duration, dict(cfg.goodput))),
        **per_request_arrays(records),
        **result_header(
            cfg, requests, offsets, model=model, base_url=cfg.base_url, start_time_unix=clock.unix0
        ),
        host_cpu_busy=host_cpu[0],
        host_cpu_steal=host_cpu[1],
    )


async def run_benchmark(cfg: BenchConfig) -> BenchResult:
    """Run one benchmark. Raises EndpointError if the endpoint cannot be used at all
    (no model list, every warm-up failed) and TraceError for a bad trace; failures of
    individual measured requests are counted in the result instead."""
    data_rng, warmup_rng, arrival_rng = workload_rngs(cfg.seed)
    requests = build_requests(cfg, data_rng)
    async with _http_client(cfg) as http:
        model = cfg.model or await first_model(http, cfg.base_url)
        url = cfg.base_url.rstrip("/") + cfg.endpoint
        client = ClientConfig(url, model, cfg.ignore_eos, cfg.temperature, cfg.request_timeout_s)
        await _warm_up(http, client, cfg, warmup_rng)
        offsets = release_offsets(cfg, requests, arrival_rng)
        cpu_before = read_cpu_times()
        clock = RunClock.start()
        records = await _dispatch(http, client, cfg, requests, offsets, clock)
        duration = clock.now()
        host_cpu = shares(cpu_before, read_cpu_times())
    return _result(cfg, model, requests, offsets, records, duration, clock, host_cpu)


def _key_value(item: str) -> tuple[str, str]:
    key, sep, value = item.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {item!r}")
    return key.strip(), value.strip()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `pdserve bench serve` (names follow `vllm bench serve` where they exist)."""
    target = parser.add_argument_group("endpoint")
    target.add_argument("--base-url", default="http://127.0.0.1:8000")
    target.add_argument("--endpoint", default="/v1/completions")
    target.add_argument("--model", default=None, help="default: first model of /v1/models")
    target.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    target.add_argument("--request-timeout", type=float, default=300.0, help="s per request")

    data = parser.add_argument_group("workload")
    data.add_argument(
        "--dataset-path",
        "--trace",
        type=Path,
        default=None,
        help="JSONL trace; default: the random dataset",
    )
    data.add_argument(
        "--ignore-trace-timing",
        action="store_true",
        help="use --request-rate even if the trace has arrival times",
    )
    data.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help=f"default {DEFAULT_NUM_PROMPTS} (random) or the whole trace",
    )
    data.add_argument("--input-len", type=int, default=1024)
    data.add_argument("--output-len", type=int, default=128)
    data.add_argument("--range-ratio", type=float, default=0.0)
    data.add_argument("--vocab-size", type=int, default=256, help="random ids are below this")
    data.add_argument("--token-offset", type=int, default=10, help="lowest random token id")
    data.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    data.add_argument("--temperature", type=float, default=None)

    load = parser.add_argument_group("load")
    load.add_argument("--request-rate", type=float, default=math.inf, help="req/s; inf: all")
    load.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1: Poisson")
    load.add_argument("--max-concurrency", type=int, default=None)
    load.add_argument("--seed", type=int, default=0)
    load.add_argument("--num-warmups", type=int, default=1)

    out = parser.add_argument_group("output")
    out.add_argument(
        "--goodput",
        nargs="+",
        default=[],
        metavar="NAME:MS",
        help="SLOs for goodput, e.g. ttft:500 tpot:50",
    )
    out.add_argument("--label", default=None)
    out.add_argument("--metadata", nargs="*", type=_key_value, default=[], metavar="KEY=VALUE")
    out.add_argument("--save-result", type=Path, default=None, metavar="FILE")
    out.add_argument("--disable-tqdm", action="store_true")
    out.add_argument(
        "--cpus",
        type=parse_cpu_list,
        default=None,
        metavar="LIST",
        help="run this client on these CPUs, e.g. 0 or 0-1 or 0,2 (default: anywhere). On a "
        "small machine keep it off the decode instances' cores (pdserve up puts the router "
        "on the prefill instances' cores): a client the scheduler moves onto D's core "
        "delays D's steps and inflates the TPOT it measures",
    )


def parse_cpu_list(text: str) -> frozenset[int]:
    """CPUs from `0`, `0-3`, `0,2` or a mix (as `taskset -c` takes them)."""
    bad = argparse.ArgumentTypeError(f"not a CPU list: {text!r} (e.g. 0 or 0-1 or 0,2)")
    cpus: set[int] = set()
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise bad
        cpus.update(range(int(first), int(last or first) + 1))
    if not cpus:
        raise bad
    return frozenset(cpus)


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """BenchConfig from parsed flags; ValueError for an invalid combination."""
    return BenchConfig(
        base_url=args.base_url,
        endpoint=args.endpoint,
        model=args.model,
        label=args.label,
        random=RandomDatasetConfig(
            input_len=args.input_len,
            output_len=args.output_len,
            range_ratio=args.range_ratio,
            vocab_size=args.vocab_size,
            token_offset=args.token_offset,
        ),
        trace_path=args.dataset_path,
        use_trace_timing=not args.ignore_trace_timing,
        num_prompts=args.num_prompts,
        arrivals=ArrivalConfig(request_rate=args.request_rate, burstiness=args.burstiness),
        max_concurrency=args.max_concurrency,
        seed=args.seed,
        num_warmups=args.num_warmups,
        goodput=tuple(parse_goodput(args.goodput).items()),
        ignore_eos=args.ignore_eos,
        temperature=args.temperature,
        request_timeout_s=args.request_timeout,
        api_key=args.api_key,
        metadata=tuple(args.metadata),
        disable_tqdm=args.disable_tqdm,
    )


def main(args: argparse.Namespace) -> int:
    """Run, print the summary, save the JSON if asked. 1 if nothing completed."""
    from pdserve.bench.report import format_run  # matplotlib stays out of the import path

    try:
        if args.cpus is not None:  # before any thread starts, so every thread inherits it
            os.sched_setaffinity(0, args.cpus)
        cfg = config_from_args(args)
        result = asyncio.run(run_benchmark(cfg))
    except (EndpointError, TraceError, ValueError, OSError) as exc:
        print(f"pdserve bench serve: {exc}", file=sys.stderr)
        return 1
    print(format_run(result))
    if args.save_result is not None:
        save_result(result, args.save_result)
        print(f"saved {args.save_result}")
    return 0 if result.completed else 1
