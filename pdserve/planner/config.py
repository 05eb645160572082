"""The planner's configuration: targets, bounds and thresholds (one frozen dataclass)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pdserve.options import option

PLANNER_GROUP = "planner"  # where `pdserve up --help` lists the flags below


@dataclass(frozen=True)
class PlannerConfig:
    """Targets the planner steers to and the bounds it stays within.

    A role is "hot" when its latency (TTFT for prefill, TPOT for decode, at `percentile`)
    is over its target, or its instances' mean queue is over `queue_high` waiting
    requests, or (decode) its KV use is over `kv_high`; "cold" when its latency is under
    `headroom` times the target and nothing waits. One change per decision, and none in
    the `cooldown` decisions after a change (the new layout needs a window to show).
    """

    ttft_target_s: float = option(
        2.0,
        flag="--ttft-target",
        group=PLANNER_GROUP,
        metavar="S",
        help="prefill's TTFT target (default: %(default)s)",
    )
    tpot_target_s: float = option(
        0.2,
        flag="--tpot-target",
        group=PLANNER_GROUP,
        metavar="S",
        help="decode's TPOT target (default: %(default)s)",
    )
    percentile: Literal[50, 90] = option(
        90,
        flag="--planner-percentile",
        group=PLANNER_GROUP,
        help="the percentile of TTFT and TPOT held against the targets (default: %(default)s)",
    )
    interval_s: float = option(
        10.0,
        flag="--planner-interval",
        group=PLANNER_GROUP,
        metavar="S",
        help="seconds between decisions (default: %(default)s)",
    )
    min_prefill: int = option(
        1,
        group=PLANNER_GROUP,
        metavar="N",
        help="prefill instances at least (default: %(default)s)",
    )
    max_prefill: int = option(
        4, group=PLANNER_GROUP, metavar="N", help="prefill instances at most (default: %(default)s)"
    )
    min_decode: int = option(
        1, group=PLANNER_GROUP, metavar="N", help="decode instances at least (default: %(default)s)"
    )
    max_decode: int = option(
        4, group=PLANNER_GROUP, metavar="N", help="decode instances at most (default: %(default)s)"
    )
    max_total: int = option(
        6,
        flag="--max-instances",
        group=PLANNER_GROUP,
        metavar="N",
        help="prefill plus decode instances at most (default: %(default)s)",
    )
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
