"""Prometheus metrics of one instance, in a registry owned by its app (none at module level).

Request counters and latency histograms are updated by the HTTP side as requests run;
queue and KV-block gauges are read from the engine's `stats()` at scrape time by a custom
collector, so they are never stale and the engine thread never touches Prometheus.

Request, token and latency series carry `model_name` (the served model name), as vLLM's
do. The `pdserve:` gauges are the model server protocol of the Gateway API Inference
Extension's endpoint picker (docs/metrics.md): the names it is configured to read.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pdserve.engine.types import EngineStats

log = logging.getLogger(__name__)

# Seconds. CPU prefill of long prompts takes seconds; GPU decode steps take milliseconds.
_TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
# Per token gap: a decode step (ms on a GPU, tens of ms on a CPU), or a stall of seconds.
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)
_MODEL = ["model_name"]


class _EngineStatsCollector(Collector):
    """Gauges read from the engine when /metrics is scraped."""

    def __init__(self, stats: Callable[[], EngineStats], model_name: str, block_size: int):
        self._stats = stats
        self._model = model_name
        self._block_size = block_size

    def collect(self) -> Iterable[Metric]:
        try:
            s = self._stats()
        except Exception:  # a dead engine must not break the scrape of everything else
            log.exception("engine stats unavailable")
            return
        yield from self._protocol(s)
        yield _gauge("pdserve_num_requests_running", "Requests being computed.", s.num_running)
        yield _gauge(
            "pdserve_num_requests_waiting",
            "Requests queued for admission (without those waiting for remote KV).",
            s.num_waiting,
        )
        yield _gauge(
            "pdserve_num_requests_waiting_for_kv",
            "Requests waiting for their KV cache from a remote instance.",
            s.num_waiting_for_kv,
        )
        yield _gauge("pdserve_kv_blocks_used", "KV-cache blocks in use.", s.kv_blocks_used)
        yield _gauge("pdserve_kv_blocks_total", "KV-cache blocks in the pool.", s.kv_blocks_total)
        yield CounterMetricFamily(
            "pdserve_num_preemptions", "Requests preempted for KV space.", s.num_preemptions
        )
        # vLLM's prefix_cache_queries / prefix_cache_hits: tokens, counted at admission.
        yield CounterMetricFamily(
            "pdserve_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            s.prefix_cache_queries,
        )
        yield CounterMetricFamily(
            "pdserve_prefix_cache_hits",
            "Prompt tokens found in the prefix cache (not computed).",
            s.prefix_cache_hits,
        )

    def _protocol(self, s: EngineStats) -> Iterable[Metric]:
        """The endpoint picker's gauges, with vLLM's meanings (docs/metrics.md)."""
        # vLLM counts requests waiting for remote KV (WAITING_FOR_REMOTE_KVS) as waiting: on
        # a decode instance they are its queue, and a picker must see them as load.
        waiting = s.num_waiting + s.num_waiting_for_kv
        yield self._labelled(
            "pdserve:num_requests_waiting",
            "Requests queued: waiting for admission or for their KV from a prefill instance.",
            waiting,
        )
        yield self._labelled(
            "pdserve:num_requests_running", "Requests being computed.", s.num_running
        )
        usage = s.kv_blocks_used / s.kv_blocks_total if s.kv_blocks_total else 0.0
        yield self._labelled(
            "pdserve:kv_cache_usage_perc", "KV-cache usage as a fraction: 1 means 100%.", usage
        )
        info = GaugeMetricFamily(
            "pdserve:cache_config_info",
            "KV-cache configuration in the labels (block_size in tokens, num_gpu_blocks).",
            labels=[*_MODEL, "block_size", "num_gpu_blocks"],
        )
        info.add_metric([self._model, str(self._block_size), str(s.kv_blocks_total)], 1.0)
        yield info

    def _labelled(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=_MODEL)
        g.add_metric([self._model], value)
        return g


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


class ServerMetrics:
    """All metrics of one app. Owned by the app (`app.state.metrics`), updated on its loop.

    `model_name` labels every request, token and latency series (the served model name);
    `block_size` (tokens per KV block) goes into `pdserve:cache_config_info`.
    """

    def __init__(self, stats: Callable[[], EngineStats], model_name: str, block_size: int) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        r = self.registry
        self.requests = Counter(
            "pdserve_requests",
            "Finished API requests by HTTP status.",
            [*_MODEL, "endpoint", "status"],
            registry=r,
        )
        self.finished = Counter(
            "pdserve_request_finish",
            "Generations by finish reason.",
            [*_MODEL, "reason"],
            registry=r,
        )
        self.prompt_tokens = _counter(r, "pdserve_prompt_tokens", "Prompt tokens.", model_name)
        self.generation_tokens = _counter(
            r, "pdserve_generation_tokens", "Generated tokens.", model_name
        )
        self.ttft = _histogram(
            r,
            "pdserve_time_to_first_token_seconds",
            "Arrival to first token.",
            _TTFT_BUCKETS,
            model_name,
        )
        self.tpot = _histogram(
            r,
            "pdserve_time_per_output_token_seconds",
            "Per request: (last token - first token) / (tokens - 1).",
            _TPOT_BUCKETS,
            model_name,
        )
        self.itl = _histogram(
            r,
            "pdserve_inter_token_latency_seconds",
            "Per output token after the first output: the time since the previous output,"
            " shared evenly by the tokens that arrived together.",
            _ITL_BUCKETS,
            model_name,
        )
        self.e2e = _histogram(
            r,
            "pdserve_e2e_request_latency_seconds",
            "Arrival to last token.",
            _E2E_BUCKETS,
            model_name,
        )
        r.register(_EngineStatsCollector(stats, model_name, block_size))

    def render(self) -> tuple[bytes, str]:
        """The exposition body and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def timer(self, num_prompt_tokens: int) -> RequestTimer:
        return RequestTimer(self, num_prompt_tokens)


def _counter(r: CollectorRegistry, name: str, doc: str, model: str) -> Counter:
    """The `model_name` child of a new counter (its series exists from the start, at 0)."""
    return Counter(name, doc, _MODEL, registry=r).labels(model)


def _histogram(
    r: CollectorRegistry, name: str, doc: str, buckets: tuple[float, ...], model: str
) -> Histogram:
    """The `model_name` child of a new histogram (its series exist from the start)."""
    return Histogram(name, doc, _MODEL, buckets=buckets, registry=r).labels(model)


class RequestTimer:
    """Latency bookkeeping of one generation; `finish` records it once."""

    def __init__(self, metrics: ServerMetrics, num_prompt_tokens: int) -> None:
        self._m = metrics
        self._prompt = num_prompt_tokens
        self.arrival = time.monotonic()
        self._first: float | None = None
        self._last = self.arrival
        self.num_tokens = 0
        self._done = False

    def tokens(self, n: int) -> None:
        """`n` new tokens arrived now (one output of the engine)."""
        if n <= 0:
            return
        now = time.monotonic()
        if self._first is None:
            self._first = now
            self._m.ttft.observe(now - self.arrival)
        else:
            self._observe_gaps(now - self._last, n)
        self._last = now
        self.num_tokens += n

    def _observe_gaps(self, gap: float, n: int) -> None:
        """One ITL observation per token, so the histogram's sum over its count is the mean
        time per output token; tokens that came together (a multi-token output) share the
        gap. Tokens of the first output have no gap: TTFT covers them, as in vLLM."""
        for _ in range(n):
            self._m.itl.observe(gap / n)

    def finish(self, reason: str) -> None:
        """Record the request's totals (idempotent: only the first call counts)."""
        if self._done:
            return
        self._done = True
        self._m.finished.labels(self._m.model_name, reason).inc()
        self._m.prompt_tokens.inc(self._prompt)
        self._m.generation_tokens.inc(self.num_tokens)
        if self._first is not None:
            self._m.e2e.observe(self._last - self.arrival)
            if self.num_tokens > 1:
                self._m.tpot.observe((self._last - self._first) / (self.num_tokens - 1))


class RequestCountMiddleware:
    """Counts responses of the generation endpoints by HTTP status (pure ASGI, so streaming
    responses pass through untouched)."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics, endpoints: frozenset[str]) -> None:
        self.app = app
        self.metrics = metrics
        self.endpoints = endpoints

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or path not in self.endpoints:
            await self.app(scope, receive, send)
            return
        status = [500]  # what the client sees if the app raises before starting a response

        async def send_and_count(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_count)
        finally:
            self.metrics.requests.labels(self.metrics.model_name, path, str(status[0])).inc()
