"""The engine adapters the transfer core's scenarios run against, one fixture each.

The core's scenario tests (tests/test_transfer_core.py) are written once and run once per
engine adapter here: each `EngineDouble` is one engine's real `EngineSide` over that
engine's own block bookkeeping, with just enough of a request around it (blocks allocated
at admission, freed at finish) for the core to take and free blocks as it would in a
server. A second engine (vLLM) adds its double to `ADAPTERS`; a double whose engine is
not installed is skipped by the fixture, not by the scenarios.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from pdserve.engine.request import Request
from pdserve.engine.transfer_adapter import EngineBlocks
from pdserve.engine.types import EngineRequest, SamplingParams
from pdserve.kv.block_pool import BlockPool
from pdserve.transfer.adapter import EngineSide


class EngineDouble(Protocol):
    """One engine's side of the contract, as the core's scenarios drive it."""

    side: EngineSide

    def admit(self, request_id: str, prompt: list[int], num_blocks: int) -> list[int]:
        """A live request owning `num_blocks` fresh blocks; returns them."""
        ...

    def finish(self, request_id: str) -> None:
        """The request ends: the engine frees the blocks it still owns (none the core took)."""
        ...

    def owner_of(self, block: int) -> object | None:
        """Who owns `block` now: a request id, the core's `Hold`/`Quarantine`, None if free."""
        ...

    def num_used(self) -> int: ...

    def check_integrity(self, held_by_core: int) -> None:
        """Raise unless the engine's bookkeeping is consistent and every used block belongs
        to a live request or to the core (`held_by_core` blocks)."""
        ...


class PdserveDouble:
    """pdserve's engine: `EngineBlocks` over its BlockPool and live `Request`s."""

    def __init__(self, num_blocks: int) -> None:
        self.pool = BlockPool(num_blocks)
        self.requests: dict[str, Request] = {}
        self.side = EngineBlocks(self.pool, self.requests)

    def admit(self, request_id: str, prompt: list[int], num_blocks: int) -> list[int]:
        er = EngineRequest(
            request_id=request_id, prompt_token_ids=prompt, params=SamplingParams(max_tokens=1)
        )
        req = Request(er, detok=None)  # type: ignore[arg-type]  # no text in these scenarios
        req.block_ids = self.pool.allocate(num_blocks, request_id)
        self.requests[request_id] = req
        return list(req.block_ids)

    def finish(self, request_id: str) -> None:
        req = self.requests.pop(request_id)
        if req.block_ids:
            self.pool.free(req.block_ids, request_id)

    def owner_of(self, block: int) -> object | None:
        return self.pool.owner_of(block)

    def num_used(self) -> int:
        return self.pool.num_used

    def check_integrity(self, held_by_core: int) -> None:
        self.pool.check_integrity()
        owned = sum(len(r.block_ids) for r in self.requests.values())
        if owned + held_by_core != self.pool.num_refs:
            raise AssertionError(
                f"{self.pool.num_refs} block holds; requests own {owned}, the core {held_by_core}"
            )


ADAPTERS: dict[str, Callable[[int], EngineDouble]] = {"pdserve": PdserveDouble}
