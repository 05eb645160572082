"""The planner's decisions: the rules on single observations, and on a simulated trace whose
load shifts from prefill-heavy to decode-heavy, against fixed layouts of the same size."""

from __future__ import annotations

import pytest

from pdserve.planner.config import PlannerConfig
from pdserve.planner.policy import Action, Observation, PlannerState, decide
from pdserve.sim.cluster import ClusterConfig
from pdserve.sim.planner_replay import (
    SHIFT_PLANNER,
    SHIFT_TRACE,
    ShiftingTrace,
    good_share,
    replay_fixed,
    replay_planner,
)
from pdserve.sim.profiles import load_hardware, load_model, load_software

CFG = SHIFT_PLANNER


def _decide(obs: Observation, state: PlannerState | None = None) -> Action:
    return decide(CFG, obs, state or PlannerState())[0].action


def test_prefill_over_target_adds_prefill_within_bounds() -> None:
    assert _decide(Observation(1, 1, ttft_s=4.0, tpot_s=0.01)) is Action.ADD_PREFILL
    # At the size bound with decode idle, a decode instance becomes a prefill one.
    assert _decide(Observation(1, 2, ttft_s=4.0, tpot_s=0.005)) is Action.DECODE_TO_PREFILL
    # At the size bound with decode busy: hold, and say so.
    decision, _ = decide(CFG, Observation(1, 2, ttft_s=4.0, tpot_s=0.02), PlannerState())
    assert decision.action is Action.HOLD
    assert "at its bounds" in decision.reason and "TTFT p90 4000 ms" in decision.reason


def test_ttft_late_because_of_decode_is_decode_s_to_fix() -> None:
    obs = Observation(1, 1, ttft_s=6.0, tpot_s=0.01, handoff_s=5.9)
    assert _decide(obs) is Action.ADD_DECODE


def test_queue_and_kv_count_as_pressure() -> None:
    assert _decide(Observation(1, 1, 0.1, 0.01, prefill_queue=5)) is Action.ADD_PREFILL
    assert _decide(Observation(1, 1, 0.1, 0.01, decode_kv_use=0.95)) is Action.ADD_DECODE


def test_scales_down_only_what_would_stay_well_within_target() -> None:
    # 2P: prefill TTFT 0.3 s would be about 0.6 s on one, under half the 1.5 s target.
    assert _decide(Observation(2, 1, ttft_s=0.3, tpot_s=0.01)) is Action.REMOVE_PREFILL
    # 0.5 s on two would be about 1 s on one: not well within target, so it stays.
    assert _decide(Observation(2, 1, ttft_s=0.5, tpot_s=0.01)) is Action.HOLD
    assert _decide(Observation(1, 2, ttft_s=0.3, tpot_s=0.004)) is Action.REMOVE_DECODE
    assert _decide(Observation(1, 1, ttft_s=0.01, tpot_s=0.001)) is Action.HOLD  # minimums


def test_cooldown_holds_one_decision_after_a_change() -> None:
    hot = Observation(1, 1, ttft_s=4.0, tpot_s=0.01)
    first, state = decide(CFG, hot, PlannerState())
    assert first.action is Action.ADD_PREFILL and (first.num_prefill, first.num_decode) == (2, 1)
    second, state = decide(CFG, Observation(2, 1, ttft_s=4.0, tpot_s=0.01), state)
    assert second.action is Action.HOLD and "cooldown" in second.reason
    third, _ = decide(CFG, Observation(2, 1, ttft_s=4.0, tpot_s=0.05), state)
    assert third.action is Action.HOLD  # both hot, no room: still explained
    assert "no room" in third.reason


def test_both_over_target_grows_what_can_grow() -> None:
    both = Observation(1, 1, ttft_s=4.0, tpot_s=0.1)  # decode further over its target
    assert _decide(both) is Action.ADD_DECODE
    at_max = PlannerConfig(ttft_target_s=1.5, tpot_target_s=0.025, max_decode=1, max_total=3)
    assert decide(at_max, both, PlannerState())[0].action is Action.ADD_PREFILL


def test_bounds_are_checked() -> None:
    with pytest.raises(ValueError):
        PlannerConfig(min_prefill=2, max_prefill=1)
    with pytest.raises(ValueError):
        PlannerConfig(max_total=1)


TRACE = SHIFT_TRACE


@pytest.fixture(scope="module")
def base() -> ClusterConfig:
    return ClusterConfig(
        load_model("qwen3-32b"), load_hardware("h200-p5en"), load_software("vllm-gpu")
    )


@pytest.mark.slow
def test_planner_follows_the_load_shift_and_beats_fixed_layouts(base: ClusterConfig) -> None:
    planned = replay_planner(base, TRACE, CFG, start=(1, 1))
    layouts = [w.layout for w in planned]
    # Prefill-heavy: one more prefill instance after the first window; decode-heavy: a
    # prefill instance becomes a decode one after the first window of the new load.
    assert layouts == [(1, 1), (2, 1), (2, 1), (2, 1), (2, 1), (1, 2), (1, 2), (1, 2)]
    actions = [w.decision.action for w in planned if w.decision is not None]
    assert actions[0] is Action.ADD_PREFILL and actions[4] is Action.PREFILL_TO_DECODE
    assert all(a is Action.HOLD for i, a in enumerate(actions) if i not in (0, 4))
    fixed = {
        lay: good_share(replay_fixed(base, TRACE, CFG, lay)) for lay in [(1, 1), (2, 1), (1, 2)]
    }
    share = good_share(planned)
    assert all(share > other for other in fixed.values()), (share, fixed)
    # Each phase's right layout is the one the planner settled on.
    by_phase = replay_fixed(base, TRACE, CFG, (2, 1))
    assert min(w.good for w in by_phase[1:4]) == pytest.approx(1.0)


@pytest.mark.slow
def test_planner_decisions_are_deterministic(base: ClusterConfig) -> None:
    short = ShiftingTrace(TRACE.phases[:1], window_s=10.0)
    runs = [replay_planner(base, short, CFG, start=(1, 1)) for _ in range(2)]
    assert [w.decision for w in runs[0]] == [w.decision for w in runs[1]]


def test_window_percentile_from_two_scrapes_of_a_histogram() -> None:
    from pdserve.planner.observe import histogram_buckets, window_quantile

    def exposition(counts: tuple[int, int, int]) -> str:
        lines = ["# TYPE t histogram"]
        for bound, count in zip(("0.1", "1.0", "+Inf"), counts, strict=True):
            lines.append(f't_bucket{{le="{bound}"}} {count}')
        return "\n".join([*lines, f"t_count {counts[-1]}", "t_sum 1.0", ""])

    before = histogram_buckets(exposition((5, 5, 5)))["t"]
    after = histogram_buckets(exposition((5, 15, 15)))["t"]  # ten new, all in (0.1, 1]
    assert window_quantile(before, after, 0.5) == pytest.approx(0.55)
    assert window_quantile(before, before, 0.9) is None  # nothing in the window
