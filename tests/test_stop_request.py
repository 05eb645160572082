"""`pdserve.stop_request`: the stop signals of `pdserve up` never block in their handler."""

from __future__ import annotations

import os
import signal
import sys
import threading
from types import FrameType
from typing import Any

import pytest

from pdserve.stop_request import StopFlag, StopRequest


def test_before_it_is_armed_a_signal_interrupts_then_it_only_sets_the_flag() -> None:
    stop = StopRequest()
    with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
        stop.on_signal(signal.SIGTERM, None)
    assert not stop.requested.is_set()
    stop.armed = True
    stop.on_signal(signal.SIGHUP, None)
    assert stop.requested.is_set() and stop.requested.wait(10.0)


def test_a_second_signal_while_the_first_interrupt_is_handled_does_not_raise() -> None:
    stop = StopRequest()
    with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
        stop.on_signal(signal.SIGTERM, None)
    stop.on_signal(signal.SIGINT, None)  # e.g. during the "stopping" print after the first
    assert stop.armed and stop.requested.is_set()


def test_wait_returns_after_its_timeout_when_nothing_sets_it() -> None:
    assert StopFlag().wait(0.01) is False


def _signal_at_every_line(stop: StopRequest, waited: list[bool]) -> None:
    """Wait on the flag while 'a signal' (the handler, called from a trace hook) arrives
    before every line the waiting thread runs, however deep: where a handler that takes a
    lock the thread holds would block for good."""
    calls = 0

    def tracer(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal calls
        if event == "line" and calls < 10_000:
            calls += 1
            stop.on_signal(signal.SIGTERM, None)
        return tracer

    sys.settrace(tracer)
    try:
        waited.append(stop.requested.wait(30.0))
    finally:
        sys.settrace(None)


def test_the_handler_may_run_at_any_point_of_the_wait_it_ends() -> None:
    stop = StopRequest()
    stop.armed = True
    waited: list[bool] = []
    thread = threading.Thread(target=_signal_at_every_line, args=(stop, waited), daemon=True)
    thread.start()
    thread.join(10.0)
    assert not thread.is_alive(), "the handler blocked inside the wait it interrupted"
    assert waited == [True]


def test_a_real_signal_ends_the_wait_and_the_old_handlers_come_back() -> None:
    before = signal.getsignal(signal.SIGTERM)
    stop = StopRequest()
    with stop.installed():
        stop.armed = True
        timer = threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGTERM))
        timer.start()
        assert stop.requested.wait(30.0)
        timer.join()
    assert signal.getsignal(signal.SIGTERM) is before
