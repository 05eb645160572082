"""The planner's configuration: targets, bounds and thresholds (one frozen dataclass)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class PlannerConfig:
    """Targets the planner steers to and the bounds it stays within.

    A role is "hot" when its latency (TTFT for prefill, TPOT for decode, at `percentile`)
    is over its target, or its instances' mean queue is over `queue_high` waiting
    requests, or (decode) its KV use is over `kv_high`; "cold" when its latency is under
    `headroom` times the target and nothing waits. One change per decision, and none in
    the `cooldown` decisions after a change (the new layout needs a window to show).
    """

    ttft_target_s: float = 2.0
    tpot_target_s: float = 0.2
    percentile: Literal[50, 90] = 90
    interval_s: float = 10.0
    min_prefill: int = 1
    max_prefill: int = 4
    min_decode: int = 1
    max_decode: int = 4
    max_total: int = 6
    queue_high: float = 2.0
    kv_high: float = 0.85
    headroom: float = 0.5
    cooldown: int = 1

    def __post_init__(self) -> None:
        if min(self.ttft_target_s, self.tpot_target_s, self.interval_s) <= 0:
            raise ValueError("targets and the interval must be positive")
        if not 1 <= self.min_prefill <= self.max_prefill:
            raise ValueError("need 1 <= min_prefill <= max_prefill")
        if not 1 <= self.min_decode <= self.max_decode:
            raise ValueError("need 1 <= min_decode <= max_decode")
        if self.max_total < self.min_prefill + self.min_decode:
            raise ValueError("max_total is below min_prefill + min_decode")
        if not 0 < self.headroom < 1 or self.cooldown < 0:
            raise ValueError("headroom must be in (0, 1), cooldown >= 0")
