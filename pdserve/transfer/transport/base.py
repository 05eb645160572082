"""The Transport contract: move bytes between registered memory regions of two instances.

A transport knows nothing about requests or KV blocks. It offers:

  register(name, memory) -> region id      once per region, before metadata is exported
  local_metadata() -> bytes                 a public card: identity, address, region table
  add_peer(metadata) -> PeerId              authenticated handshake; pays connection set-up
  write/read(peer, local, remote, notif)    post a transfer of paired descriptor lists
  state/error/wait(handle), release(handle) follow a transfer to DONE or ERROR
  send_notif(peer, bytes), get_notifs()     small messages between peers
  close()

Descriptors are (region, offset, length) triples, given as `Desc` structs or as an (N, 3)
integer array; the two lists pair up element by element and each pair has the same length.
Adjacent pairs are coalesced before posting. Local descriptors are checked against the local
region table and remote ones against the peer's table (from its metadata) before anything is
posted; a bad list raises `DescriptorError` and nothing moves. The target checks again what
arrives (tcp) or its registration does (nixl: the NIXL metadata only covers registered
memory), so a peer that skips the first check still cannot write outside registered memory.

Ownership of memory: the caller owns every registered region and must keep it alive and
unmoved until `close()` (the transport keeps a reference to the object it was given). The
bytes named by a transfer's local descriptors belong to the transport from `write`/`read`
until `state()` is DONE or ERROR: do not free or reuse those blocks before. On the target,
the bytes named by remote descriptors may change from the moment the transfer is posted;
they are complete only when the transfer's notification arrives (WRITE) or when the
initiator's handle is DONE (READ).

Identity: a peer is (engine id, incarnation). The incarnation is new at every start, so a
restarted peer is a new peer: adding it replaces the old incarnation, whose pending
transfers end in ERROR, and metadata of an older incarnation is refused (`StalePeerError`).
When A adds B, the handshake also makes A known to B (B can write and notify A at once).

Authentication: with a cluster token, both ends of every handshake prove knowledge of the
token by HMAC over fresh nonces; the token itself never travels. See `auth`.

Failure: a transfer never stays PENDING forever. A dropped connection or dead peer ends all
its pending transfers in ERROR as soon as it is noticed; a peer that stops responding does
so after `timeout_s` (tcp: no byte moved for `timeout_s` while work is pending; nixl: a
transfer pending longer than `timeout_s`). Other peers are not affected.

Threads: every method may be called from any thread. Typical use is a writer thread posting
and polling transfers while another thread waits for notifications; both are safe. Backend
threads (listener, per-connection I/O) never call back into user code.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any, Literal, Protocol, runtime_checkable

import msgspec
import numpy as np

PROTOCOL_VERSION = 1
MAX_NOTIF_BYTES = 64 * 1024  # notifications are control messages, not a data path

MemKind = Literal["DRAM", "VRAM"]
BackendKind = Literal["tcp", "nixl"]


class TransferState(enum.Enum):
    """Where a posted transfer stands. DONE and ERROR are final."""

    PENDING = "pending"
    DONE = "done"
    ERROR = "error"


class Op(enum.Enum):
    """WRITE: local bytes -> peer's memory. READ: peer's bytes -> local memory."""

    WRITE = "write"
    READ = "read"


class Desc(msgspec.Struct, frozen=True, array_like=True):
    """`length` bytes at `offset` inside region `region` (of the side the list refers to)."""

    region: int
    offset: int
    length: int


class PeerId(msgspec.Struct, frozen=True, array_like=True):
    """A peer as one incarnation of an engine; hashable, usable as a dict key."""

    engine_id: str
    incarnation: str

    def __str__(self) -> str:
        return f"{self.engine_id}@{self.incarnation[:8]}"


class RegionInfo(msgspec.Struct, frozen=True, array_like=True):
    """One registered region as peers see it. `granule`: block size for prepared lists."""

    id: int
    size: int
    mem: MemKind = "DRAM"
    device: int = 0
    granule: int | None = None


class PeerCard(msgspec.Struct, frozen=True, kw_only=True):
    """Public metadata of a transport instance (what `local_metadata()` encodes).

    Nothing in it is secret: it says who the peer is, where its handshake listener is and
    what it registered. Backend secrets (NIXL agent metadata) only travel in the
    authenticated handshake.
    """

    kind: BackendKind
    engine_id: str
    incarnation: str
    started_ns: int  # orders incarnations of one engine id: a newer start wins
    host: str
    port: int
    regions: tuple[RegionInfo, ...] = ()
    host_id: str | None = None  # equal for processes that can reach each other's Unix socket
    unix_path: str | None = None  # same-host fast path of the tcp backend
    protocol: int = PROTOCOL_VERSION

    @property
    def peer_id(self) -> PeerId:
        return PeerId(self.engine_id, self.incarnation)


class Notification(msgspec.Struct, frozen=True):
    """A small message from `peer`; a WRITE's notification arrives only after its data."""

    peer: PeerId
    payload: bytes


class TransferHandle(msgspec.Struct, frozen=True):
    """Names one posted transfer until `release`."""

    id: int
    peer: PeerId
    op: Op
    nbytes: int
    ndesc: int  # descriptors after coalescing


class TransportError(Exception):
    """Base of every error a transport raises."""


class DescriptorError(TransportError):
    """A descriptor list is invalid (out of bounds, unknown region, mismatched lengths)."""


class AuthError(TransportError):
    """A peer could not prove it knows the cluster token, or would not accept ours."""


class PeerError(TransportError):
    """Unknown, replaced, stale or unreachable peer."""


class StalePeerError(PeerError):
    """Metadata of an older incarnation than the one known (or found at its address)."""


class BackendUnavailableError(TransportError):
    """The requested backend cannot run here (package missing, plugin absent)."""


Descs = Sequence[Desc] | Sequence[tuple[int, int, int]] | np.ndarray


def as_desc_array(descs: Descs) -> np.ndarray:
    """Descriptors as a C-contiguous (N, 3) int64 array [region, offset, length]."""
    if isinstance(descs, np.ndarray):
        arr = np.ascontiguousarray(descs, dtype=np.int64)
    elif len(descs) and isinstance(descs[0], Desc):
        arr = np.array([(d.region, d.offset, d.length) for d in descs], dtype=np.int64)
    else:
        arr = np.array(descs, dtype=np.int64)
    if arr.size == 0:
        raise DescriptorError("empty descriptor list")
    if arr.ndim != 2 or arr.shape[1] != 3:
        raise DescriptorError(f"descriptors must be (region, offset, length); got {arr.shape}")
    return arr


def decode_card(metadata: bytes, kind: str) -> PeerCard:
    """Decode a peer's public metadata; PeerError if it is garbage or for another backend."""
    try:
        card = msgspec.msgpack.decode(metadata, type=PeerCard)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise PeerError(f"invalid transport metadata: {exc}") from None
    if card.kind != kind:
        raise PeerError(f"peer {card.engine_id} uses the {card.kind} transport, we use {kind}")
    return card


@runtime_checkable
class Transport(Protocol):
    """What every backend implements; see the module docstring for the semantics."""

    @property
    def peer_id(self) -> PeerId:
        """This instance's own identity (engine id + incarnation)."""
        ...

    def register(self, name: str, memory: Any, *, granule: int | None = None) -> int:
        """Register a contiguous tensor / array / writable buffer / (ptr, nbytes) tuple.

        `granule` (bytes, e.g. one KV block) lets a backend prepare descriptor lists once:
        transfers whose descriptors are granule-aligned reuse them. Returns the region id.
        """
        ...

    def local_metadata(self) -> bytes:
        """This instance's public card (msgspec-encoded `PeerCard`)."""
        ...

    def add_peer(self, metadata: bytes) -> PeerId:
        """Authenticate and connect to the peer described by `metadata`; idempotent."""
        ...

    def remove_peer(self, peer: PeerId) -> None:
        """Forget a peer: its pending transfers end in ERROR, its connection closes."""
        ...

    def peers(self) -> list[PeerId]:
        """Peers currently known (added by us or by them)."""
        ...

    def write(
        self, peer: PeerId, local: Descs, remote: Descs, notif: bytes | None = None
    ) -> TransferHandle:
        """Post a WRITE of local bytes into the peer's regions; `notif` arrives after them."""
        ...

    def read(
        self, peer: PeerId, local: Descs, remote: Descs, notif: bytes | None = None
    ) -> TransferHandle:
        """Post a READ of the peer's bytes; `notif` reaches the peer after the data moved."""
        ...

    def state(self, handle: TransferHandle) -> TransferState:
        """Current state; also drives progress for backends that need polling."""
        ...

    def error(self, handle: TransferHandle) -> str | None:
        """Why the transfer failed (None unless its state is ERROR)."""
        ...

    def wait(self, handle: TransferHandle, timeout_s: float | None = None) -> TransferState:
        """Block until DONE or ERROR, or until `timeout_s` passes (then PENDING)."""
        ...

    def release(self, handle: TransferHandle) -> None:
        """Forget a finished transfer. Raises TransportError if it is still PENDING."""
        ...

    def send_notif(self, peer: PeerId, payload: bytes) -> None:
        """Send a small message (at most MAX_NOTIF_BYTES), ordered after earlier posts."""
        ...

    def get_notifs(self) -> list[Notification]:
        """Notifications received since the last call, oldest first."""
        ...

    def wait_notifs(self, timeout_s: float) -> list[Notification]:
        """Like get_notifs, but waits up to `timeout_s` for at least one."""
        ...

    def stopped(self) -> list[str]:
        """The parts that must run and no longer do (a listener that died), by name; empty
        while the transport is whole. An instance with a stopped part reports 503."""
        ...

    def close(self) -> None:
        """Stop threads, fail pending transfers, close connections. Idempotent."""
        ...
