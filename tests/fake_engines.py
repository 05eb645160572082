"""The part of `LLMEngine`'s interface that `AsyncEngine` calls, as a base for test fakes.

A subclass overrides `add_request`, `has_work`, `step` (and `poll_connector` where its
requests' KV lands from a connector); the rest does nothing: no blocks, no connector.
"""

from __future__ import annotations

from pdserve.engine.types import EngineRequest, EngineStats, RequestOutput


class FakeEngine:
    connector = None

    def __init__(self) -> None:
        self.early_outputs = None  # AsyncEngine sets its handoff delivery here

    def add_request(self, er: EngineRequest) -> list[RequestOutput]:
        raise NotImplementedError

    def has_work(self) -> bool:
        raise NotImplementedError

    def step(self) -> list[RequestOutput]:
        raise NotImplementedError

    def poll_connector(self, busy=()) -> list[RequestOutput]:
        return []

    def abort_request(self, request_id: str) -> list[RequestOutput]:
        return []

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=0,
            num_waiting=0,
            num_waiting_for_kv=0,
            kv_blocks_used=0,
            kv_blocks_total=1,
            num_preemptions=0,
        )

    def close(self) -> None:
        pass
