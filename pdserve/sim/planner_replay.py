"""The planner in the simulator: a trace whose load shifts, windows, one decision each.

The trace is a sequence of phases (prompt and answer lengths, request rate), each cut into
windows of `window_s`. Every window is one simulated run (`pdserve.sim.run.simulate`) of
that window's requests on the layout in force; the planner observes the window and its
decision is the next window's layout. Windows start empty (no backlog carries over), which
makes each layout's window comparable with a fixed layout's same window; a real cluster
also carries the backlog, which the planner sees on the instances' queues.

`compare` runs the planner and fixed layouts on the same windows and reports, per window,
the layout, the latencies and the share of requests meeting both targets.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from pdserve.bench.dataset import RandomDatasetConfig
from pdserve.bench.serve import BenchConfig
from pdserve.planner.config import PlannerConfig
from pdserve.planner.policy import Decision, Observation, PlannerState, decide
from pdserve.sim.cluster import ClusterConfig
from pdserve.sim.run import SimConfig, record_of, simulate

Layout = tuple[int, int]  # (prefill instances, decode instances)


@dataclass(frozen=True)
class Phase:
    """A stretch of the trace with one kind of load."""

    name: str
    windows: int
    input_len: int
    output_len: int
    request_rate: float  # requests/s (Poisson)


@dataclass(frozen=True)
class ShiftingTrace:
    phases: tuple[Phase, ...]
    window_s: float = 20.0
    seed: int = 0

    def windows(self) -> list[tuple[int, Phase]]:
        """(window index, its phase) in order."""
        flat = [p for p in self.phases for _ in range(p.windows)]
        return list(enumerate(flat))


@dataclass(frozen=True)
class WindowOutcome:
    index: int
    phase: str
    layout: Layout
    ttft_s: float | None  # at the planner's percentile
    tpot_s: float | None
    handoff_s: float | None  # prefill done to first token, at the same percentile
    prefill_queue: float  # requests in prefill per prefill instance, mean (Little's law)
    decode_queue: float  # requests waiting for their first decode token per decode instance
    good: float  # share of the window's requests meeting both targets
    decision: Decision | None = None  # the planner's, made at the end of this window


def simulate_window(
    base: ClusterConfig,
    layout: Layout,
    trace: ShiftingTrace,
    index: int,
    phase: Phase,
    cfg: PlannerConfig,
) -> WindowOutcome:
    """One window of `trace` on `layout` (the cluster's profiles and mode from `base`)."""
    cluster = replace(base, num_prefill=layout[0], num_decode=layout[1])
    workload = BenchConfig(
        random=RandomDatasetConfig(
            input_len=phase.input_len, output_len=phase.output_len, range_ratio=0.0
        ),
        num_prompts=max(1, round(phase.request_rate * trace.window_s)),
        seed=trace.seed * 1000 + index,
        num_warmups=1,
    )
    workload = replace(
        workload, arrivals=replace(workload.arrivals, request_rate=phase.request_rate)
    )
    run = simulate(SimConfig(cluster=cluster, workload=workload))
    records = [record_of(r) for r in run.requests]
    ttfts = [r.ttft for r in records if r.success and r.ttft is not None]
    tpots = [t for r in records if (t := r.tpot) is not None]
    reqs = [r for r in run.requests if r.done and r.prefill_done is not None]
    handoffs = [r.token_times[0] - r.prefill_done for r in reqs]  # type: ignore[operator]
    in_prefill = sum(r.prefill_done - r.send for r in reqs)  # type: ignore[operator]
    good = sum(
        1
        for r in records
        if r.success
        and r.ttft is not None
        and r.ttft <= cfg.ttft_target_s
        and (r.tpot or 0.0) <= cfg.tpot_target_s
    )
    return WindowOutcome(
        index,
        phase.name,
        layout,
        _percentile(ttfts, cfg.percentile),
        _percentile(tpots, cfg.percentile),
        _percentile(handoffs, cfg.percentile),
        in_prefill / run.duration / layout[0],
        sum(handoffs) / run.duration / layout[1],
        good / len(records),
    )


def replay_planner(
    base: ClusterConfig, trace: ShiftingTrace, cfg: PlannerConfig, start: Layout
) -> list[WindowOutcome]:
    """The trace with the planner choosing each next window's layout from `start`."""
    layout, state, out = start, PlannerState(), []
    for index, phase in trace.windows():
        window = simulate_window(base, layout, trace, index, phase, cfg)
        obs = Observation(
            layout[0],
            layout[1],
            window.ttft_s,
            window.tpot_s,
            prefill_queue=window.prefill_queue,
            decode_queue=window.decode_queue,
            handoff_s=window.handoff_s,
        )
        decision, state = decide(cfg, obs, state)
        out.append(replace(window, decision=decision))
        layout = (decision.num_prefill, decision.num_decode)
    return out


def replay_fixed(
    base: ClusterConfig, trace: ShiftingTrace, cfg: PlannerConfig, layout: Layout
) -> list[WindowOutcome]:
    """The trace on one layout throughout."""
    return [simulate_window(base, layout, trace, i, p, cfg) for i, p in trace.windows()]


def good_share(outcomes: list[WindowOutcome]) -> float:
    """The share of windows' requests meeting both targets, windows weighted equally."""
    return float(np.mean([o.good for o in outcomes]))


def _percentile(values: list[float], pct: int) -> float | None:
    return float(np.percentile(values, pct)) if values else None


# The shift `pdserve sim --planner-shift` and tests/test_planner.py replay: for one H200
# per instance serving Qwen3-32B (vLLM's profile), 4,096-token prompts with 16-token
# answers at 2.5 requests/s, then 128-token prompts with 512-token answers at 30/s.
SHIFT_TRACE = ShiftingTrace(
    (
        Phase("prefill-heavy", 4, input_len=4096, output_len=16, request_rate=2.5),
        Phase("decode-heavy", 4, input_len=128, output_len=512, request_rate=30.0),
    ),
    window_s=10.0,
)
SHIFT_PLANNER = PlannerConfig(
    ttft_target_s=1.5, tpot_target_s=0.025, max_prefill=2, max_decode=2, max_total=3
)
FIXED_LAYOUTS: tuple[Layout, ...] = ((1, 1), (2, 1), (1, 2))


def shift_report(
    base: ClusterConfig,
    trace: ShiftingTrace = SHIFT_TRACE,
    cfg: PlannerConfig = SHIFT_PLANNER,
) -> str:
    """The planner's windows (layout, latencies, share meeting the targets, decision) and
    its share against each fixed layout's, as text."""
    planned = replay_planner(base, trace, cfg, start=FIXED_LAYOUTS[0])
    lines = ["window  phase          layout  TTFT      TPOT     good  decision"]
    for w in planned:
        decision = w.decision.action.value if w.decision else "-"
        lines.append(
            f"{w.index:>6}  {w.phase:<13}  {w.layout[0]}P{w.layout[1]}D    "
            f"{_ms(w.ttft_s):>8}  {_ms(w.tpot_s):>7}  {w.good:>4.0%}  {decision}"
        )
        if w.decision is not None:
            lines.append(f"        {w.decision.reason}")
    lines.append(f"\nrequests meeting both targets (p{cfg.percentile}), mean over windows:")
    lines.append(f"  planner  {good_share(planned):.0%}")
    for layout in FIXED_LAYOUTS:
        share = good_share(replay_fixed(base, trace, cfg, layout))
        lines.append(f"  {layout[0]}P{layout[1]}D     {share:.0%}")
    return "\n".join(lines)


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.0f} ms"
