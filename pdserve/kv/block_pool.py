"""The block pool: which KV blocks are free, who holds the others, and which are cached.

Plain Python ints, an LRU free queue and owner tags per used block. At every instant each
block is either free (in the queue) or held by one or more distinct tags:

- a running (or prefilling) request: tag = its request id;
- an outgoing transfer held for a peer (P side, under a lease): tag = "hold:<id>";
- an incoming transfer reserved for a peer's write (D side, under a deadline):
  tag = "recv:<id>";
- quarantine (D side): blocks of a timed-out incoming transfer that a late write might
  still hit; they return to the free queue only once the writer is known to be done.

Prefix caching: a full block whose contents are final may be registered under the hash of
the token prefix it ends (`cache`, pdserve.kv.prefix_hash). A cached block can then be held
by several tags at once (`share`: requests with the same prefix, a P hold); only cached
blocks are ever shared, and a cached block's contents never change (its writer has
finished it, and nobody is given it to write). When its last holder lets go it goes to
the tail of the free queue with its hash still registered, so a later request can take it
back; `allocate` takes from the head, and a cached block taken there loses its hash
(eviction: least recently freed first). A held block is never in the free queue, so it is
never evicted.

The engine thread is the only caller (not thread-safe by design: no locks on the hot
path). `check_integrity()` proves free + used == total, that no block is in two places,
that only cached blocks are shared and that the hash index is one-to-one.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable


class NoFreeBlocksError(RuntimeError):
    """Raised by `allocate` when the pool cannot satisfy a request; nothing is taken."""


class BlockIntegrityError(AssertionError):
    """The pool's bookkeeping is inconsistent (a bug, never a user error)."""


class BlockPool:
    """Allocates block ids 0..num_blocks-1 to owner tags; indexes cached blocks by hash."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        # Insertion order is the eviction order: the head is the least recently freed.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._owners: dict[int, list[str]] = {}
        self._hash_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self.num_evicted = 0  # cached blocks whose hash was dropped to reuse them

    @property
    def num_free(self) -> int:
        """Blocks nobody holds (cached or not): what `allocate` can take."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Blocks held by at least one tag."""
        return len(self._owners)

    @property
    def num_refs(self) -> int:
        """Holdings in all: a block shared by two requests counts twice."""
        return sum(len(o) for o in self._owners.values())

    @property
    def num_cached(self) -> int:
        """Blocks registered under a prefix hash (held or free)."""
        return len(self._hash_of)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int, owner: str) -> list[int]:
        """Take `n` free blocks for `owner` (theirs alone to write); all or nothing."""
        if n > len(self._free):
            raise NoFreeBlocksError(f"need {n} KV blocks, {len(self._free)} free")
        blocks = [self._free.popitem(last=False)[0] for _ in range(n)]
        for b in blocks:
            self._evict(b)
            self._owners[b] = [owner]
        return blocks

    def _evict(self, block: int) -> None:
        h = self._hash_of.pop(block, None)
        if h is not None:
            del self._block_of[h]
            self.num_evicted += 1

    def free(self, blocks: Iterable[int], owner: str) -> None:
        """Drop `owner`'s hold on `blocks`; a block nobody else holds goes to the free queue's
        tail (still cached if it was). Freeing a block one does not hold is a bug."""
        blocks = self._check_owner(blocks, owner)
        for b in blocks:
            owners = self._owners[b]
            owners.remove(owner)
            if not owners:
                del self._owners[b]
                self._free[b] = None

    def transfer(self, blocks: Iterable[int], old: str, new: str) -> None:
        """Hand `old`'s hold on blocks to `new` without freeing them (e.g. request -> lease)."""
        blocks = self._check_owner(blocks, old)
        for b in blocks:
            owners = self._owners[b]
            if new in owners:
                raise BlockIntegrityError(f"block {b} is already held by {new!r}")
            owners[owners.index(old)] = new

    def _check_owner(self, blocks: Iterable[int], owner: str) -> list[int]:
        blocks = list(blocks)
        if len(set(blocks)) != len(blocks):
            raise BlockIntegrityError(f"a block is named twice in {blocks[:8]}")
        for b in blocks:
            if owner not in self._owners.get(b, ()):
                found = self._owners.get(b)
                raise BlockIntegrityError(f"block {b} is held by {found!r}, not {owner!r}")
        return blocks

    # -- prefix caching ------------------------------------------------------------------
    def lookup(self, block_hash: bytes) -> int | None:
        """The cached block registered under `block_hash` (held or free), or None."""
        return self._block_of.get(block_hash)

    def is_free(self, block: int) -> bool:
        return block in self._free

    def share(self, blocks: Iterable[int], owner: str) -> None:
        """Give `owner` a hold on cached blocks (read-only: their contents are final). Free
        ones leave the free queue, so they cannot be evicted while anyone holds them."""
        blocks = list(blocks)
        for b in blocks:
            if b not in self._hash_of:
                raise BlockIntegrityError(f"block {b} is not cached; only cached blocks are shared")
            if owner in self._owners.get(b, ()):
                raise BlockIntegrityError(f"block {b} is already held by {owner!r}")
        for b in blocks:
            if b in self._free:
                del self._free[b]
                self._owners[b] = [owner]
            else:
                self._owners[b].append(owner)

    def cache(self, block: int, block_hash: bytes, owner: str) -> bool:
        """Register `owner`'s block, now full and final, under `block_hash`.

        False (nothing changes) when another block already has this hash: the two hold the
        same KV, the first stays the one found, and this one stays private to `owner`.
        """
        if block in self._hash_of:
            if self._hash_of[block] != block_hash or owner not in self._owners.get(block, ()):
                raise BlockIntegrityError(f"block {block} is cached under another hash or holder")
            return True
        if self._owners.get(block) != [owner]:
            raise BlockIntegrityError(
                f"block {block} is held by {self._owners.get(block)!r}, not {owner!r} alone"
            )
        if block_hash in self._block_of:
            return False
        self._hash_of[block] = block_hash
        self._block_of[block_hash] = block
        return True

    def is_cached(self, block: int) -> bool:
        return block in self._hash_of

    def writable_by(self, block: int, owner: str) -> bool:
        """Whether `owner` may write `block`: it holds it alone and it is not cached."""
        return self._owners.get(block) == [owner] and block not in self._hash_of

    # -- introspection -------------------------------------------------------------------
    def owner_of(self, block: int) -> str | None:
        """The block's first holder (its only one unless it is a shared cached block)."""
        owners = self._owners.get(block)
        return owners[0] if owners else None

    def owners_of(self, block: int) -> tuple[str, ...]:
        return tuple(self._owners.get(block, ()))

    def owners(self) -> Counter[str]:
        """Blocks per owner tag (for leak reports and metrics)."""
        return Counter(o for owners in self._owners.values() for o in owners)

    def check_integrity(self) -> None:
        """Raise BlockIntegrityError unless every block is in exactly one place, only cached
        blocks are shared and the hash index is one-to-one."""
        free = list(self._free)
        both = set(free) & self._owners.keys()
        if both:
            raise BlockIntegrityError(f"blocks both free and owned: {sorted(both)[:8]}")
        if len(free) + len(self._owners) != self.num_blocks:
            raise BlockIntegrityError(
                f"free {len(free)} + used {len(self._owners)} != total {self.num_blocks}"
            )
        bad = [b for b in (*free, *self._owners) if not 0 <= b < self.num_blocks]
        if bad:
            raise BlockIntegrityError(f"block ids out of range: {bad[:8]}")
        for b, owners in self._owners.items():
            if not owners or len(set(owners)) != len(owners):
                raise BlockIntegrityError(f"block {b} has holders {owners!r}")
            if len(owners) > 1 and b not in self._hash_of:
                raise BlockIntegrityError(f"block {b} is shared by {owners!r} but not cached")
        if len(self._block_of) != len(self._hash_of) or any(
            self._block_of.get(h) != b for b, h in self._hash_of.items()
        ):
            raise BlockIntegrityError("the prefix-cache index is not one-to-one")
