"""Prometheus metrics of one instance, in a registry owned by its app (none at module level).

Request counters and latency histograms are updated by the HTTP side as requests run;
queue and KV-block gauges are read from the engine's `stats()` at scrape time by a custom
collector, so they are never stale and the engine thread never touches Prometheus.
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


class _EngineStatsCollector(Collector):
    """Gauges read from the engine when /metrics is scraped."""

    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterable[Metric]:
        try:
            s = self._stats()
        except Exception:  # a dead engine must not break the scrape of everything else
            log.exception("engine stats unavailable")
            return
        yield _gauge("pdserve_num_requests_running", "Requests being computed.", s.num_running)
        yield _gauge(
            "pdserve_num_requests_waiting", "Requests queued for admission.", s.num_waiting
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


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


class ServerMetrics:
    """All metrics of one app. Owned by the app (`app.state.metrics`), updated on its loop."""

    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "pdserve_requests",
            "Finished API requests by HTTP status.",
            ["endpoint", "status"],
            registry=r,
        )
        self.finished = Counter(
            "pdserve_request_finish", "Generations by finish reason.", ["reason"], registry=r
        )
        self.prompt_tokens = Counter("pdserve_prompt_tokens", "Prompt tokens.", registry=r)
        self.generation_tokens = Counter(
            "pdserve_generation_tokens", "Generated tokens.", registry=r
        )
        self.ttft = Histogram(
            "pdserve_time_to_first_token_seconds",
            "Arrival to first token.",
            buckets=_TTFT_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "pdserve_time_per_output_token_seconds",
            "Per request: (last token - first token) / (tokens - 1).",
            buckets=_TPOT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "pdserve_e2e_request_latency_seconds",
            "Arrival to last token.",
            buckets=_E2E_BUCKETS,
            registry=r,
        )
        r.register(_EngineStatsCollector(stats))

    def render(self) -> tuple[bytes, str]:
        """The exposition body and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def timer(self, num_prompt_tokens: int) -> RequestTimer:
        return RequestTimer(self, num_prompt_tokens)


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
        """`n` new tokens arrived now."""
        if n <= 0:
            return
        self._last = time.monotonic()
        if self._first is None:
            self._first = self._last
            self._m.ttft.observe(self._first - self.arrival)
        self.num_tokens += n

    def finish(self, reason: str) -> None:
        """Record the request's totals (idempotent: only the first call counts)."""
        if self._done:
            return
        self._done = True
        self._m.finished.labels(reason).inc()
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
            self.metrics.requests.labels(path, str(status[0])).inc()
