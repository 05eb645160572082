"""The part of `LLMEngine`'s interface that `AsyncEngine` calls, as a base for test fakes.

A subclass overrides `add_request`, `has_work`, `step` (and `poll_connector` where its
requests' KV lands from a connector); the rest does nothing: no blocks, no connector.
"""

from __future__ import annotations

from pdserve.engine.handle import EngineInfo
from pdserve.engine.types import EngineRequest, EngineStats, LiveRequest, RequestOutput
from pdserve.transfer.params import InstanceInfo, InstanceLimits


def fake_info(
    model_name: str = "fake-model",
    max_model_len: int = 4096,
    limits: InstanceLimits | None = None,
) -> EngineInfo:
    """The `EngineInfo` of a fake engine (`LLMEngine.info` for a real one)."""
    limits = limits or InstanceLimits(role="both", mode=None, block_size=16, vocab_size=256)
    instance = InstanceInfo(
        engine_id="fake",
        incarnation="",
        role=limits.role,
        transfer_mode=limits.mode,
        transport=None,
        side_channel_host=None,
        side_channel_port=None,
        model=model_name,
    )
    return EngineInfo(
        model_name=model_name,
        model_path="/nonexistent",
        max_model_len=max_model_len,
        block_size=limits.block_size,
        limits=limits,
        instance=instance,
    )


class FakeEngine:
    connector = None
    tokenizer = None

    def __init__(self) -> None:
        self.early_outputs = None  # AsyncEngine sets its handoff delivery here

    def info(self) -> EngineInfo:
        return fake_info()

    def live_requests(self) -> list[LiveRequest]:
        return []

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
