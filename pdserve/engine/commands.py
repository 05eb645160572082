"""What an engine loop is told by its front end (pdserve.engine.loop): add a request, abort
one, release a transfer, stop. The same typed messages go over a thread-safe queue (in-thread
engine) and, msgpack-encoded, over ZMQ to an engine core process (pdserve.engine.core_protocol).
"""

from __future__ import annotations

import msgspec

from pdserve.engine.types import EngineRequest


class Add(msgspec.Struct, frozen=True, tag=True):
    request: EngineRequest


class Abort(msgspec.Struct, frozen=True, tag=True):
    request_id: str


class Release(msgspec.Struct, frozen=True, tag=True):
    """P: the router's release of a transfer (pdserve.transfer.release); already verified
    by the front end."""

    transfer_id: str


class Stop(msgspec.Struct, frozen=True, tag=True):
    """Abort every request and exit."""


Command = Add | Abort | Release | Stop
