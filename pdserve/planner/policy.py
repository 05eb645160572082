"""The planner's decision: from one window's measurements to the next layout, with reasons.

`decide` is a pure function of the config, the window's `Observation` and the planner's
`PlannerState` (decisions since the last change), so the same code runs in the simulator
(`pdserve.sim.planner_replay`) and on a Ray cluster (`pdserve.cluster.planner_loop`), and its
decisions on a trace are deterministic.

Rules, one change at most per decision (a role's hot/cold is defined in `PlannerConfig`):
1. only prefill hot: add a prefill instance; at the size bound, move one decode instance
   to prefill if decode is cold; else hold.
2. only decode hot: the same the other way round.
3. both hot: add to the role further over its target, or else to the other one, as far
   as the bounds allow.
4. neither hot: remove an instance of a cold role (prefill first) above its minimum.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from pdserve.planner.config import PlannerConfig


class Action(enum.Enum):
    HOLD = "hold"
    ADD_PREFILL = "add_prefill"
    ADD_DECODE = "add_decode"
    REMOVE_PREFILL = "remove_prefill"
    REMOVE_DECODE = "remove_decode"
    DECODE_TO_PREFILL = "decode_to_prefill"
    PREFILL_TO_DECODE = "prefill_to_decode"


_DELTA: dict[Action, tuple[int, int]] = {
    Action.HOLD: (0, 0),
    Action.ADD_PREFILL: (1, 0),
    Action.ADD_DECODE: (0, 1),
    Action.REMOVE_PREFILL: (-1, 0),
    Action.REMOVE_DECODE: (0, -1),
    Action.DECODE_TO_PREFILL: (1, -1),
    Action.PREFILL_TO_DECODE: (-1, 1),
}


@dataclass(frozen=True)
class Observation:
    """One window: latency at the planner's percentile (None: no request finished), the
    mean waiting requests per instance of each role, decode's highest KV use (0..1), and
    the layout that was measured. `handoff_s` (same percentile) is the part of TTFT after
    prefill finished, i.e. waiting for a decode instance and the transfer: TTFT late
    because of it is decode's to fix, not prefill's (None: not measured, TTFT is all
    prefill's)."""

    num_prefill: int
    num_decode: int
    ttft_s: float | None
    tpot_s: float | None
    prefill_queue: float = 0.0
    decode_queue: float = 0.0
    decode_kv_use: float = 0.0
    handoff_s: float | None = None

    @property
    def prefill_ttft_s(self) -> float | None:
        """TTFT without the handoff: prefill's own part."""
        if self.ttft_s is None:
            return None
        return max(0.0, self.ttft_s - (self.handoff_s or 0.0))


@dataclass(frozen=True)
class PlannerState:
    """Decisions made since the last change (the cooldown's count)."""

    since_change: int = 1_000_000


@dataclass(frozen=True)
class Decision:
    action: Action
    num_prefill: int
    num_decode: int
    reason: str

    @property
    def changes(self) -> bool:
        return self.action is not Action.HOLD


def decide(
    cfg: PlannerConfig, obs: Observation, state: PlannerState
) -> tuple[Decision, PlannerState]:
    """The next layout for `obs` (see the module doc) and the state after it."""
    measured = _describe(cfg, obs)
    if state.since_change < cfg.cooldown:
        return _hold(obs, f"cooldown after a change; {measured}"), PlannerState(
            state.since_change + 1
        )
    action, why = _choose(cfg, obs)
    dp, dd = _DELTA[action]
    decision = Decision(action, obs.num_prefill + dp, obs.num_decode + dd, f"{why}; {measured}")
    return decision, PlannerState(0 if decision.changes else state.since_change + 1)


def _choose(cfg: PlannerConfig, obs: Observation) -> tuple[Action, str]:
    p_ratio, d_ratio = _pressure(cfg, obs)
    p_hot, d_hot = p_ratio > 1.0, d_ratio > 1.0
    room = obs.num_prefill + obs.num_decode < cfg.max_total
    can_add_p = room and obs.num_prefill < cfg.max_prefill
    can_add_d = room and obs.num_decode < cfg.max_decode
    p_cold, d_cold = _cold(cfg, obs)
    if p_hot and d_hot:  # grow the role further over target, else the one that can grow
        if can_add_p and (p_ratio >= d_ratio or not can_add_d):
            return Action.ADD_PREFILL, "both over target: one more prefill instance"
        if can_add_d:
            return Action.ADD_DECODE, "both over target: one more decode instance"
        return Action.HOLD, "both over target and no room to grow"
    if p_hot:
        return _grow(
            can_add_p,
            d_cold and _can_shrink_d(cfg, obs),
            "prefill",
            Action.ADD_PREFILL,
            Action.DECODE_TO_PREFILL,
            obs.num_prefill < cfg.max_prefill,
        )
    if d_hot:
        return _grow(
            can_add_d,
            p_cold and _can_shrink_p(cfg, obs),
            "decode",
            Action.ADD_DECODE,
            Action.PREFILL_TO_DECODE,
            obs.num_decode < cfg.max_decode,
        )
    if p_cold and _can_shrink_p(cfg, obs):
        return Action.REMOVE_PREFILL, "prefill well under target: one fewer"
    if d_cold and _can_shrink_d(cfg, obs):
        return Action.REMOVE_DECODE, "decode well under target: one fewer"
    return Action.HOLD, "within targets"


def _grow(
    can_add: bool, can_move: bool, role: str, add: Action, move: Action, below_max: bool
) -> tuple[Action, str]:
    if can_add:
        return add, f"{role} over target: one more {role} instance"
    if can_move and below_max:
        return move, f"{role} over target at the size bound, the other role idle: move one"
    return Action.HOLD, f"{role} over target but at its bounds"


def _pressure(cfg: PlannerConfig, obs: Observation) -> tuple[float, float]:
    """How far each role is over its target (> 1: hot), by latency, queue or KV."""
    p = max(
        (obs.prefill_ttft_s or 0.0) / cfg.ttft_target_s,
        obs.prefill_queue / cfg.queue_high,
    )
    d = max(
        (obs.tpot_s or 0.0) / cfg.tpot_target_s,
        (obs.handoff_s or 0.0) / cfg.ttft_target_s,
        obs.decode_queue / cfg.queue_high,
        obs.decode_kv_use / cfg.kv_high,
    )
    return p, d


def _cold(cfg: PlannerConfig, obs: Observation) -> tuple[bool, bool]:
    """Whether each role would still be well within target with one instance fewer: its
    queue and latency scaled by n/(n-1) (the same load on fewer instances) stay under
    `headroom` times the limits. A role of one instance is never cold."""
    h = cfg.headroom
    p_scale = _fewer(obs.num_prefill)
    d_scale = _fewer(obs.num_decode)
    p = (
        obs.prefill_queue * p_scale < h * cfg.queue_high
        and (obs.prefill_ttft_s or 0.0) * p_scale < h * cfg.ttft_target_s
    )
    d = (
        obs.decode_queue * d_scale < h * cfg.queue_high
        and (obs.tpot_s or 0.0) * d_scale < h * cfg.tpot_target_s
        and (obs.handoff_s or 0.0) * d_scale < h * cfg.ttft_target_s
        and obs.decode_kv_use * d_scale < h * cfg.kv_high
    )
    return p, d


def _fewer(n: int) -> float:
    return n / (n - 1) if n > 1 else float("inf")


def _can_shrink_p(cfg: PlannerConfig, obs: Observation) -> bool:
    return obs.num_prefill > cfg.min_prefill


def _can_shrink_d(cfg: PlannerConfig, obs: Observation) -> bool:
    return obs.num_decode > cfg.min_decode


def _hold(obs: Observation, reason: str) -> Decision:
    return Decision(Action.HOLD, obs.num_prefill, obs.num_decode, reason)


def _describe(cfg: PlannerConfig, obs: Observation) -> str:
    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x * 1000:.0f} ms"

    pct = f"p{cfg.percentile}"
    return (
        f"{obs.num_prefill}P{obs.num_decode}D: TTFT {pct} {ms(obs.ttft_s)} "
        f"(target {ms(cfg.ttft_target_s)}, handoff {ms(obs.handoff_s)}), "
        f"TPOT {pct} {ms(obs.tpot_s)} "
        f"(target {ms(cfg.tpot_target_s)}), queue P {obs.prefill_queue:.1f} "
        f"D {obs.decode_queue:.1f}, D KV {obs.decode_kv_use:.0%}"
    )
