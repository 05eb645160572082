"""Block pool: exact ids, ownership checks, and integrity under random operations."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.kv.block_pool import BlockIntegrityError, BlockPool, NoFreeBlocksError


def test_allocate_is_fifo_and_all_or_nothing() -> None:
    pool = BlockPool(4)
    assert pool.allocate(3, "a") == [0, 1, 2]
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(2, "b")
    assert pool.num_free == 1  # the failed call took nothing
    pool.free([1], "a")
    assert pool.allocate(2, "b") == [3, 1]
    pool.check_integrity()


def test_free_by_wrong_owner_is_refused() -> None:
    pool = BlockPool(2)
    blocks = pool.allocate(2, "a")
    with pytest.raises(BlockIntegrityError):
        pool.free(blocks, "b")
    assert pool.num_used == 2


def test_transfer_changes_owner_without_freeing() -> None:
    pool = BlockPool(3)
    blocks = pool.allocate(2, "req")
    pool.transfer(blocks, "req", "hold:req")
    assert pool.owners() == {"hold:req": 2}
    with pytest.raises(BlockIntegrityError):
        pool.free(blocks, "req")
    pool.free(blocks, "hold:req")
    assert pool.num_free == 3


ops = st.lists(
    st.tuples(st.sampled_from(["alloc", "free", "move"]), st.integers(0, 5), st.integers(0, 9)),
    max_size=80,
)


@settings(max_examples=200, deadline=None)
@given(num_blocks=st.integers(1, 32), operations=ops)
def test_random_sequences_keep_integrity(num_blocks: int, operations: list) -> None:
    pool = BlockPool(num_blocks)
    owned: dict[str, list[int]] = {}
    for op, owner_i, n in operations:
        owner = f"o{owner_i}"
        if op == "alloc":
            if pool.can_allocate(n):
                owned.setdefault(owner, []).extend(pool.allocate(n, owner))
            else:
                with pytest.raises(NoFreeBlocksError):
                    pool.allocate(n, owner)
        elif op == "free" and owned.get(owner):
            k = n % len(owned[owner]) + 1
            pool.free(owned[owner][:k], owner)
            owned[owner] = owned[owner][k:]
        elif op == "move" and owned.get(owner):
            new = f"hold:{owner}"
            pool.transfer(owned[owner], owner, new)
            owned.setdefault(new, []).extend(owned.pop(owner))
        pool.check_integrity()
        assert pool.num_used == sum(len(b) for b in owned.values())
    for owner, blocks in owned.items():
        pool.free(blocks, owner)
    assert pool.num_free == num_blocks
    pool.check_integrity()
