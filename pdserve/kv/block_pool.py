"""The block pool: which KV blocks are free and who owns the others.

Plain Python ints, a FIFO free queue and one owner tag per used block. At every
instant each block is either free or owned by exactly one tag:

- a running (or prefilling) request: tag = its request id;
- an outgoing transfer held for a peer (P side, under a lease): tag = "hold:<id>";
- an incoming transfer reserved for a peer's write (D side, under a deadline):
  tag = "recv:<id>";
- quarantine (D side): blocks of a timed-out incoming transfer that a late write might
  still hit; they return to the free queue only once the writer is known to be done.

The engine thread is the only caller (not thread-safe by design: no locks on the hot
path). `check_integrity()` proves free + used == total and that no block is in two places.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable


class NoFreeBlocksError(RuntimeError):
    """Raised by `allocate` when the pool cannot satisfy a request; nothing is taken."""


class BlockIntegrityError(AssertionError):
    """The pool's bookkeeping is inconsistent (a bug, never a user error)."""


class BlockPool:
    """Allocates block ids 0..num_blocks-1 to owner tags."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._owner: dict[int, str] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._owner)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int, owner: str) -> list[int]:
        """Take `n` free blocks for `owner`; all or nothing."""
        if n > len(self._free):
            raise NoFreeBlocksError(f"need {n} KV blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self._owner[b] = owner
        return blocks

    def free(self, blocks: Iterable[int], owner: str) -> None:
        """Return `owner`'s blocks to the free queue. Freeing a block one does not own is a bug."""
        blocks = list(blocks)
        for b in blocks:
            if self._owner.get(b) != owner:
                raise BlockIntegrityError(
                    f"block {b} is owned by {self._owner.get(b)!r}, not {owner!r}"
                )
        for b in blocks:
            del self._owner[b]
            self._free.append(b)

    def transfer(self, blocks: Iterable[int], old: str, new: str) -> None:
        """Hand blocks from one owner to another without freeing them (e.g. request -> lease)."""
        blocks = list(blocks)
        for b in blocks:
            if self._owner.get(b) != old:
                raise BlockIntegrityError(
                    f"block {b} is owned by {self._owner.get(b)!r}, not {old!r}"
                )
        for b in blocks:
            self._owner[b] = new

    def owner_of(self, block: int) -> str | None:
        return self._owner.get(block)

    def owners(self) -> Counter[str]:
        """Blocks per owner tag (for leak reports and metrics)."""
        return Counter(self._owner.values())

    def check_integrity(self) -> None:
        """Raise BlockIntegrityError unless every block is in exactly one place."""
        free = list(self._free)
        if len(set(free)) != len(free):
            raise BlockIntegrityError("a block is in the free queue twice")
        both = set(free) & self._owner.keys()
        if both:
            raise BlockIntegrityError(f"blocks both free and owned: {sorted(both)[:8]}")
        if len(free) + len(self._owner) != self.num_blocks:
            raise BlockIntegrityError(
                f"free {len(free)} + used {len(self._owner)} != total {self.num_blocks}"
            )
        bad = [b for b in (*free, *self._owner) if not 0 <= b < self.num_blocks]
        if bad:
            raise BlockIntegrityError(f"block ids out of range: {bad[:8]}")
