"""The validation sets of docs/simulator.md: structure, and the claims the page makes.

Only qualitative claims and the tuned point are asserted; the errors at held-out points are
reported in the docs, not pinned here (pinning them would turn a prediction into a fit).
"""

from __future__ import annotations

import pytest

from pdserve.sim.costs import SeqWork, step_flops
from pdserve.sim.profiles import load_hardware, load_model
from pdserve.sim.run import run_sim
from pdserve.sim.validation import Outcome, evaluate, load_validation, point_config, table


@pytest.fixture(scope="module")
def seed() -> list[Outcome]:
    return evaluate(load_validation("seed-p5en"))


def _get(outcomes: list[Outcome], **match) -> Outcome:
    hits = [o for o in outcomes if all(getattr(o.point, k) == v for k, v in match.items())]
    assert len(hits) == 1, match
    return hits[0]


def test_validation_sets_load_and_name_their_tuned_points() -> None:
    for name in ("seed-p5en", "vllm-cpu-fieldnotes", "pdserve-cpu-sweep"):
        vs = load_validation(name)
        assert vs.points and any(p.tuned for p in vs.points)
        assert sum(not p.tuned for p in vs.points) > sum(p.tuned for p in vs.points)
    with pytest.raises(ValueError):
        load_validation("nope")


def test_seed_light_load_tpot_the_tuned_point(seed: list[Outcome]) -> None:
    for mode in ("pull", "push"):
        o = _get(seed, source="seed", input_len=1024, mode=mode, metric="median_tpot_ms")
        assert o.point.tuned
        assert 5.3 <= o.simulated <= 6.1  # published 5.6-5.8 ms


def test_seed_heavy_load_pull_tpot_rises_and_push_holds(seed: list[Outcome]) -> None:
    """Held out: pull's READ setup in D's loop raises TPOT at 16k; push's does not."""
    for rate in (4, 8):
        pull = _get(seed, input_len=16384, rate=rate, mode="pull", metric="median_tpot_ms")
        push = _get(seed, input_len=16384, rate=rate, mode="push", metric="median_tpot_ms")
        assert not pull.point.tuned and not push.point.tuned
        assert pull.simulated > 1.5 * push.simulated
        assert abs(pull.error_pct) < 25  # published 10.4 ms


def test_seed_heaviest_point_saturates_a_p5en_prefill_node() -> None:
    """The arithmetic docs/simulator.md gives for why 16k x 8 req/s cannot be steady."""
    m, hw = load_model("qwen3-32b"), load_hardware("h200-p5en")
    chunks = (SeqWork(8192, 0, False), SeqWork(8192, 8192, True))  # 16k in two steps
    flops = sum(step_flops(m, [w]) for w in chunks)
    assert 8 * flops > hw.devices_per_node * hw.peak_flops
    result = run_sim(point_config(load_validation("seed-p5en"), 16384, 128, 8.0, "push"))
    assert result.request_throughput < 4.0  # P, not the offered 8 req/s, sets the pace


def test_seed_push_never_loses_to_pull_on_ttft(seed: list[Outcome]) -> None:
    pull = _get(seed, input_len=16384, rate=8, mode="pull", metric="median_ttft_ms")
    push = _get(seed, input_len=16384, rate=8, mode="push", metric="median_ttft_ms")
    assert push.simulated <= pull.simulated


def test_vllm_cpu_push_handoff_collapses_when_p_is_busy() -> None:
    """Held out: the field notes' push handoff jumps by an order of magnitude once P's
    core is busy (its writer waits a P step), while pull's stays put."""
    outcomes = evaluate(load_validation("vllm-cpu-fieldnotes"))
    handoff = {
        (o.point.input_len, o.point.rate, o.point.mode): o.simulated
        for o in outcomes
        if o.point.metric == "median_handoff_ms"
    }
    idle, busy = (4096, float("inf")), (4096, 4.0)
    assert handoff[(*busy, "push")] > 5 * handoff[(*idle, "push")]
    assert handoff[(*busy, "pull")] < 1.5 * handoff[(*idle, "pull")]
    assert handoff[(*idle, "pull")] > handoff[(*idle, "push")]
    assert "| field notes |" in table(outcomes)
