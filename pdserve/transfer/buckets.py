"""Fixed-bucket histograms inside a connector's stats (`ConnectorStats`).

The connector observes on its own threads, and a front end in another process reads its
snapshots (msgspec), so these are plain counts with no Prometheus object behind them;
`pdserve.transfer.metrics` renders them as Prometheus histograms at scrape time.
"""

from __future__ import annotations

import bisect

import msgspec

# Seconds. One transfer: sub-millisecond on one host, seconds for long prompts across hosts.
TRANSFER_BOUNDS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0
)  # fmt: skip
# Seconds. Waits that include P's prefill (D's wait for KV): up to minutes on a CPU.
WAIT_BOUNDS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0,
)  # fmt: skip


class Buckets(msgspec.Struct):
    """Observations counted per bucket: `counts[i]` are those in (bounds[i-1], bounds[i]],
    the last count those above every bound; `total` is their sum."""

    bounds: tuple[float, ...]
    counts: list[int]
    total: float = 0.0

    @classmethod
    def of(cls, bounds: tuple[float, ...]) -> Buckets:
        return cls(bounds, [0] * (len(bounds) + 1))

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value

    def cumulative(self) -> list[tuple[str, float]]:
        """Prometheus's `le` buckets: counts at or below each bound, then `+Inf`."""
        counts = list(self.counts)  # one read, so +Inf is the sum of what is shown
        out: list[tuple[str, float]] = []
        running = 0
        for bound, n in zip((*map(str, self.bounds), "+Inf"), counts, strict=True):
            running += n
            out.append((bound, float(running)))
        return out


def transfer_buckets() -> Buckets:
    return Buckets.of(TRANSFER_BOUNDS)


def wait_buckets() -> Buckets:
    return Buckets.of(WAIT_BOUNDS)
