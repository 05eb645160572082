"""What the planner measures on a running cluster: the router's histograms, the instances'
load reports.

TTFT and the handoff (P's prefill done to D's first token) come from the router's
Prometheus histograms (`pdserve_router_time_to_first_token_seconds`,
`pdserve_router_handoff_seconds`): the percentile of the requests of the last window, from
the difference of two scrapes, interpolated within a bucket as Prometheus'
`histogram_quantile` does. TPOT is not a router histogram: it is taken as the step time of
the slowest decode instance, 1 / its measured `decode_steps_per_s` from `/load` (every
running stream gains one token per step). Queues and KV use are the instances' `/load`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from prometheus_client.parser import text_string_to_metric_families

from pdserve.planner.policy import Observation
from pdserve.server.load_report import LoadReport

TTFT_METRIC = "pdserve_router_time_to_first_token_seconds"
HANDOFF_METRIC = "pdserve_router_handoff_seconds"

Buckets = dict[str, list[tuple[float, float]]]  # metric -> [(upper bound, cumulative count)]


def histogram_buckets(exposition: str) -> Buckets:
    """The cumulative buckets of every histogram in a Prometheus text exposition."""
    out: Buckets = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if sample.name.endswith("_bucket"):
                bound = float(sample.labels["le"])
                out.setdefault(sample.name[: -len("_bucket")], []).append((bound, sample.value))
    return {name: sorted(b) for name, b in out.items()}


def window_quantile(
    before: Sequence[tuple[float, float]], after: Sequence[tuple[float, float]], q: float
) -> float | None:
    """The q-quantile (0..1) of the observations made between two scrapes of one
    histogram; None when there were none."""
    old = dict(before)
    counts = [(bound, count - old.get(bound, 0.0)) for bound, count in after]
    total = counts[-1][1] if counts else 0.0
    if total <= 0:
        return None
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in counts:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound  # above the last finite bucket: its bound is all we know
            inside = count - lower_count
            share = (rank - lower_count) / inside if inside > 0 else 1.0
            return lower_bound + (bound - lower_bound) * share
        lower_bound, lower_count = bound, count
    return None


def observation(
    percentile: int,
    before: Buckets,
    after: Buckets,
    prefill: Sequence[LoadReport | None],
    decode: Sequence[LoadReport | None],
) -> Observation:
    """The planner's view of one window (instances that did not answer count as absent)."""
    q = percentile / 100
    p = [r for r in prefill if r is not None]
    d = [r for r in decode if r is not None]
    rates = [r.decode_steps_per_s for r in d if r.decode_steps_per_s and r.num_running]
    return Observation(
        num_prefill=len(prefill),
        num_decode=len(decode),
        ttft_s=window_quantile(before.get(TTFT_METRIC, []), after.get(TTFT_METRIC, []), q),
        tpot_s=1.0 / min(rates) if rates else None,
        prefill_queue=_mean([r.num_waiting for r in p]),
        decode_queue=_mean([r.num_waiting for r in d]),  # waiting for KV: prefill's backlog
        decode_kv_use=max((r.kv_blocks_used / r.kv_blocks_total for r in d), default=0.0),
        handoff_s=window_quantile(before.get(HANDOFF_METRIC, []), after.get(HANDOFF_METRIC, []), q),
    )


def _mean(values: Sequence[int]) -> float:
    return sum(values) / len(values) if values else 0.0
