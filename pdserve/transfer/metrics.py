"""Prometheus view of a connector's counters, read at scrape time (a `ConnectorMetrics`
snapshot: from the connector itself in-process, from the engine core's last snapshot
across processes)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from pdserve.transfer.buckets import Buckets
from pdserve.transfer.stats import ConnectorMetrics, ConnectorStats, WriterStats

# (metric name, help, attribute of the connector's stats), all labelled by mode.
_CONNECTOR_COUNTERS: tuple[tuple[str, str, str], ...] = (
    (
        "pdserve_kv_bytes_transferred",
        "KV bytes moved by this instance (pull: read by D; push: written by P).",
        "bytes_moved",
    ),
    ("pdserve_kv_transfers", "KV transfers completed.", "transfers"),
    ("pdserve_kv_transfer_seconds", "Time from posting to completion, summed.", "transfer_seconds"),
    ("pdserve_kv_descriptors", "Descriptors posted (after coalescing).", "descriptors"),
    ("pdserve_kv_failed_transfers", "Transfers that failed a request.", "failures"),
    ("pdserve_kv_lease_expired", "Held prompt KV freed by lease expiry.", "lease_expired"),
    (
        "pdserve_kv_released_by_router",
        "P: held prompt KV freed at once by the router's release (no decode leg will use it).",
        "released_by_router",
    ),
    ("pdserve_kv_recv_timeouts", "D: requests failed by the KV watchdog.", "recv_timeouts"),
    (
        "pdserve_kv_registrations_expired",
        "P (push): registrations never matched by a prompt.",
        "registrations_expired",
    ),
    ("pdserve_kv_peers_down", "Peers declared down (silent or restarted).", "peers_down"),
    (
        "pdserve_kv_legs_refused",
        "P/D legs refused because a cap on waiting or unclaimed KV was reached.",
        "legs_refused",
    ),
    (
        "pdserve_kv_peers_given_up",
        "D: addresses given up on as unreachable (not dialed during the cooldown).",
        "peers_given_up",
    ),
    ("pdserve_kv_received", "D: prompts whose KV arrived.", "received"),
    (
        "pdserve_kv_recv_wait_seconds",
        "D: admission (push: registration) to KV arrival, summed.",
        "recv_wait_seconds",
    ),
)

# (metric name, help, attribute of the connector's stats): histograms, labelled by mode.
# The summed counters above stay for whoever reads them; these give the distributions.
_CONNECTOR_HISTOGRAMS: tuple[tuple[str, str, str], ...] = (
    (
        "pdserve_kv_transfer_duration_seconds",
        "One KV transfer, from posting to completion (pull: D's read; push: P's write).",
        "transfer_time",
    ),
    (
        "pdserve_kv_recv_wait_duration_seconds",
        "D: admission (push: registration) to KV arrival, per prompt.",
        "recv_wait_time",
    ),
    (
        "pdserve_kv_handoff_seconds",
        "D: P's prefill_done_time (unix time) until D's engine takes the KV's arrival;"
        " across hosts only as exact as their clocks.",
        "handoff_time",
    ),
)


class ConnectorCollector(Collector):
    """Transfer metrics of one instance: bytes, time, descriptors, failures, expiries, push."""

    def __init__(self, read: Callable[[], ConnectorMetrics | None]) -> None:
        self.read = read

    def collect(self) -> Iterable[Metric]:
        snap = self.read()
        if snap is None:
            return
        s, mode = snap.stats, snap.mode
        for name, doc, attr in _CONNECTOR_COUNTERS:
            yield _counter(name, doc, getattr(s, attr), mode)
        yield from _histograms(s, mode)
        held = GaugeMetricFamily(
            "pdserve_kv_blocks_held",
            "Blocks the connector owns (holds, quarantine).",
            labels=["mode"],
        )
        held.add_metric([mode], snap.blocks_held)
        yield held
        if snap.writer is not None:
            yield from _push(snap.writer)


def _push(ws: WriterStats) -> Iterable[Metric]:
    yield _counter(
        "pdserve_push_match_wait_seconds",
        "P: registration arrival to pairing with the prompt, summed.",
        ws.match_wait_s,
        "push",
    )
    order = CounterMetricFamily(
        "pdserve_push_pairings", "P: pairings by arrival order.", labels=["first"]
    )
    order.add_metric(["registration"], ws.registered_first)
    order.add_metric(["prefill"], ws.finished_first)
    yield order
    yield _counter(
        "pdserve_push_layerwise",
        "P: prompts written layer by layer as computed.",
        ws.layerwise,
        "push",
    )
    yield GaugeMetricFamily(
        "pdserve_push_writer_queue_depth",
        "P: registrations, prompts and writes the writer holds.",
        value=ws.queue_depth,
    )
    causes = CounterMetricFamily(
        "pdserve_push_failures", "P: failure notices sent, by cause.", labels=["cause"]
    )
    for cause, n in sorted(ws.failures_by_cause.items()):
        causes.add_metric([cause], n)
    yield causes


def _histograms(s: ConnectorStats, mode: str) -> Iterable[Metric]:
    for name, doc, attr in _CONNECTOR_HISTOGRAMS:
        b: Buckets = getattr(s, attr)
        h = HistogramMetricFamily(name, doc, labels=["mode"])
        h.add_metric([mode], b.cumulative(), sum_value=b.total)
        yield h


def _counter(name: str, doc: str, value: float, mode: str) -> CounterMetricFamily:
    c = CounterMetricFamily(name, doc, labels=["mode"])
    c.add_metric([mode], value)
    return c
