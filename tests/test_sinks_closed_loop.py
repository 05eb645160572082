"""Outputs for a request whose event loop has closed are dropped, not raised into the
engine thread (which would stop its loop: the next step never runs)."""

from __future__ import annotations

import asyncio

from pdserve.engine.sinks import Sinks
from pdserve.engine.types import FinishReason, RequestOutput


def test_deliver_and_fail_all_skip_a_closed_loop() -> None:
    sinks = Sinks()

    async def open_one() -> None:
        sinks.open("r")

    asyncio.run(open_one())  # the sink stays registered; its loop is now closed
    out = RequestOutput(request_id="r", new_token_ids=[1], new_text="a")
    assert sinks.deliver([out]) == set()
    sinks.fail_all("engine shut down", FinishReason.ABORT)  # must not raise either


def test_deliver_reaches_an_open_loop() -> None:
    sinks = Sinks()

    async def run() -> RequestOutput:
        sink = sinks.open("r")
        out = RequestOutput(request_id="r", new_token_ids=[1], new_text="a")
        assert sinks.deliver([out]) == {asyncio.get_running_loop()}
        return await asyncio.wait_for(sink.queue.get(), 5)

    assert asyncio.run(run()).new_token_ids == [1]
