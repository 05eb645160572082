"""The load model and the load_aware policy: choice logic on stub candidates (no servers)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from hypothesis import given
from hypothesis import strategies as st
from msgspec.structs import replace as replace_struct

from pdserve.router.load_model import Demand, decode_score, prefill_finish_s
from pdserve.router.policy import LoadAware
from pdserve.server.load_report import LoadReport


@dataclass(frozen=True)
class Stub:
    url: str
    load: LoadReport | None = None
    outstanding: int = 0
    outstanding_tokens: int = 0
    unreported_legs: int = 0
    unreported_prompt_tokens: int = 0
    unreported_decode_tokens: int = 0


def report(
    running: int = 0,
    tokens_left: int = 0,
    steps: float | None = None,
    prefill_left: int = 0,
    prefill_rate: float | None = None,
    kv_used: int = 0,
) -> LoadReport:
    return LoadReport(
        num_running=running,
        num_waiting=0,
        num_waiting_for_kv=0,
        kv_blocks_used=kv_used,
        kv_blocks_total=100,
        decode_tokens_left=tokens_left,
        prefill_tokens_left=prefill_left,
        decode_steps_per_s=steps,
        prefill_tokens_per_s=prefill_rate,
    )


loads = st.builds(
    report,
    running=st.integers(0, 64),
    tokens_left=st.integers(0, 20_000),
    steps=st.floats(1.0, 500.0),
)
demands = st.builds(
    Demand,
    prompt_tokens=st.integers(1, 8000),
    decode_tokens=st.integers(1, 1000),
    ready_in_s=st.floats(0.0, 30.0),
)


def decode_pick(candidates: list[Stub], demand: Demand) -> str:
    return LoadAware("decode").pick(candidates, demand).url


@given(loads, demands, st.floats(1.5, 10.0))
def test_a_slower_instance_with_the_same_load_is_never_chosen(
    load: LoadReport, demand: Demand, slowdown: float
) -> None:
    assert load.decode_steps_per_s is not None
    slow = replace_struct(load, decode_steps_per_s=load.decode_steps_per_s / slowdown)
    assert decode_pick([Stub("slow", slow), Stub("fast", load)], demand) == "fast"
    assert decode_pick([Stub("fast", load), Stub("slow", slow)], demand) == "fast"


@given(loads, demands, st.integers(1, 5000))
def test_more_tokens_owed_at_the_same_speed_never_scores_better(
    load: LoadReport, demand: Demand, extra: int
) -> None:
    busier = replace_struct(load, decode_tokens_left=load.decode_tokens_left + extra)
    assert decode_score(Stub("b", busier), demand, load.decode_steps_per_s, None) >= decode_score(
        Stub("a", load), demand, load.decode_steps_per_s, None
    )


@given(loads, demands, st.floats(0.1, 30.0))
def test_a_later_kv_arrival_never_makes_an_instance_look_busier(
    load: LoadReport, demand: Demand, later: float
) -> None:
    """Work done while the prompt is being prefilled elsewhere is subtracted."""
    c = Stub("d", load)
    steps = load.decode_steps_per_s
    later_demand = replace(demand, ready_in_s=demand.ready_in_s + later)
    assert decode_score(c, later_demand, steps, None) <= decode_score(c, demand, steps, None)


def test_a_long_prefill_lets_a_busy_instance_drain_first() -> None:
    """At dispatch A owes more than B, but A works faster: by the time a long prompt's KV
    arrives A has drained, so a long prompt goes to A and a short one to B."""
    a = Stub("a", report(running=8, tokens_left=2000, steps=50.0))  # 400 tokens/s
    b = Stub("b", report(running=1, tokens_left=100, steps=50.0))  # 50 tokens/s
    short = Demand(prompt_tokens=32, decode_tokens=64, ready_in_s=0.0)
    long = Demand(prompt_tokens=8000, decode_tokens=64, ready_in_s=6.0)
    assert decode_pick([a, b], short) == "b"
    assert decode_pick([a, b], long) == "a"


def test_unreported_legs_count_until_the_next_report() -> None:
    """A burst sent since the last poll must not all land on the instance that looked idle."""
    was_idle = Stub(
        "a",
        report(steps=100.0),
        outstanding=4,
        outstanding_tokens=400,
        unreported_legs=4,
        unreported_decode_tokens=400,
    )
    reported = Stub("b", report(running=1, tokens_left=100, steps=100.0))
    assert decode_pick([was_idle, reported], Demand(10, 100)) == "b"


def test_unknown_rates_fall_back_to_tokens_then_to_the_known_mean() -> None:
    a = Stub("a", None, outstanding=1, outstanding_tokens=300)
    b = Stub("b", None, outstanding=1, outstanding_tokens=100)
    assert decode_pick([a, b], Demand(10, 10)) == "b"  # no rates at all: fewest tokens
    # An instance without a measured rate is taken to work at the others' mean rate.
    fast = Stub("fast", report(running=1, tokens_left=50, steps=100.0))
    new = Stub("new", report(running=0, tokens_left=0, steps=None))
    assert decode_pick([fast, new], Demand(10, 10)) == "new"


def test_an_instance_out_of_kv_blocks_is_avoided() -> None:
    full = Stub("full", report(running=1, tokens_left=10, steps=100.0, kv_used=99))
    roomy = Stub("roomy", report(running=1, tokens_left=15, steps=100.0, kv_used=10))
    assert decode_pick([full, roomy], Demand(10, 10)) == "roomy"


def test_prefill_choice_uses_backlog_and_rate() -> None:
    slow_empty = Stub("slow", report(prefill_left=0, prefill_rate=100.0))
    fast_busy = Stub("fast", report(prefill_left=1000, prefill_rate=2000.0))
    policy = LoadAware("prefill")
    # 1000 tokens: slow takes 10 s, fast (1000 + 1000) / 2000 = 1 s.
    assert policy.pick([slow_empty, fast_busy], Demand(1000, 10)).url == "fast"
    assert prefill_finish_s(fast_busy, 1000, 2000.0) == 1.0
    assert prefill_finish_s(fast_busy, 1000, None) is None


def test_equal_instances_share_the_traffic() -> None:
    a, b = Stub("a", report(steps=50.0)), Stub("b", report(steps=50.0))
    policy = LoadAware("decode")
    assert {policy.pick([a, b], Demand(10, 10)).url for _ in range(2)} == {"a", "b"}
