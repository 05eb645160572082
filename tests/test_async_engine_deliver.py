"""`AsyncEngine` hands one step's outputs to the event loop in one wake-up, in step order.

Each `call_soon_threadsafe` writes the loop's self-pipe, a system call that lets the loop
thread take the GIL from the engine thread; with many streams the engine used to pay that
once per stream per step (scripts/bench/perf/deliver_mb.py measures the cost). A fake engine
runs a batch of streams for a few steps; the test counts the loop's thread-safe wake-ups.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.types import EngineRequest, FinishReason, RequestOutput, SamplingParams
from tests.fake_engines import FakeEngine

pytestmark = pytest.mark.timeout(60)

STREAMS, STEPS = 8, 3


class BatchEngine(FakeEngine):
    """Stands in for LLMEngine: steps only once all STREAMS requests are in, then every step
    emits one token per request; the last step finishes them all."""

    def __init__(self) -> None:
        super().__init__()
        self.rids: list[str] = []
        self.steps = 0

    def add_request(self, er: EngineRequest) -> list[RequestOutput]:
        self.rids.append(er.request_id)
        return []

    def has_work(self) -> bool:
        return len(self.rids) == STREAMS and self.steps < STEPS

    def step(self) -> list[RequestOutput]:
        self.steps += 1
        outs = []
        for rid in self.rids:
            out = RequestOutput(request_id=rid, new_token_ids=[self.steps], new_text="x")
            if self.steps == STEPS:
                out.finished, out.finish_reason = True, FinishReason.LENGTH
            outs.append(out)
        return outs


def test_one_loop_wake_up_per_step_and_tokens_in_order() -> None:
    engine = AsyncEngine(BatchEngine())
    engine.start()
    wakeups: list[str] = []

    async def stream(i: int) -> list[list[int]]:
        request = EngineRequest(
            request_id=f"r{i}", prompt_token_ids=[1, 2], params=SamplingParams(max_tokens=STEPS)
        )
        return [out.new_token_ids async for out in engine.generate(request)]

    async def main() -> list[list[list[int]]]:
        loop = asyncio.get_running_loop()
        real = loop.call_soon_threadsafe

        def counting(*args, **kwargs):
            if threading.current_thread().name == "pdserve-engine":
                wakeups.append(getattr(args[0], "__name__", "?"))
            return real(*args, **kwargs)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        return await asyncio.gather(*(stream(i) for i in range(STREAMS)))

    try:
        tokens = asyncio.run(main())
    finally:
        engine.shutdown()
    assert tokens == [[[1], [2], [3]]] * STREAMS
    assert len(wakeups) == STEPS, wakeups
