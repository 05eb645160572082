"""Prometheus metrics of the router, in a registry owned by its app (none at module level).

Counters and histograms are updated by the dispatcher on the router's event loop; the
per-instance gauges (admitted, outstanding legs) are read from the pool at scrape time.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pdserve.router.health import InstancePool

# Seconds. A prefill leg on a CPU takes up to many seconds; a handoff takes milliseconds.
_LEG_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_HANDOFF_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class _PoolCollector(Collector):
    """Per-instance gauges read from the pool when /metrics is scraped."""

    def __init__(self, pool: InstancePool) -> None:
        self._pool = pool

    def collect(self) -> Iterable[Metric]:
        admitted = GaugeMetricFamily(
            "pdserve_router_instance_admitted",
            "1 if the instance passes health checks and may be picked.",
            labels=["role", "url"],
        )
        outstanding = GaugeMetricFamily(
            "pdserve_router_instance_outstanding",
            "Legs the router has in flight on the instance.",
            labels=["role", "url"],
        )
        refused = GaugeMetricFamily(
            "pdserve_router_instance_refused",
            "1 if the instance is healthy but does not fit the cluster (role, transfer mode,"
            " model or transport; the router's /health says which).",
            labels=["role", "url"],
        )
        ejections = CounterMetricFamily(
            "pdserve_router_instance_ejections",
            "Times the health monitor ejected the instance.",
            labels=["role", "url"],
        )
        restarts = CounterMetricFamily(
            "pdserve_router_instance_restarts",
            "Restarts of the instance the router noticed (a new incarnation in /kv/info;"
            " without /kv/info, every re-admission after an ejection).",
            labels=["role", "url"],
        )
        for inst in self._pool.instances:
            labels = [inst.role, inst.url]
            admitted.add_metric(labels, 1.0 if inst.admitted else 0.0)
            outstanding.add_metric(labels, inst.outstanding)
            refused.add_metric(labels, 0.0 if inst.refused is None else 1.0)
            ejections.add_metric(labels, inst.ejections)
            restarts.add_metric(labels, inst.restarts)
        yield from (admitted, outstanding, refused, ejections, restarts)


class RouterMetrics:
    """All metrics of one router app (`app.state`); updated only on its event loop."""

    def __init__(self, pool: InstancePool) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "pdserve_router_requests",
            "Client requests by mode (pull, push, local: a short prompt prefilled on D,"
            " local_fallback: no prefill instance left) and outcome (HTTP status, or"
            " stream_error / client_disconnect once a stream had started).",
            ["mode", "status"],
            registry=r,
        )
        self.leg_errors = Counter(
            "pdserve_router_leg_errors",
            "Failed legs by leg and reason"
            " (timeout, connect, http_status, protocol, missing_params).",
            ["leg", "reason"],
            registry=r,
        )
        self.releases = Counter(
            "pdserve_router_prefill_releases",
            "Releases of P's hold sent because no decode leg will use it (D refused or"
            " failed before its stream, or the client left between the legs), by outcome:"
            " sent (P accepted it), refused (P answered an error, e.g. a bad signature),"
            " failed (P not reached); a release not sent leaves the blocks to P's lease.",
            ["outcome"],
            registry=r,
        )
        self.prefill_leg = _hist(
            r,
            "pdserve_router_prefill_leg_seconds",
            "Prefill leg: request sent to P until P's response.",
        )
        self.decode_first_token = _hist(
            r,
            "pdserve_router_decode_first_token_seconds",
            "Decode leg: request sent to D until D's first token event (its whole body"
            " when not streaming).",
        )
        self.decode_leg = _hist(
            r,
            "pdserve_router_decode_leg_seconds",
            "Decode leg: request sent to D until D's last byte.",
        )
        self.time_to_first_token = _hist(
            r,
            "pdserve_router_time_to_first_token_seconds",
            "Client request arrival until the router forwards D's first token event (its"
            " whole body when not streaming).",
        )
        self.handoff = Histogram(
            "pdserve_router_handoff_seconds",
            "P's prefill_done_time (unix time) until D's first token event reaches the"
            " router, when P reports it. Across hosts only as exact as their clocks.",
            buckets=_HANDOFF_BUCKETS,
            registry=r,
        )
        r.register(_PoolCollector(pool))

    def render(self) -> tuple[bytes, str]:
        """The exposition body and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def _hist(registry: CollectorRegistry, name: str, doc: str) -> Histogram:
    return Histogram(name, doc, buckets=_LEG_BUCKETS, registry=registry)
