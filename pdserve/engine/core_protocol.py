"""Messages between an instance's front end and its engine core process (`--engine-process`).

Two ZMQ sockets over IPC in a private directory the front end makes: the front end binds
both; the core connects a PULL to `to_core` and a PUSH to `from_core`. The core is started
with its `CoreSpec` on stdin. Every message is a tagged msgspec struct, encoded as msgpack.

    front end -> core:  Add | Abort | Release | Stop
    core -> front end:  Ready (once, after the engine is built) | StartFailed | Step ...

A `Step` carries the outputs of one engine iteration, in the order the engine made them, and
now and then a `Snapshot` of the live state the front end reads (module doc of
pdserve.engine.handle).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec

from pdserve.config import ConnectorConfig, EngineConfig, TransportConfig
from pdserve.engine.commands import Command
from pdserve.engine.handle import EngineInfo
from pdserve.engine.types import EngineStats, LiveRequest, RequestOutput
from pdserve.transfer.stats import ConnectorMetrics


class CoreSpec(msgspec.Struct, frozen=True, kw_only=True):
    """What the core builds (the front end's parsed flags) and where it connects."""

    engine: EngineConfig
    connector: ConnectorConfig | None  # None: a monolithic instance
    transport: TransportConfig | None
    to_core: str  # ZMQ endpoint the core receives on
    from_core: str  # ZMQ endpoint the core sends on
    log_level: str = "info"


class Snapshot(msgspec.Struct, frozen=True, kw_only=True):
    """Live engine state for the front end's reads (at most `SNAPSHOT_S` old while busy)."""

    stats: EngineStats
    live: list[LiveRequest]
    transfers_in_use: list[str]  # transfer ids the connector still has blocks under
    peers: dict[str, tuple[str, int]]  # engine id -> (incarnation, KV blocks)
    connector: ConnectorMetrics | None = None


class Ready(msgspec.Struct, frozen=True, tag=True, kw_only=True):
    info: EngineInfo
    snapshot: Snapshot


class StartFailed(msgspec.Struct, frozen=True, tag=True, kw_only=True):
    """The engine could not be built; the core exits with `status` after sending this."""

    error: str
    status: int


class Step(msgspec.Struct, frozen=True, tag=True, kw_only=True):
    outputs: list[RequestOutput]
    snapshot: Snapshot | None = None


ToCore = Command  # Add | Abort | Release | Stop (pdserve.engine.commands)
FromCore = Ready | StartFailed | Step


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, Path):
        return str(obj)
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


def _dec_hook(kind: type, obj: Any) -> Any:
    if kind is Path:
        return Path(obj)
    raise NotImplementedError(f"cannot decode {kind}")


class Codec:
    """Encoders and decoders for one side of the channel (not thread-safe: one per thread
    that uses it)."""

    def __init__(self) -> None:
        self.encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
        self.spec = msgspec.msgpack.Decoder(CoreSpec, dec_hook=_dec_hook)
        self.to_core = msgspec.msgpack.Decoder(ToCore)
        self.from_core = msgspec.msgpack.Decoder(FromCore)

    def encode(self, msg: msgspec.Struct) -> bytes:
        return self.encoder.encode(msg)
