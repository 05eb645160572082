"""NIXL-side pieces of the nixl backend: loading NIXL, peer records, descriptor arrays.

Kept apart from `nixl.py` so the transport class reads as the contract's flow, and so that
importing this module never imports NIXL (only `load_nixl()` does).
"""

from __future__ import annotations

import importlib
import socket
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import msgspec
import numpy as np

from pdserve.transfer.transport.base import BackendUnavailableError, MemKind, PeerCard
from pdserve.transfer.transport.memory import size_table

INSTALL_HINT = (
    "the nixl transport needs NIXL: `pip install nixl-cu12` (wheels for Linux x86_64/aarch64; "
    "they also run on machines without a GPU), or use `--transport tcp`"
)
# The `nixl` meta-package re-exports the build that matches the CUDA install; the wheels
# themselves install as nixl_cu12 / nixl_cu13.
_MODULES = ("nixl._api", "nixl_cu12", "nixl_cu13")


def load_nixl() -> ModuleType:
    """The NIXL Python API module (with nixl_agent, nixl_agent_config, nixl_thread_sync_t)."""
    for name in _MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(module, "nixl_agent"):
            return module
    raise BackendUnavailableError(INSTALL_HINT)


class NixlInfo(msgspec.Struct, frozen=True):
    """What the handshake's `extra` carries for nixl: only given after authentication."""

    agent_md: bytes
    scratch: int  # address of an 8-byte buffer the peer may write during warm-up
    bases: dict[int, int]  # region id -> base address


def agent_name(card: PeerCard) -> str:
    return f"{card.engine_id}#{card.incarnation}"


@dataclass(eq=False)
class NixlPeer:
    """One peer incarnation as the nixl backend knows it.

    `sock` is the authenticated side connection, kept open only to notice the peer's death
    (EOF) at once. `remote_lists` are NIXL prepped descriptor lists, one per remote region
    registered with a granule, prepared once at handshake time and reused by every transfer.
    """

    card: PeerCard
    info: NixlInfo
    name: str
    sock: socket.socket | None = None
    remote_lists: dict[int, Any] = field(default_factory=dict)
    dead: str | None = None
    remote_sizes: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.remote_sizes = size_table({r.id: r.size for r in self.card.regions})

    @property
    def alive(self) -> bool:
        return self.dead is None


def granule_rows(base: int, size: int, device: int, granule: int) -> np.ndarray:
    """(size/granule, 3) uint64 rows (address, granule, device): a region cut in granules."""
    n = size // granule
    rows = np.empty((n, 3), dtype=np.uint64)
    rows[:, 0] = base + np.arange(n, dtype=np.uint64) * np.uint64(granule)
    rows[:, 1] = granule
    rows[:, 2] = device
    return rows


def expand_granules(offsets: np.ndarray, lengths: np.ndarray, granule: int) -> np.ndarray:
    """Indices of the granules covered by granule-aligned (offset, length) pairs, in order."""
    starts, counts = offsets // granule, lengths // granule
    if (counts == 1).all():  # one granule per descriptor: nothing to expand
        return starts.astype(np.int32)
    run_start = np.repeat(np.cumsum(counts) - counts, counts)
    return (np.arange(int(counts.sum())) - run_start + np.repeat(starts, counts)).astype(np.int32)


def address_rows(descs: np.ndarray, bases: dict[int, int], devices: dict[int, int]) -> np.ndarray:
    """(N, 3) uint64 rows (address, length, device) for (region, offset, length) descriptors."""
    regions = descs[:, 0].tolist()
    rows = np.empty((len(descs), 3), dtype=np.uint64)
    rows[:, 0] = np.array([bases[r] for r in regions], dtype=np.uint64) + descs[:, 1].astype(
        np.uint64
    )
    rows[:, 1] = descs[:, 2]
    rows[:, 2] = np.array([devices[r] for r in regions], dtype=np.uint64)
    return rows


def single_mem(descs: np.ndarray, mems: dict[int, MemKind]) -> MemKind | None:
    """The memory kind shared by all regions of `descs`, or None if they mix DRAM and VRAM."""
    kinds = {mems[r] for r in np.unique(descs[:, 0]).tolist()}
    return kinds.pop() if len(kinds) == 1 else None
