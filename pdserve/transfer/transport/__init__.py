"""KV transports: the `Transport` contract and its backends (tcp built in, nixl optional).

    transport = create_transport(TransportConfig(kind="tcp"), engine_id="prefill-0")
    region = transport.register("kv", kv_tensor, granule=block_nbytes)
    peer = transport.add_peer(metadata_from_the_other_side)
    handle = transport.write(peer, [(region, 0, n)], [(0, 4096, n)], notif=b"done")

nixl is imported only when asked for, so pdserve runs without it.
"""

from __future__ import annotations

from pdserve.config import TransportConfig
from pdserve.transfer.transport.base import (
    AuthError,
    BackendUnavailableError,
    Desc,
    DescriptorError,
    Notification,
    Op,
    PeerError,
    PeerId,
    StalePeerError,
    TransferHandle,
    TransferState,
    Transport,
    TransportError,
)

__all__ = [
    "AuthError",
    "BackendUnavailableError",
    "Desc",
    "DescriptorError",
    "Notification",
    "Op",
    "PeerError",
    "PeerId",
    "StalePeerError",
    "TransferHandle",
    "TransferState",
    "Transport",
    "TransportError",
    "create_transport",
]


def create_transport(config: TransportConfig, engine_id: str) -> Transport:
    """Start the backend `config.kind` for `engine_id` (its listener is up on return).

    Raises BackendUnavailableError for nixl when NIXL is not installed, with the command
    that installs it.
    """
    if config.kind == "tcp":
        from pdserve.transfer.transport.tcp import TcpTransport

        return TcpTransport(config, engine_id)
    if config.kind == "nixl":
        from pdserve.transfer.transport.nixl import NixlTransport

        return NixlTransport(config, engine_id)
    raise ValueError(f"unknown transport kind {config.kind!r} (expected 'tcp' or 'nixl')")
