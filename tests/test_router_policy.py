"""Instance selection: round robin and least loaded, alone and through a running router."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import httpx
import pytest
from test_router_fake_instance import FakeInstance, running_router, wait_for

from pdserve.router.load_model import Demand
from pdserve.router.policy import LeastLoaded, LeastTokens, LoadAware, RoundRobin, make_policy
from pdserve.server.load_report import LoadReport

pytestmark = pytest.mark.timeout(60)

PROMPT = {"model": "fake-model", "prompt": "hello", "max_tokens": 4}
DEMAND = Demand(prompt_tokens=100, decode_tokens=16)


@dataclass
class Stub:
    """A candidate: the router's counts and the instance's last report."""

    url: str
    outstanding: int = 0
    load: LoadReport | None = None
    outstanding_tokens: int = 0
    unreported_legs: int = 0
    unreported_prompt_tokens: int = 0
    unreported_decode_tokens: int = 0


def _load(running: int, waiting: int = 0, **extra: object) -> LoadReport:
    return LoadReport(
        num_running=running,
        num_waiting=waiting,
        num_waiting_for_kv=0,
        kv_blocks_used=0,
        kv_blocks_total=10,
        **extra,  # type: ignore[arg-type]
    )


def test_round_robin_cycles_through_candidates() -> None:
    a, b, c = Stub("a"), Stub("b"), Stub("c")
    policy = RoundRobin()
    picks = [policy.pick([a, b, c], DEMAND).url for _ in range(6)]
    assert picks == ["a", "b", "c", "a", "b", "c"]


def test_least_loaded_prefers_fewest_outstanding_then_reported_load() -> None:
    policy = LeastLoaded()
    assert policy.pick([Stub("a", 2), Stub("b", 1), Stub("c", 3)], DEMAND).url == "b"
    busy, idle = Stub("busy", 1, _load(5)), Stub("idle", 1, _load(0, 1))
    assert policy.pick([busy, idle], DEMAND).url == "idle"
    # Outstanding counts come first: a lower reported load does not beat more legs in flight.
    assert policy.pick([Stub("a", 2, _load(0)), Stub("b", 1, _load(9))], DEMAND).url == "b"


def test_least_loaded_rotates_among_equal_candidates() -> None:
    policy = LeastLoaded()
    a, b = Stub("a"), Stub("b")
    assert {policy.pick([a, b], DEMAND).url for _ in range(2)} == {"a", "b"}


def test_least_tokens_counts_tokens_not_legs() -> None:
    policy = LeastTokens()
    many_small = Stub("small", outstanding=3, outstanding_tokens=30)
    one_big = Stub("big", outstanding=1, outstanding_tokens=500)
    assert policy.pick([one_big, many_small], DEMAND).url == "small"


def test_make_policy_rejects_unknown_names() -> None:
    assert isinstance(make_policy("least_loaded"), LeastLoaded)
    assert isinstance(make_policy("least_tokens"), LeastTokens)
    assert isinstance(make_policy("load_aware", "prefill"), LoadAware)
    with pytest.raises(ValueError):
        make_policy("random")  # type: ignore[arg-type]


def test_router_round_robins_both_roles() -> None:
    with (
        FakeInstance("prefill") as p1,
        FakeInstance("prefill") as p2,
        FakeInstance("decode") as d1,
        FakeInstance("decode") as d2,
        running_router([p1, p2], [d1, d2]) as r,
    ):
        for _ in range(4):
            assert httpx.post(f"{r}/v1/completions", json=PROMPT).status_code == 200
    assert [len(f.received) for f in (p1, p2, d1, d2)] == [2, 2, 2, 2]


def test_router_least_loaded_avoids_the_busy_decode() -> None:
    hold = threading.Event()
    with (
        FakeInstance("prefill") as p,
        # Held until the test releases them (not the fakes' default 10 s, which a slow
        # machine could reach with the busy leg still needed).
        FakeInstance("decode", hold=hold, hold_timeout_s=600) as d1,
        FakeInstance("decode", hold=hold, hold_timeout_s=600) as d2,
        running_router([p], [d1, d2], policy="least_loaded") as r,
    ):
        # One streaming request stays outstanding on whichever D gets it (D holds it) ...
        long = {**PROMPT, "stream": True}
        thread = threading.Thread(
            target=httpx.post, args=(f"{r}/v1/completions",), kwargs={"json": long, "timeout": 30}
        )
        thread.start()
        wait_for(lambda: len(d1.received) + len(d2.received) == 1)
        busy, idle = (d1, d2) if d1.received else (d2, d1)
        idle.behavior.hold = None
        # ... so the next requests all go to the other one.
        statuses = [httpx.post(f"{r}/v1/completions", json=PROMPT).status_code for _ in range(3)]
        hold.set()
        thread.join(10)
    assert statuses == [200, 200, 200]
    assert (len(busy.received), len(idle.received)) == (1, 3)
