"""The simulator's event loop and FIFO servers: ordering, ties, determinism."""

from __future__ import annotations

import pytest

from pdserve.sim.engine import EventLoop, FifoServer


def test_events_run_in_time_order_and_ties_in_scheduling_order() -> None:
    loop = EventLoop()
    seen: list[tuple[float, str]] = []
    for time, name in [(2.0, "c"), (1.0, "a"), (2.0, "d"), (1.0, "b"), (0.5, "first")]:
        loop.at(time, lambda n=name: seen.append((loop.now, n)))
    loop.run()
    assert seen == [(0.5, "first"), (1.0, "a"), (1.0, "b"), (2.0, "c"), (2.0, "d")]


def test_events_scheduled_while_running_at_the_same_time_run_after() -> None:
    loop = EventLoop()
    seen: list[str] = []

    def outer() -> None:
        seen.append("outer")
        loop.after(0.0, seen.append, "inner")

    loop.at(1.0, outer)
    loop.at(1.0, seen.append, "sibling")
    loop.run()
    assert seen == ["outer", "sibling", "inner"]


def test_cannot_schedule_in_the_past() -> None:
    loop = EventLoop()
    loop.at(1.0, lambda: None)
    loop.run()
    with pytest.raises(ValueError):
        loop.at(0.5, lambda: None)


def test_run_until_leaves_later_events() -> None:
    loop = EventLoop()
    seen: list[float] = []
    for t in (1.0, 2.0, 3.0):
        loop.at(t, seen.append, t)
    loop.run(until=2.0)
    assert seen == [1.0, 2.0]
    assert loop.pending() == 1


def test_fifo_server_serialises_jobs() -> None:
    server = FifoServer()
    assert server.reserve(1.0, 2.0) == (1.0, 3.0)
    assert server.reserve(2.0, 1.0) == (3.0, 4.0)  # waits for the first job
    assert server.reserve(10.0, 0.5) == (10.0, 10.5)  # idle until ready
    assert server.busy_time == 3.5
