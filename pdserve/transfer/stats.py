"""Snapshots of a connector's counters: written by its threads, read by /metrics.

Plain msgspec structs with no torch behind them, so a front end in another process can
decode them from the engine core's snapshots (`pdserve.engine.core_protocol`).
"""

from __future__ import annotations

import msgspec

from pdserve.transfer.buckets import Buckets, transfer_buckets, wait_buckets


class ConnectorStats(msgspec.Struct):
    """Counters and histograms for /metrics (numbers and bucket counts; read from any
    thread)."""

    bytes_moved: int = 0
    transfers: int = 0
    transfer_seconds: float = 0.0
    # The same, per transfer and by duration; then D's waits for KV (admission, push:
    # registration, to arrival) and handoffs (P's prefill_done_time to the arrival on D).
    transfer_time: Buckets = msgspec.field(default_factory=transfer_buckets)
    recv_wait_time: Buckets = msgspec.field(default_factory=wait_buckets)
    handoff_time: Buckets = msgspec.field(default_factory=transfer_buckets)
    descriptors: int = 0
    failures: int = 0
    lease_expired: int = 0
    recv_timeouts: int = 0
    registrations_expired: int = 0
    peers_down: int = 0
    received: int = 0  # D: prompts whose KV arrived
    recv_wait_seconds: float = 0.0  # D: admission (push: registration) to arrival, summed
    released_by_router: int = 0  # P: holds freed by the router's release (POST /kv/release)
    legs_refused: int = 0  # P/D legs refused over a cap (cause `overloaded`)
    peers_given_up: int = 0  # D: addresses given up on as unreachable (cooldown started)


class WriterStats(msgspec.Struct):
    """Push metrics (read from any thread)."""

    registered_first: int = 0
    finished_first: int = 0
    match_wait_s: float = 0.0
    layerwise: int = 0  # prompts written layer by layer
    queue_depth: int = 0
    failures_by_cause: dict[str, int] = msgspec.field(default_factory=dict)


class ConnectorMetrics(msgspec.Struct, kw_only=True):
    """A snapshot of a connector's counters, for /metrics (`pdserve.transfer.metrics`)."""

    mode: str
    stats: ConnectorStats
    blocks_held: int
    writer: WriterStats | None = None  # push's prefill side only
    # Threads and listeners the connector needs that have stopped (`KVConnector.stopped`).
    stopped: list[str] = msgspec.field(default_factory=list)
