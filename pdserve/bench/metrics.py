"""Serving metrics from per-request client measurements, and the result JSON schema.

Definitions (vLLM's `bench serve`, so numbers compare with it):
- TTFT: first streamed token chunk minus send time.
- ITL: gaps between successive token chunks of a request (all requests pooled).
- E2EL: last token chunk minus send time.
- TPOT: (E2EL - TTFT) / (output_tokens - 1), only for requests with more than one token.
- Goodput: completed requests per second that meet every SLO given (a request with one
  output token counts as TPOT 0 against a TPOT SLO).
- Handoff (pdserve's P/D addition): first token at the client minus the prefill instance's
  reported prefill-done time; summarised only over requests that reported it.
Statistics are mean, median, population std, p90 and p99 (numpy's linear interpolation), in
milliseconds; None when no request contributed a sample. Other percentiles can be asked for
(`--metric-percentiles`): they are saved as vLLM names them, `p{q}_{metric}_ms` (e.g.
`p50_ttft_ms`, `p99.9_itl_ms`), next to the fixed keys.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import msgspec
import numpy as np

SLO_METRICS = ("ttft", "tpot", "e2el")
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el", "handoff")
DEFAULT_PERCENTILES = (90.0, 99.0)  # the fixed p90/p99 keys
_PERCENTILE_KEY = re.compile(r"^p\d+(\.\d+)?_(" + "|".join(LATENCY_METRICS) + r")_ms$")


class RequestRecord(msgspec.Struct, kw_only=True):
    """What the client measured for one request. Times in seconds.

    `arrival_time` (released by the arrival process) and `start_time` (sent, after any
    max-concurrency wait) are offsets from the run start; ttft/latency/itl are durations.
    `output_len` is the server's usage.completion_tokens, or the number of token chunks
    when the server reports no usage. A failed request has `error` set and no timings.
    """

    success: bool
    error: str | None = None
    prompt_len: int | None = None
    output_len: int = 0
    arrival_time: float = 0.0
    start_time: float = 0.0
    ttft: float | None = None
    itl: list[float] = msgspec.field(default_factory=list)
    latency: float | None = None
    handoff: float | None = None
    generated_text: str = ""

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; None below two tokens."""
        if not self.success or self.output_len < 2 or self.latency is None or self.ttft is None:
            return None
        return (self.latency - self.ttft) / (self.output_len - 1)


class LatencyStats(msgspec.Struct, frozen=True):
    """Summary of one latency metric, milliseconds."""

    mean: float
    median: float
    std: float
    p90: float
    p99: float


def latency_stats(values_s: Sequence[float]) -> LatencyStats | None:
    """Stats in ms of durations given in seconds; None for no samples."""
    if not values_s:
        return None
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    p90, p99 = np.percentile(ms, [90, 99])
    return LatencyStats(
        mean=float(ms.mean()),
        median=float(np.median(ms)),
        std=float(ms.std()),
        p90=float(p90),
        p99=float(p99),
    )


def parse_goodput(items: Sequence[str]) -> dict[str, float]:
    """Parse SLOs like ["ttft:500", "tpot:50"] (also "ttft:500,tpot:50") into ms per metric."""
    slos: dict[str, float] = {}
    for item in (part for raw in items for part in raw.split(",") if part.strip()):
        name, sep, value = item.strip().partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"bad goodput SLO {item!r}: use NAME:MS with NAME in {SLO_METRICS}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"bad goodput SLO {item!r}: {value!r} is not a number") from None
        if not slos[name] >= 0:
            raise ValueError(f"bad goodput SLO {item!r}: must be >= 0 ms")
    return slos


def meets_slos(rec: RequestRecord, slos: Mapping[str, float]) -> bool:
    """Whether a completed request meets every SLO (ms)."""
    observed = {"ttft": rec.ttft, "tpot": rec.tpot or 0.0, "e2el": rec.latency}
    return all(
        observed[name] is not None and observed[name] * 1000.0 <= limit
        for name, limit in slos.items()
    )


class BenchMetrics(msgspec.Struct, kw_only=True):
    """Aggregate metrics of one run; key names follow vLLM's result JSON."""

    duration: float
    completed: int
    failed: int
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    request_goodput: float | None
    output_throughput: float
    total_token_throughput: float
    max_output_tokens_per_s: float
    max_concurrent_requests: int
    mean_ttft_ms: float | None = None
    median_ttft_ms: float | None = None
    std_ttft_ms: float | None = None
    p90_ttft_ms: float | None = None
    p99_ttft_ms: float | None = None
    mean_tpot_ms: float | None = None
    median_tpot_ms: float | None = None
    std_tpot_ms: float | None = None
    p90_tpot_ms: float | None = None
    p99_tpot_ms: float | None = None
    mean_itl_ms: float | None = None
    median_itl_ms: float | None = None
    std_itl_ms: float | None = None
    p90_itl_ms: float | None = None
    p99_itl_ms: float | None = None
    mean_e2el_ms: float | None = None
    median_e2el_ms: float | None = None
    std_e2el_ms: float | None = None
    p90_e2el_ms: float | None = None
    p99_e2el_ms: float | None = None
    mean_handoff_ms: float | None = None
    median_handoff_ms: float | None = None
    std_handoff_ms: float | None = None
    p90_handoff_ms: float | None = None
    p99_handoff_ms: float | None = None


def percentile_key(metric: str, q: float) -> str:
    """The result key of percentile `q` of a metric, as vLLM names it: p99_ttft_ms, p99.9_itl_ms."""
    return f"p{int(q) if q == int(q) else q}_{metric}_ms"


def metric_samples(records: Sequence[RequestRecord], metric: str) -> list[float]:
    """A latency metric's samples (seconds) over the completed requests."""
    done = [r for r in records if r.success]
    if metric == "itl":
        return [gap for r in done for gap in r.itl]
    values = {
        "ttft": lambda r: r.ttft,
        "tpot": lambda r: r.tpot,
        "e2el": lambda r: r.latency,
        "handoff": lambda r: r.handoff,
    }[metric]
    return [v for r in done if (v := values(r)) is not None]


def extra_percentiles(
    records: Sequence[RequestRecord], metrics: Sequence[str], percentiles: Sequence[float]
) -> dict[str, float | None]:
    """The asked-for percentiles (ms) that have no fixed key (p90, p99), by result key."""
    wanted = [q for q in percentiles if q not in DEFAULT_PERCENTILES]
    out: dict[str, float | None] = {}
    for metric in metrics if wanted else ():
        samples = np.asarray(metric_samples(records, metric), dtype=np.float64) * 1000.0
        values = np.percentile(samples, wanted).tolist() if samples.size else [None] * len(wanted)
        out.update({percentile_key(metric, q): v for q, v in zip(wanted, values, strict=True)})
    return out


def _flat(name: str, stats: LatencyStats | None) -> dict[str, float | None]:
    fields = ("mean", "median", "std", "p90", "p99")
    return {f"{f}_{name}_ms": None if stats is None else getattr(stats, f) for f in fields}


def _token_times(rec: RequestRecord) -> np.ndarray:
    assert rec.ttft is not None
    return rec.start_time + rec.ttft + np.concatenate([[0.0], np.cumsum(rec.itl)])


def peak_output_rate(done: Sequence[RequestRecord]) -> float:
    """Most token chunks received in any one-second bucket since the first send."""
    if not done:
        return 0.0
    origin = min(r.start_time for r in done)
    buckets = np.concatenate([_token_times(r) - origin for r in done]).astype(np.int64)
    return float(np.bincount(buckets).max())


def peak_concurrency(done: Sequence[RequestRecord]) -> int:
    """Most requests in flight at once, over the half-open intervals [send, last token)."""
    events = sorted(
        [(r.start_time, 1) for r in done] + [(r.start_time + (r.latency or 0.0), -1) for r in done]
    )
    running = np.cumsum([delta for _, delta in events]) if events else np.zeros(1)
    return int(running.max())


def compute_metrics(
    records: Sequence[RequestRecord], duration_s: float, slos: Mapping[str, float] | None = None
) -> BenchMetrics:
    """Aggregate a run's records; `duration_s` is the wall time of the whole run."""
    if not duration_s > 0:
        raise ValueError(f"duration must be > 0 s, got {duration_s}")
    done = [r for r in records if r.success]
    total_in = sum(r.prompt_len or 0 for r in done)
    total_out = sum(r.output_len for r in done)
    duration = duration_s
    good = sum(meets_slos(r, slos) for r in done) if slos else None
    return BenchMetrics(
        duration=duration_s,
        completed=len(done),
        failed=len(records) - len(done),
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        request_throughput=len(done) / duration,
        request_goodput=None if good is None else good / duration,
        output_throughput=total_out / duration,
        total_token_throughput=(total_in + total_out) / duration,
        max_output_tokens_per_s=peak_output_rate(done),
        max_concurrent_requests=peak_concurrency(done),
        **{
            key: value
            for metric in LATENCY_METRICS
            for key, value in _flat(metric, latency_stats(metric_samples(done, metric))).items()
        },
    )


class BenchResult(BenchMetrics, kw_only=True):
    """The saved result of one `bench serve` run (`--save-result`).

    Top-level keys follow vLLM's `bench serve` JSON (date, backend, model_id, num_prompts,
    request_rate, burstiness, max_concurrency, the metrics, and the per-request arrays
    input_lens, output_lens, ttfts, itls, latencies, start_times, generated_texts, errors),
    so its tooling reads it. Additions: p90 stats, handoff stats, the workload parameters,
    `metadata` (free KEY=VALUE labels such as mode=push, used by the report), and per-request
    `arrival_times`, `queue_times` and `handoffs`. Per-request times are seconds; start and
    arrival times are offsets from `start_time_unix`. A rate or burstiness of infinity is
    written as the string "inf" (JSON has no infinity).

    `percentile_metrics` and `metric_percentiles` are what the run was asked to report
    (`--percentile-metrics`, `--metric-percentiles`); `percentiles` holds the asked-for
    values that have no field of their own (e.g. p50_ttft_ms). The file has them as
    top-level keys, as vLLM writes them (`save_result`, `load_result`).
    """

    date: str
    backend: str = "openai"
    label: str | None = None
    model_id: str
    tokenizer_id: str | None = None
    base_url: str
    endpoint: str
    dataset_name: str
    dataset_path: str | None = None
    num_prompts: int
    input_len: int | None = None
    output_len: int | None = None
    range_ratio: float | None = None
    request_rate: float | str
    burstiness: float | str
    max_concurrency: int | None = None
    seed: int
    num_warmups: int = 0
    goodput_config: dict[str, float] | None = None
    metadata: dict[str, str] = msgspec.field(default_factory=dict)
    start_time_unix: float
    input_lens: list[int | None] = msgspec.field(default_factory=list)
    output_lens: list[int] = msgspec.field(default_factory=list)
    ttfts: list[float | None] = msgspec.field(default_factory=list)
    itls: list[list[float]] = msgspec.field(default_factory=list)
    latencies: list[float | None] = msgspec.field(default_factory=list)
    arrival_times: list[float] = msgspec.field(default_factory=list)
    start_times: list[float] = msgspec.field(default_factory=list)
    queue_times: list[float] = msgspec.field(default_factory=list)
    handoffs: list[float | None] = msgspec.field(default_factory=list)
    generated_texts: list[str] = msgspec.field(default_factory=list)
    errors: list[str | None] = msgspec.field(default_factory=list)
    # Shares of all the host's CPU time during the measured requests (pdserve.bench.hostcpu):
    # busy with this machine's work, and stolen by the hypervisor; None where unknown.
    host_cpu_busy: float | None = None
    host_cpu_steal: float | None = None
    percentile_metrics: list[str] = msgspec.field(default_factory=lambda: list(LATENCY_METRICS))
    metric_percentiles: list[float] = msgspec.field(
        default_factory=lambda: list(DEFAULT_PERCENTILES)
    )
    percentiles: dict[str, float | None] = msgspec.field(default_factory=dict)

    @property
    def rate(self) -> float:
        """`request_rate` as a float (inf for "inf")."""
        return float(self.request_rate)

    def percentile(self, metric: str, q: float) -> float | None:
        """Percentile `q` of a metric in ms, from its field or `percentiles`; None if unknown."""
        key = percentile_key(metric, q)
        return getattr(self, key) if key in self.__struct_fields__ else self.percentiles.get(key)


def per_request_arrays(records: Sequence[RequestRecord]) -> dict[str, list]:
    """The per-request columns of BenchResult, in request order."""
    return {
        "input_lens": [r.prompt_len for r in records],
        "output_lens": [r.output_len if r.success else 0 for r in records],
        "ttfts": [r.ttft for r in records],
        "itls": [r.itl for r in records],
        "latencies": [r.latency for r in records],
        "arrival_times": [r.arrival_time for r in records],
        "start_times": [r.start_time for r in records],
        "queue_times": [r.start_time - r.arrival_time for r in records],
        "handoffs": [r.handoff for r in records],
        "generated_texts": [r.generated_text for r in records],
        "errors": [r.error for r in records],
    }


def json_number(value: float) -> float | str:
    """A float for the result JSON: infinity becomes "inf"."""
    return "inf" if math.isinf(value) else value


def save_result(result: BenchResult, path: str | Path) -> None:
    """Write the result as indented JSON (creates parent folders); `percentiles` become
    top-level keys."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = msgspec.to_builtins(result)
    data.update(data.pop("percentiles"))
    path.write_bytes(msgspec.json.format(msgspec.json.encode(data), indent=2) + b"\n")


def load_result(path: str | Path) -> BenchResult:
    """Read a result JSON written by `save_result` (top-level p{q}_{metric}_ms keys without a
    field go back into `percentiles`)."""
    data = msgspec.json.decode(Path(path).read_bytes())
    if isinstance(data, dict):
        fields = set(BenchResult.__struct_fields__)
        extra = {k: v for k, v in data.items() if _PERCENTILE_KEY.match(k) and k not in fields}
        data = {k: v for k, v in data.items() if k not in extra} | {"percentiles": extra}
    return msgspec.convert(data, type=BenchResult)
