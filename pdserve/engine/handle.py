"""What an instance's front end (HTTP app, admission gate, load and metrics routes) may ask of
its engine, wherever the engine runs.

Two implementations: `AsyncEngine` drives the engine in a thread of the front end's process;
`EngineCoreClient` talks to an engine core in a child process (`--engine-process`). The
front end never reaches past this interface into the engine, its scheduler or its KV
blocks: the engine (thread or process) owns all of them.

Reads of live state (`stats`, `live_requests`, `transfer_in_use`, `peer_num_blocks`,
`connector_metrics`) may be a little stale: in-process they are racy reads of counters and
dicts the engine thread writes; across processes they come from the core's last snapshot.
Each use tolerates that: the engine re-checks admission itself, and a load report or a
scrape a few milliseconds old is still a load report.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

import msgspec

from pdserve.engine.types import EngineRequest, EngineStats, LiveRequest, RequestOutput
from pdserve.model.tokenizer import Tokenizer
from pdserve.transfer.params import InstanceInfo, InstanceLimits, KVTransferParams
from pdserve.transfer.release import ReleaseAuth
from pdserve.transfer.stats import ConnectorMetrics


class EngineDeadError(RuntimeError):
    """The engine loop died; the instance can no longer serve."""


class EngineInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What the front end needs to know about its engine; fixed once the engine is built."""

    model_name: str
    model_path: str  # the model directory (the front end loads the tokenizer from it)
    max_model_len: int
    block_size: int
    limits: InstanceLimits  # for checking `kv_transfer_params` at admission
    instance: InstanceInfo  # the body of `GET /kv/info`


class EngineHandle(Protocol):
    """The front end's view of its engine (see the module docstring)."""

    info: EngineInfo
    tokenizer: Tokenizer
    error: BaseException | None  # why the engine stopped, if it failed

    @property
    def is_alive(self) -> bool: ...

    def start(self) -> None: ...

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine; requests still running end with ABORT."""

    def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """Submit `request`; yields its outputs until the finished one. Closing the
        iterator early aborts the request (the engine frees its KV blocks)."""

    def abort(self, request_id: str) -> None: ...

    def stats(self) -> EngineStats: ...

    def live_requests(self) -> list[LiveRequest]:
        """The engine's live requests' progress, for `GET /load`."""

    def connector_metrics(self) -> ConnectorMetrics | None:
        """The KV connector's counters (None on a monolithic instance)."""

    def transfer_in_use(self, transfer_id: str) -> bool:
        """Whether the connector still has blocks under `transfer_id`."""

    def peer_num_blocks(self, engine_id: str, incarnation: str) -> int | None:
        """The KV cache size of a peer known from a handshake, or None."""

    def check_params(self, params: KVTransferParams) -> None:
        """D: raise InvalidKVTransferParams if a decode leg with `params` must not be
        admitted (pull with a cluster token: P's signature)."""

    def check_release(self, transfer_id: str, signature: str | None) -> ReleaseAuth:
        """P: whether the router's release of `transfer_id` is signed with this
        instance's cluster token (always OK without one; pdserve.transfer.release)."""

    def release_transfer(self, transfer_id: str) -> None:
        """P: queue the router's release of `transfer_id` for the engine (which frees
        only what no decode instance uses; pdserve.transfer.connector). Any thread."""
