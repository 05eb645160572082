"""The KV cache as seen by a transport: the engine's regions, block-aligned descriptors.

Both sides register the regions of their `KVRegions` (pdserve.transfer.adapter) first and
in the same order, so region i is the same on every instance of one engine and model and
descriptors name it on both ends (pdserve's engine: one region "kv"; vLLM: one per
layer). The connector works in (region, offset, length) descriptors; this adapter turns
them into the transport's arrays, a transfer's state into (finished, error), and releases
finished handles.

Ownership: the engine owns the KV tensors; the transport keeps a reference to them until
`close()`. Bytes named by an in-flight transfer belong to the transport until `poll`
reports it finished (see pdserve.transfer.transport.base).
"""

from __future__ import annotations

import itertools
import time

import numpy as np

from pdserve.config import TransportConfig
from pdserve.transfer.adapter import KVRegions
from pdserve.transfer.descriptors import Desc
from pdserve.transfer.transport import (
    PeerId,
    TransferHandle,
    TransferState,
    Transport,
    TransportError,
    create_transport,
)

Descs = list[Desc]

# nixl makes progress only when polled; the interval a waiting caller sleeps between polls.
_NIXL_POLL_S = 0.0005


class KVTransport:
    """A transport bound to one instance's KV cache region."""

    def __init__(self, transport: Transport, kv: KVRegions, kind: str, fail_every: int = 0) -> None:
        self.transport = transport
        self.kind = kind
        self._fail_every = fail_every  # fault injection (tests): every Nth post fails
        self._posts = itertools.count(1)
        for i, (name, tensor) in enumerate(kv.regions()):
            region = transport.register(name, tensor, granule=kv.block_nbytes)
            if region != i:  # descriptors name regions by their order on both ends
                raise RuntimeError(f"region {name} registered as {region}, expected {i}")

    def local_metadata(self) -> bytes:
        return self.transport.local_metadata()

    def add_peer(self, metadata: bytes) -> PeerId:
        return self.transport.add_peer(metadata)

    def remove_peer(self, peer: PeerId) -> None:
        """Close the links to `peer`: its pending transfers fail, nothing more lands."""
        self.transport.remove_peer(peer)

    @staticmethod
    def _descs(descs: Descs) -> np.ndarray:
        return np.array(descs, dtype=np.int64).reshape(len(descs), 3)

    def write(
        self, peer: PeerId, local: Descs, remote: Descs, notif: bytes | None
    ) -> TransferHandle:
        self._maybe_fail()
        return self.transport.write(peer, self._descs(local), self._descs(remote), notif)

    def read(
        self, peer: PeerId, local: Descs, remote: Descs, notif: bytes | None
    ) -> TransferHandle:
        self._maybe_fail()
        return self.transport.read(peer, self._descs(local), self._descs(remote), notif)

    def _maybe_fail(self) -> None:
        n = next(self._posts)
        if self._fail_every and n % self._fail_every == 0:
            raise TransportError(f"injected transfer fault (post #{n})")

    def poll(self, handle: TransferHandle) -> tuple[bool, str | None]:
        """(finished, error); a finished handle is released here."""
        state = self.transport.state(handle)
        if state is TransferState.PENDING:
            return False, None
        error = self.transport.error(handle) if state is TransferState.ERROR else None
        self.transport.release(handle)
        return True, error

    def wait(self, handle: TransferHandle, timeout_s: float) -> tuple[bool, str | None]:
        """`poll` after blocking up to `timeout_s` for the transfer to finish. The tcp backend
        wakes the caller on completion; nixl only progresses when polled, so there this
        sleeps a short poll interval instead of burning the caller's core."""
        if self.kind == "nixl":
            time.sleep(min(timeout_s, _NIXL_POLL_S))
        else:
            self.transport.wait(handle, timeout_s)
        return self.poll(handle)

    def send_notif(self, peer: PeerId, payload: bytes) -> None:
        """A small message to `peer`, ordered after the transfers posted before it."""
        self.transport.send_notif(peer, payload)

    def wait_notifs(self, timeout_s: float) -> list[bytes]:
        return [n.payload for n in self.transport.wait_notifs(timeout_s)]

    def stopped(self) -> list[str]:
        return self.transport.stopped()

    def close(self) -> None:
        self.transport.close()


def open_kv_transport(
    cfg: TransportConfig, engine_id: str, kv: KVRegions, fail_every: int = 0
) -> KVTransport:
    """Start the configured backend and register the KV regions with it."""
    return KVTransport(create_transport(cfg, engine_id), kv, cfg.kind, fail_every)
