"""`pdserve bench serve`: replay a workload against an OpenAI-compatible endpoint.

Works against pdserve's router or one instance, or any other server with a streaming
`/v1/completions` or `/v1/chat/completions` (vLLM included). `run_benchmark(BenchConfig)` is
the programmatic entry (the sweep and the tests call it); `main(args)` is the CLI around it,
which takes `vllm bench serve`'s flags for the same things (docs/bench.md has the table).

A run: build the requests (random, trace, ShareGPT or custom dataset; token counts from the
server's `/tokenize` where a dataset needs them), resolve the model, send the warm-up
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
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import aiohttp
import msgspec
import numpy as np
from tqdm import tqdm

from pdserve.bench.arrivals import LOAD_GROUP, ArrivalConfig, arrival_offsets
from pdserve.bench.client import (
    ClientConfig,
    EndpointError,
    RunClock,
    TokenCounter,
    first_model,
    open_session,
    send_request,
)
from pdserve.bench.dataset import (
    WORKLOAD_GROUP,
    BenchRequest,
    CountTokens,
    MultiTurnConfig,
    RandomDatasetConfig,
    TraceError,
    estimate_tokens,
    load_custom,
    load_trace,
    sample_multiturn,
    sample_random,
    sample_random_text,
    sample_sharegpt,
    tokens_per_word,
)
from pdserve.bench.hostcpu import read_cpu_times, shares
from pdserve.bench.metrics import (
    DEFAULT_PERCENTILES,
    LATENCY_METRICS,
    SLO_METRICS,
    BenchResult,
    RequestRecord,
    compute_metrics,
    extra_percentiles,
    json_number,
    per_request_arrays,
    save_result,
)
from pdserve.options import add_options, group_titled, key_value, option

DEFAULT_NUM_PROMPTS = 100
WARMUP_MAX_TOKENS = 16  # enough to go through prefill, KV handoff and a few decode steps
COMPLETIONS_ENDPOINT = "/v1/completions"
CHAT_ENDPOINT = "/v1/chat/completions"
DATASETS = ("random", "sharegpt", "custom", "trace", "multiturn")
ENDPOINT_GROUP, OUTPUT_GROUP = "endpoint", "output"  # `--help`'s groups (with workload, load)
FILE_DATASETS = ("sharegpt", "custom", "trace")
BACKENDS = {
    "vllm": COMPLETIONS_ENDPOINT,
    "openai": COMPLETIONS_ENDPOINT,
    "openai-chat": CHAT_ENDPOINT,
}


def is_chat_endpoint(endpoint: str) -> bool:
    """Whether requests to `endpoint` take chat bodies (its path ends in chat/completions)."""
    return endpoint.split("?")[0].rstrip("/").endswith("/chat/completions")


def _metric_list(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if not names or any(n not in LATENCY_METRICS for n in names):
        raise argparse.ArgumentTypeError(
            f"not a list of metrics: {text!r} (use some of {','.join(LATENCY_METRICS)})"
        )
    return names


def _percentile_list(text: str) -> tuple[float, ...]:
    try:
        qs = tuple(float(q) for q in text.split(",") if q.strip())
    except ValueError:
        qs = ()
    if not qs or not all(0 <= q <= 100 for q in qs):
        raise argparse.ArgumentTypeError(f"not a list of percentiles in 0..100: {text!r}")
    return qs


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark run. `trace_path` None: random dataset of `num_prompts` (default 100).

    `dataset_name` None: "trace" with a `trace_path` (the file of any file dataset), else
    "random". A chat `endpoint` (.../chat/completions) gets chat bodies; its random prompts are
    text (`sample_random_text`)."""

    base_url: str = option(
        "http://127.0.0.1:8000",
        flag_default=None,
        group=ENDPOINT_GROUP,
        metavar="URL",
        help="server URL (default: http://HOST:PORT)",
    )
    endpoint: str = option(
        COMPLETIONS_ENDPOINT,
        flag_default=None,
        group=ENDPOINT_GROUP,
        help=f"path of the API (default {COMPLETIONS_ENDPOINT}, or {CHAT_ENDPOINT} with "
        "--backend openai-chat); a path ending in /chat/completions gets chat bodies",
    )
    model: str | None = option(  # None: the first model of GET /v1/models
        None, group=ENDPOINT_GROUP, help="model name sent; default: first of /v1/models"
    )
    label: str | None = option(
        None, group=OUTPUT_GROUP, help="name of the run (report series, file name)"
    )
    dataset_name: str | None = option(  # one of DATASETS
        None,
        group=WORKLOAD_GROUP,
        choices=DATASETS,
        help="random: random token ids (text words for the chat API); sharegpt: vLLM's "
        'ShareGPT JSON; custom: JSONL of {"prompt": ...}; trace: pdserve\'s JSONL trace; '
        "multiturn: conversations with a shared system prompt growing turn by turn, token "
        "ids written from --seed (default: trace with --dataset-path, else random)",
    )
    random: RandomDatasetConfig = field(default_factory=RandomDatasetConfig)
    multiturn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    trace_path: Path | None = option(
        None,
        flag="--dataset-path",
        aliases=("--trace",),
        group=WORKLOAD_GROUP,
        metavar="FILE",
        help="file of the dataset",
    )
    file_output_len: int | None = option(  # sharegpt, custom: output length for every request
        None,
        flag="--sharegpt-output-len",
        aliases=("--custom-output-len",),
        group=WORKLOAD_GROUP,
        metavar="N",
        help="sharegpt: tokens to generate instead of the reply's length; custom: for every "
        "line (default: the line's output_tokens or max_tokens, else 256)",
    )
    tokenize_url: str | None = option(  # where POST /tokenize counts tokens; None: base_url
        None,
        group=ENDPOINT_GROUP,
        metavar="URL",
        help="server whose POST /tokenize counts tokens for sharegpt lengths and random chat "
        "text (default: --base-url; pdserve's router has none, give an instance's URL); "
        "without one, 4 characters count as a token",
    )
    use_trace_timing: bool = option(  # replay a trace's arrival times when it has them
        True,
        flag="--ignore-trace-timing",
        group=WORKLOAD_GROUP,
        help="use --request-rate even if the trace has arrival times",
    )
    num_prompts: int | None = option(  # None: DEFAULT_NUM_PROMPTS, or the whole trace / custom
        None,
        group=WORKLOAD_GROUP,
        metavar="N",
        help=f"requests to send (default {DEFAULT_NUM_PROMPTS} for random and sharegpt, "
        "the whole file for trace and custom)",
    )
    arrivals: ArrivalConfig = field(default_factory=ArrivalConfig)
    max_concurrency: int | None = option(None, group=LOAD_GROUP, help="most requests in flight")
    seed: int = option(0, group=LOAD_GROUP, help="seeds prompts, warm-ups and arrivals")
    num_warmups: int = option(1, group=LOAD_GROUP, help="short requests sent first, not measured")
    goodput: tuple[tuple[str, float], ...] = option(  # (metric, ms) SLOs
        (),
        group=OUTPUT_GROUP,
        nargs="+",
        parse=str,
        metavar="NAME:MS",
        help="SLOs for goodput, e.g. ttft:500 tpot:50",
    )
    ignore_eos: bool = option(
        True,
        group=WORKLOAD_GROUP,
        negatable=True,
        help="ask the server to generate the full output length (default on)",
    )
    temperature: float | None = option(None, group=WORKLOAD_GROUP, help="default: the server's")
    request_timeout_s: float = option(
        300.0,
        flag="--request-timeout",
        group=ENDPOINT_GROUP,
        help="seconds for one whole request",
    )
    api_key: str | None = option(
        None,
        env="OPENAI_API_KEY",
        group=ENDPOINT_GROUP,
        help="bearer token (default: $OPENAI_API_KEY)",
    )
    metadata: tuple[tuple[str, str], ...] = option(  # labels saved with the result (mode=push)
        (),
        group=OUTPUT_GROUP,
        nargs="*",
        parse=key_value,
        metavar="KEY=VALUE",
        help="labels saved with the result, e.g. mode=push",
    )
    disable_tqdm: bool = option(False, group=OUTPUT_GROUP, help="no progress bar")
    percentile_metrics: tuple[str, ...] = option(  # reported with percentiles
        LATENCY_METRICS,
        group=OUTPUT_GROUP,
        parse=_metric_list,
        metavar="LIST",
        help="metrics shown in the summary, with their percentiles (default "
        f"{','.join(LATENCY_METRICS)}; vLLM's is ttft,tpot,itl)",
    )
    metric_percentiles: tuple[float, ...] = option(
        DEFAULT_PERCENTILES,
        group=OUTPUT_GROUP,
        parse=_percentile_list,
        metavar="LIST",
        help="percentiles shown and saved as p{q}_{metric}_ms (default 90,99; p90 and p99 "
        "are always saved)",
    )

    @property
    def dataset(self) -> str:
        """The dataset's name, resolved (see the class doc)."""
        return self.dataset_name or ("trace" if self.trace_path is not None else "random")

    @property
    def chat(self) -> bool:
        return is_chat_endpoint(self.endpoint)

    def __post_init__(self) -> None:
        self._check_dataset()
        if bad := [m for m in self.percentile_metrics if m not in LATENCY_METRICS]:
            raise ValueError(f"unknown percentile metrics {bad}; use {LATENCY_METRICS}")
        if not all(0 <= q <= 100 for q in self.metric_percentiles):
            raise ValueError("metric percentiles must be within 0..100")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("max_concurrency must be >= 1")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise ValueError("num_prompts must be >= 1")
        if self.num_warmups < 0 or not self.request_timeout_s > 0:
            raise ValueError("num_warmups must be >= 0 and request_timeout_s > 0")
        if bad := [name for name, _ in self.goodput if name not in SLO_METRICS]:
            raise ValueError(f"unknown goodput metrics {bad}; use {SLO_METRICS}")

    def _check_dataset(self) -> None:
        name = self.dataset
        if name not in DATASETS:
            raise ValueError(f"unknown dataset {name!r}; use one of {', '.join(DATASETS)}")
        if name in FILE_DATASETS and self.trace_path is None:
            raise ValueError(f"--dataset-name {name} needs --dataset-path FILE")
        if name in ("random", "multiturn") and self.trace_path is not None:
            raise ValueError(f"--dataset-name {name} takes no --dataset-path")
        if name == "multiturn" and self.chat:
            raise ValueError("--dataset-name multiturn is token ids: use the completions API")
        if self.file_output_len is not None and self.file_output_len < 1:
            raise ValueError("the output length of a dataset must be >= 1")


def workload_rngs(seed: int) -> tuple[np.random.Generator, ...]:
    """The (dataset, warm-up, arrival) random streams of a run with `seed`: independent,
    so changing one setting does not reshuffle the others. `pdserve sim` draws from the
    same streams to replay the same requests."""
    return tuple(np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(3))


def random_requests(
    cfg: BenchConfig, num_prompts: int, rng: np.random.Generator, count: CountTokens
) -> list[BenchRequest]:
    """Random requests: token ids, or for the chat API text of about the input length."""
    if not cfg.chat:
        return sample_random(cfg.random, num_prompts, rng)
    return sample_random_text(cfg.random, num_prompts, rng, tokens_per_word(count))


def build_requests(
    cfg: BenchConfig, rng: np.random.Generator, count: CountTokens = estimate_tokens
) -> list[BenchRequest]:
    """The measured requests, in release order; `count` counts tokens of texts where the
    dataset needs it (ShareGPT, random text)."""
    path, n = cfg.trace_path, cfg.num_prompts
    if cfg.dataset == "random":
        return random_requests(cfg, n or DEFAULT_NUM_PROMPTS, rng, count)
    if cfg.dataset == "multiturn":
        return sample_multiturn(cfg.multiturn, n or DEFAULT_NUM_PROMPTS, rng)
    assert path is not None  # checked by BenchConfig
    if cfg.dataset == "sharegpt":
        return sample_sharegpt(path, n or DEFAULT_NUM_PROMPTS, rng, count, cfg.file_output_len)
    if cfg.dataset == "custom":
        return load_custom(path, n, cfg.file_output_len)
    requests = load_trace(path, n)
    if cfg.chat and any(not isinstance(r.prompt, str) for r in requests):
        raise TraceError(f"{path}: the chat API takes text prompts, not prompt_token_ids")
    return requests


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


def _workload(
    cfg: BenchConfig,
    data_rng: np.random.Generator,
    warmup_rng: np.random.Generator,
    count: CountTokens,
) -> tuple[list[BenchRequest], list[BenchRequest]]:
    """(measured requests, warm-up requests: random ones, whatever the dataset)."""
    requests = build_requests(cfg, data_rng, count)
    if not cfg.num_warmups:
        return requests, []
    warmups = random_requests(cfg, cfg.num_warmups, warmup_rng, count)
    cap = WARMUP_MAX_TOKENS
    return requests, [
        msgspec.structs.replace(r, output_len=min(r.output_len, cap)) for r in warmups
    ]


async def _build_workload(
    http: aiohttp.ClientSession, cfg: BenchConfig, rngs: Sequence[np.random.Generator]
) -> tuple[list[BenchRequest], list[BenchRequest]]:
    """`_workload` in a thread, counting tokens with the server's /tokenize on this loop."""
    counter = TokenCounter(http, cfg.tokenize_url or cfg.base_url, cfg.model)
    loop = asyncio.get_running_loop()

    def count(texts: Sequence[str]) -> list[int]:
        return asyncio.run_coroutine_threadsafe(counter.count(texts), loop).result()

    return await asyncio.to_thread(_workload, cfg, rngs[0], rngs[1], count)


async def _warm_up(
    http: aiohttp.ClientSession, client: ClientConfig, requests: list[BenchRequest]
) -> None:
    if not requests:
        return
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
    is_random = cfg.dataset == "random"
    return {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "label": cfg.label,
        "model_id": model,
        "base_url": base_url,
        "endpoint": cfg.endpoint,
        "dataset_name": cfg.dataset,
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
        "percentile_metrics": list(cfg.percentile_metrics),
        "metric_percentiles": list(cfg.metric_percentiles),
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
        backend="openai-chat" if cfg.chat else "openai",
        host_cpu_busy=host_cpu[0],
        host_cpu_steal=host_cpu[1],
        percentiles=extra_percentiles(records, cfg.percentile_metrics, cfg.metric_percentiles),
    )


async def run_benchmark(cfg: BenchConfig) -> BenchResult:
    """Run one benchmark. Raises EndpointError if the endpoint cannot be used at all
    (no model list, every warm-up failed) and TraceError for a bad trace; failures of
    individual measured requests are counted in the result instead."""
    data_rng, warmup_rng, arrival_rng = workload_rngs(cfg.seed)
    async with _http_client(cfg) as http:
        # The dataset first: a bad file is reported before the server is asked anything.
        requests, warmups = await _build_workload(http, cfg, (data_rng, warmup_rng))
        model = cfg.model or await first_model(http, cfg.base_url)
        url = cfg.base_url.rstrip("/") + cfg.endpoint
        client = ClientConfig(
            url, model, cfg.ignore_eos, cfg.temperature, cfg.request_timeout_s, chat=cfg.chat
        )
        await _warm_up(http, client, warmups)
        offsets = release_offsets(cfg, requests, arrival_rng)
        cpu_before = read_cpu_times()
        clock = RunClock.start()
        records = await _dispatch(http, client, cfg, requests, offsets, clock)
        duration = clock.now()
        host_cpu = shares(cpu_before, read_cpu_times())
    return _result(cfg, model, requests, offsets, records, duration, clock, host_cpu)


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


@dataclass(frozen=True)
class ServerAddress:
    """The server as `vllm bench serve` names it without `--base-url` and `--endpoint`:
    `pdserve.bench.serve_args` folds these into `BenchConfig.base_url` and `endpoint`."""

    host: str = option("127.0.0.1", metavar="HOST", help="server host without --base-url")
    port: int = option(8000, metavar="N", help="server port without --base-url")
    backend: str | None = option(
        None,
        choices=tuple(sorted(BACKENDS)),
        help="API to speak, as vLLM names it: vllm and openai send completion bodies to "
        f"{COMPLETIONS_ENDPOINT}, openai-chat sends chat bodies to {CHAT_ENDPOINT} "
        "(default: what --endpoint implies)",
    )

    def endpoint(self, given: str | None) -> str:
        """The endpoint: `given` (`--endpoint`), else the backend's; ValueError if the two
        disagree on the API."""
        if given is None:
            return BACKENDS[self.backend or "openai"]
        if self.backend is not None and is_chat_endpoint(given) != (self.backend == "openai-chat"):
            raise ValueError(f"--backend {self.backend} does not speak --endpoint {given}")
        return given


@dataclass(frozen=True)
class ResultOutput:
    """Where `pdserve bench serve` saves its result JSON (nowhere unless asked)."""

    save_result: str | None = option(
        None,
        nargs="?",
        const="",
        metavar="FILE",
        help="save the result JSON, to FILE or (without FILE) to --result-filename",
    )
    result_dir: Path | None = option(
        None, metavar="DIR", help="folder of the saved result (implies --save-result)"
    )
    result_filename: str | None = option(
        None,
        metavar="NAME",
        help="file name of the saved result (implies --save-result; default "
        "{label or backend}-{rate}qps[-concurrency{N}]-{model}-{date}.json)",
    )

    def __post_init__(self) -> None:
        if self.save_result and self.result_filename:
            raise ValueError("give the file name once: --save-result FILE or --result-filename")


@dataclass(frozen=True)
class BenchProcess:
    """Where the `pdserve bench serve` client itself runs."""

    cpus: frozenset[int] | None = option(
        None,
        parse=parse_cpu_list,
        metavar="LIST",
        help="run this client on these CPUs, e.g. 0 or 0-1 or 0,2 (default: anywhere). On a "
        "small machine keep it off the decode instances' cores (pdserve up puts the router "
        "on the prefill instances' cores): a client the scheduler moves onto D's core "
        "delays D's steps and inflates the TPOT it measures",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `pdserve bench serve`: `vllm bench serve`'s names for the same things, and
    pdserve's older spellings (--input-len, --trace, ...) as aliases. Most are declared on
    the configs they set (BenchConfig, RandomDatasetConfig, MultiTurnConfig, ArrivalConfig);
    the others only shape the command line: where the server is and which API it speaks
    (ServerAddress), where the result goes (ResultOutput) and which CPUs the client runs
    on (BenchProcess)."""
    g = parser.add_argument_group(ENDPOINT_GROUP)
    add_options(g, BenchConfig, only=("base_url",))
    add_options(g, ServerAddress)
    add_options(g, BenchConfig, only=("endpoint", "model", "api_key", "request_timeout_s"))
    add_options(parser, BenchConfig, only=("tokenize_url",))
    add_options(parser, BenchConfig, only=("dataset_name",))
    add_options(parser, MultiTurnConfig)
    add_options(parser, BenchConfig, only=("trace_path", "use_trace_timing", "num_prompts"))
    add_options(parser, RandomDatasetConfig)
    add_options(parser, BenchConfig, only=("file_output_len", "ignore_eos", "temperature"))
    add_options(parser, ArrivalConfig)
    add_options(parser, BenchConfig, only=("max_concurrency", "seed", "num_warmups"))
    add_options(parser, BenchConfig, only=("goodput", "label", "metadata"))
    add_options(group_titled(parser, OUTPUT_GROUP), ResultOutput)
    add_options(parser, BenchConfig, only=_SUMMARY)
    add_options(group_titled(parser, OUTPUT_GROUP), BenchProcess)


_SUMMARY = ("percentile_metrics", "metric_percentiles", "disable_tqdm")


def default_result_filename(result: BenchResult) -> str:
    """vLLM's shape: {label or backend}-{rate}qps[-concurrency{N}]-{model}-{date}.json, with
    the model's last path part and any character other than [A-Za-z0-9._-] as '-'."""
    rate = "inf" if math.isinf(result.rate) else f"{result.rate:g}"
    concurrency = f"-concurrency{result.max_concurrency}" if result.max_concurrency else ""
    model = result.model_id.rstrip("/").split("/")[-1]
    name = f"{result.label or result.backend}-{rate}qps{concurrency}-{model}-{result.date}"
    return re.sub(r"[^A-Za-z0-9._-]", "-", name) + ".json"


def result_path(output: ResultOutput, result: BenchResult) -> Path | None:
    """Where to save the result (None: not asked): --save-result FILE, else --result-filename,
    else the default name; under --result-dir when given."""
    if output.save_result is None and output.result_dir is None and output.result_filename is None:
        return None
    name = output.save_result or output.result_filename or default_result_filename(result)
    return (output.result_dir or Path()) / name


def run(cfg: BenchConfig, output: ResultOutput, process: BenchProcess) -> int:
    """Run the benchmark on `process`'s CPUs, print the summary, save the JSON where
    `output` says. 1 if nothing completed."""
    from pdserve.bench.report import format_run  # matplotlib stays out of the import path

    try:
        if process.cpus is not None:  # before any thread starts, so every thread inherits it
            os.sched_setaffinity(0, process.cpus)
        result = asyncio.run(run_benchmark(cfg))
    except (EndpointError, TraceError, ValueError, OSError) as exc:
        print(f"pdserve bench serve: {exc}", file=sys.stderr)
        return 1
    print(format_run(result))
    if (path := result_path(output, result)) is not None:
        save_result(result, path)
        print(f"saved {path}")
    return 0 if result.completed else 1
