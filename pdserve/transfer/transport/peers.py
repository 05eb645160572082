"""The peers of one transport, keyed by engine id, aware of incarnations.

At most one incarnation per engine id is known. A newer incarnation (later `started_ns`)
replaces the older one: the caller tears the old links down, which fails their pending
transfers. An older incarnation is refused with StalePeerError. Lookups by a PeerId of a
replaced incarnation fail, so stale handles can never reach the new process.

A peer can have several links (both sides dialled each other at the same moment); the
first live one is used for sending, all of them receive until they close.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from pdserve.transfer.transport.base import PeerCard, PeerError, PeerId, StalePeerError

L = TypeVar("L")


@dataclass
class PeerSlot(Generic[L]):
    card: PeerCard
    links: list[L] = field(default_factory=list)


def _newer(a: PeerCard, b: PeerCard) -> bool:
    """Whether incarnation `a` started after `b` (ties broken by incarnation id)."""
    return (a.started_ns, a.incarnation) > (b.started_ns, b.incarnation)


class PeerTable(Generic[L]):
    """Thread-safe map engine id -> (card, links)."""

    def __init__(self, me: PeerId) -> None:
        self._me = me
        self._lock = threading.Lock()
        self._slots: dict[str, PeerSlot[L]] = {}

    def check(self, card: PeerCard) -> PeerSlot[L] | None:
        """Whether `card` may be admitted; returns the slot of the same incarnation if any."""
        if card.engine_id == self._me.engine_id:
            raise PeerError(f"peer has our own engine id {card.engine_id!r}")
        with self._lock:
            slot = self._slots.get(card.engine_id)
        if slot is None or slot.card.incarnation != card.incarnation:
            if slot is not None and _newer(slot.card, card):
                raise StalePeerError(
                    f"metadata of {card.peer_id} is older than the known {slot.card.peer_id}"
                )
            return None
        return slot

    def admit(self, card: PeerCard, link: L, alive: Callable[[L], bool] | None = None) -> list[L]:
        """Add `link` for `card`; returns the links of a replaced older incarnation.

        A new link to a known incarnation joins its live links (`alive` prunes dead ones).
        """
        self.check(card)
        with self._lock:
            slot = self._slots.get(card.engine_id)
            if slot is not None and slot.card.incarnation == card.incarnation:
                slot.links = [x for x in slot.links if alive is None or alive(x)] + [link]
                return []
            self._slots[card.engine_id] = PeerSlot(card, [link])
            return slot.links if slot else []

    def lookup(self, peer: PeerId) -> PeerSlot[L]:
        with self._lock:
            slot = self._slots.get(peer.engine_id)
        if slot is None:
            raise PeerError(f"unknown peer {peer}")
        if slot.card.incarnation != peer.incarnation:
            raise PeerError(f"peer {peer} was replaced by its new incarnation {slot.card.peer_id}")
        return slot

    def primary(self, peer: PeerId, alive: Callable[[L], bool]) -> L:
        """The link to send on: the first live one, else the first (dead) one."""
        links = self.lookup(peer).links
        return next((x for x in links if alive(x)), links[0])

    def remove(self, peer: PeerId) -> list[L]:
        with self._lock:
            slot = self._slots.get(peer.engine_id)
            if slot is None or slot.card.incarnation != peer.incarnation:
                return []
            del self._slots[peer.engine_id]
        return slot.links

    def ids(self) -> list[PeerId]:
        with self._lock:
            return [s.card.peer_id for s in self._slots.values()]

    def all_links(self) -> list[L]:
        with self._lock:
            return [x for s in self._slots.values() for x in s.links]

    def clear(self) -> list[L]:
        with self._lock:
            links = [x for s in self._slots.values() for x in s.links]
            self._slots.clear()
        return links
