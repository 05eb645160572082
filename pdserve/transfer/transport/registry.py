"""Bookkeeping shared by the backends: posted transfers, their states, the notification inbox.

State changes go through `Transfers.finish`, which moves a transfer out of PENDING exactly
once and wakes waiters. Backends decide *when* (an ack arrived, a connection died, NIXL
said DONE); this module only makes the change atomic and observable.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from pdserve.transfer.coalesce import coalesce_pairs
from pdserve.transfer.transport.base import (
    MAX_NOTIF_BYTES,
    DescriptorError,
    Descs,
    Notification,
    Op,
    PeerId,
    TransferHandle,
    TransferState,
    TransportError,
    as_desc_array,
)
from pdserve.transfer.transport.memory import check_descs

PENDING, DONE, ERROR = TransferState.PENDING, TransferState.DONE, TransferState.ERROR


@dataclass(eq=False)
class Xfer:
    """One posted transfer. `local`/`remote` are coalesced (N, 3) arrays."""

    handle: TransferHandle
    local: np.ndarray
    remote: np.ndarray
    notif: bytes | None
    posted: float
    state: TransferState = PENDING
    error: str | None = None
    backend: Any = None  # backend request object (e.g. a NIXL transfer handle)


def check_notif(notif: bytes | None) -> None:
    if notif is not None and len(notif) > MAX_NOTIF_BYTES:
        raise TransportError(f"notification of {len(notif)} bytes (limit {MAX_NOTIF_BYTES})")


def prepare(
    local: Descs, remote: Descs, local_sizes: np.ndarray, remote_sizes: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Validate a paired descriptor list against both size tables (`memory.size_table`),
    then coalesce it."""
    loc, rem = as_desc_array(local), as_desc_array(remote)
    if loc.shape != rem.shape:
        raise DescriptorError(f"{len(loc)} local descriptors vs {len(rem)} remote ones")
    if (loc[:, 2] != rem[:, 2]).any():
        raise DescriptorError("paired local and remote descriptors differ in length")
    check_descs(loc, local_sizes, "local")
    check_descs(rem, remote_sizes, "remote")
    return coalesce_pairs(loc, rem)


class Transfers:
    """All live transfers of one transport, by handle id."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._xfers: dict[int, Xfer] = {}
        self._ids = itertools.count(1)

    def new(
        self, peer: PeerId, op: Op, loc: np.ndarray, rem: np.ndarray, notif: bytes | None
    ) -> Xfer:
        handle = TransferHandle(next(self._ids), peer, op, int(loc[:, 2].sum()), len(loc))
        x = Xfer(handle, loc, rem, notif, time.monotonic())
        with self._cond:
            self._xfers[handle.id] = x
        return x

    def get(self, handle: TransferHandle) -> Xfer:
        x = self._xfers.get(handle.id)
        if x is None:
            raise TransportError(f"unknown or released transfer {handle.id}")
        return x

    def finish(self, x: Xfer, state: TransferState, error: str | None = None) -> bool:
        """Move `x` from PENDING to `state`; False if it had already finished."""
        with self._cond:
            if x.state is not PENDING:
                return False
            x.state, x.error = state, error
            self._cond.notify_all()
            return True

    def wait(self, handle: TransferHandle, timeout_s: float | None) -> TransferState:
        x = self.get(handle)
        with self._cond:
            self._cond.wait_for(lambda: x.state is not PENDING, timeout_s)
            return x.state

    def release(self, handle: TransferHandle) -> Xfer:
        with self._cond:
            x = self._xfers.get(handle.id)
            if x is None:
                raise TransportError(f"unknown or released transfer {handle.id}")
            if x.state is PENDING:
                raise TransportError(f"transfer {handle.id} is still pending")
            del self._xfers[handle.id]
            return x

    def pending(self) -> list[Xfer]:
        with self._cond:
            return [x for x in self._xfers.values() if x.state is PENDING]


class Inbox:
    """Received notifications, oldest first; any thread may add or take."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._items: deque[Notification] = deque()

    def put(self, peer: PeerId, payload: bytes) -> None:
        with self._cond:
            self._items.append(Notification(peer, payload))
            self._cond.notify_all()

    def take(self, timeout_s: float = 0.0) -> list[Notification]:
        with self._cond:
            if timeout_s > 0:
                self._cond.wait_for(lambda: bool(self._items), timeout_s)
            out = list(self._items)
            self._items.clear()
            return out
