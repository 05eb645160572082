"""The engine thread waits for the event loop to take a handoff's output before its next step.

The first token of a P/D request on D (P's, handed over when the KV lands) used to sit on
the event loop while D's engine thread went straight into the next decode step: on D's one
core the loop then waited for the GIL and the CPU, 3.3 ms at the median. The same holds for
P's answer to a prefill leg when P goes on with another prompt. `AsyncEngine` now waits
until the loop has run the consumers of those outputs (bounded by `flush_s`).

Fake engines stand in for `LLMEngine`: D's connector poll yields one first token, P's step
finishes a prefill leg; the next step notes whether the consumer on the loop had that
output already. The bound is set far above any machine's delay, so the outcome does not
depend on speed.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from pdserve.engine.async_engine import AsyncEngine
from pdserve.engine.types import (
    EngineRequest,
    FinishReason,
    KVTransferParams,
    RequestOutput,
    SamplingParams,
)
from tests.fake_engines import FakeEngine

pytestmark = pytest.mark.timeout(60)


class FirstTokenEngine(FakeEngine):
    """Stands in for LLMEngine: a request whose KV lands at once, then one decode step."""

    def __init__(self) -> None:
        super().__init__()
        self.consumed = threading.Event()  # set by the consumer on the event loop
        self.consumed_before_step: bool | None = None
        self._rid: str | None = None
        self._landed = False
        self._running = False

    def add_request(self, er: EngineRequest) -> list[RequestOutput]:
        self._rid = er.request_id
        self._landed = True
        return []

    def poll_connector(self, busy=()) -> list[RequestOutput]:
        if not self._landed:
            return []
        self._landed, self._running = False, True
        return [RequestOutput(request_id=self._rid, new_token_ids=[7], new_text="a")]

    def has_work(self) -> bool:
        return self._running

    def step(self) -> list[RequestOutput]:
        if self.consumed_before_step is None:
            self.consumed_before_step = self.consumed.is_set()
        self._running = False
        out = RequestOutput(request_id=self._rid, new_token_ids=[8], new_text="b")
        out.finished, out.finish_reason = True, FinishReason.LENGTH
        return [out]


class PrefillLegEngine(FirstTokenEngine):
    """Stands in for P's LLMEngine: a prefill leg that finishes, then another prompt's step."""

    def add_request(self, er: EngineRequest) -> list[RequestOutput]:
        self._rid = er.request_id
        self._running = True
        self._steps = 0
        return []

    def poll_connector(self, busy=()) -> list[RequestOutput]:
        return []

    def step(self) -> list[RequestOutput]:
        self._steps += 1
        if self._steps == 1:  # the prompt is done: P's answer, with the transfer params
            out = RequestOutput(request_id=self._rid, new_token_ids=[7], new_text="a")
            out.finished, out.finish_reason = True, FinishReason.LENGTH
            out.kv_transfer_params = KVTransferParams(transfer_mode="push", transfer_id="t")
            return [out]
        self.consumed_before_step = self.consumed.is_set()  # the next prompt's step
        self._running = False
        return []


def test_next_step_waits_until_the_loop_took_the_first_token() -> None:
    fake = FirstTokenEngine()
    engine = AsyncEngine(fake, flush_s=30.0)
    engine.start()
    request = EngineRequest(
        request_id="r", prompt_token_ids=[1, 2, 3], params=SamplingParams(max_tokens=2)
    )

    async def consume() -> list[list[int]]:
        tokens = []
        async for out in engine.generate(request):
            fake.consumed.set()
            tokens.append(out.new_token_ids)
        return tokens

    try:
        tokens = asyncio.run(consume())
    finally:
        engine.shutdown()
    assert tokens == [[7], [8]]
    assert fake.consumed_before_step is True


def test_next_step_waits_until_the_loop_took_a_finished_prefill_leg() -> None:
    fake = PrefillLegEngine()
    # Here the loop may end (asyncio.run returns) before the flush's callback runs on it:
    # then the engine thread waits out `flush_s`, which the wait below must outlast.
    engine = AsyncEngine(fake, flush_s=10.0)
    engine.start()
    request = EngineRequest(
        request_id="p", prompt_token_ids=[1, 2, 3], params=SamplingParams(max_tokens=1)
    )

    async def consume() -> None:
        async for out in engine.generate(request):
            assert out.kv_transfer_params is not None
            fake.consumed.set()

    try:
        asyncio.run(consume())
        deadline = time.monotonic() + 40.0
        while fake.consumed_before_step is None and time.monotonic() < deadline:
            time.sleep(0.01)  # the engine thread runs its next step after the answer
    finally:
        engine.shutdown()
    assert fake.consumed_before_step is True
