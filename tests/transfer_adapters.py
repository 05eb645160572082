"""The engine adapters the transfer core's scenarios run against, one fixture each.

The core's scenario tests (tests/test_transfer_core.py) are written once and run once per
engine adapter here: each `EngineDouble` is one engine's real `EngineSide` over that
engine's own block bookkeeping, with just enough of a request around it (blocks allocated
at admission, freed at finish) for the core to take and free blocks as it would in a
server. "pdserve" is pdserve's engine (`EngineBlocks` over its BlockPool); "vllm" is the
vLLM connector's `VllmBlocks` (pdserve.vllm.engine_side, which imports no vLLM, so it
needs no vLLM installed) over a model of vLLM's scheduler: blocks lent to the connector
are freed only when the request id comes back in finished_sending / finished_recving, a
request failed by failed_recving is ended (and freed) at once, and no id may come back
twice.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from pdserve.engine.request import Request
from pdserve.engine.transfer_adapter import EngineBlocks
from pdserve.engine.types import EngineRequest, SamplingParams
from pdserve.kv.block_pool import BlockPool
from pdserve.transfer.adapter import ConnectorOwner, EngineSide, Event
from pdserve.vllm.engine_side import VllmBlocks


class EngineDouble(Protocol):
    """One engine's side of the contract, as the core's scenarios drive it."""

    side: EngineSide
    first_token: int | None  # what this engine's P passes to `prefill_done`

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

    def on_events(self, events: list[Event]) -> None:
        """The engine's reaction to what `poll` returned (the scenario is its thread)."""
        ...

    def check_integrity(self, held_by_core: int) -> None:
        """Raise unless the engine's bookkeeping is consistent and every used block belongs
        to a live request or to the core (`held_by_core` blocks)."""
        ...


class PdserveDouble:
    """pdserve's engine: `EngineBlocks` over its BlockPool and live `Request`s."""

    first_token = 7

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

    def on_events(self, events: list[Event]) -> None:
        """pdserve's engine emits or fails the request; its blocks stay the request's."""

    def check_integrity(self, held_by_core: int) -> None:
        self.pool.check_integrity()
        owned = sum(len(r.block_ids) for r in self.requests.values())
        if owned + held_by_core != self.pool.num_refs:
            raise AssertionError(
                f"{self.pool.num_refs} block holds; requests own {owned}, the core {held_by_core}"
            )


class VllmDouble:
    """vLLM's engine: the connector's `VllmBlocks` over a model of vLLM's scheduler.

    `admit` allocates a P/D leg's blocks and lends them to the connector, as the worker's
    glue does with a SendSpec (P, after vLLM delayed freeing them) or a RecvSpec (D,
    WAITING_FOR_REMOTE_KVS). vLLM frees a finished request's blocks at once unless the
    connector still has them (lent or taken); then only when the request id comes back.
    vLLM's D computes the prompt's last token again: its P passes no first token.
    """

    first_token = None

    def __init__(self, num_blocks: int) -> None:
        self.side = VllmBlocks()
        self._free = list(range(num_blocks))
        self._num_blocks = num_blocks
        self._blocks: dict[str, list[int]] = {}  # request (live or delayed) -> its blocks
        self._live: set[str] = set()
        self._reported: set[str] = set()

    def admit(self, request_id: str, prompt: list[int], num_blocks: int) -> list[int]:
        blocks, self._free = self._free[:num_blocks], self._free[num_blocks:]
        assert len(blocks) == num_blocks, "out of blocks"
        self._blocks[request_id] = blocks
        self._live.add(request_id)
        self.side.lend(request_id, blocks)
        return list(blocks)

    def finish(self, request_id: str) -> None:
        self._apply()
        if request_id not in self._live:
            return  # vLLM already ended it (failed_recving)
        self._live.discard(request_id)
        # The worker's glue: a D request vLLM finished that the core did not fence.
        self.side.ended(request_id)
        self._apply()
        if request_id in self._blocks and not self._with_connector(request_id):
            self._release(request_id)

    def _with_connector(self, request_id: str) -> bool:
        blocks = self._blocks[request_id]
        return self.side.is_lent(request_id) or any(
            isinstance(self.side.owner_of(b), ConnectorOwner) for b in blocks
        )

    def _apply(self) -> None:
        """vLLM's scheduler applying the worker's results (each id at most once)."""
        r = self.side.take_results()
        for rid in r.finished_sending | r.finished_recving:
            assert rid not in self._reported, f"{rid} came back twice"
            assert rid in self._blocks, f"{rid} came back but vLLM has no such request"
            self._reported.add(rid)
            if rid not in self._live or rid in r.failed_recving:
                self._live.discard(rid)  # failed_recving: vLLM fails the request
                self._release(rid)

    def _release(self, request_id: str) -> None:
        self._free += self._blocks.pop(request_id)

    def owner_of(self, block: int) -> object | None:
        self._apply()
        owner = self.side.owner_of(block)
        if isinstance(owner, ConnectorOwner):
            return owner
        return next((rid for rid, b in self._blocks.items() if block in b), None)

    def num_used(self) -> int:
        self._apply()
        return self._num_blocks - len(self._free)

    def on_events(self, events: list[Event]) -> None:
        self.side.on_events(events)
        self._apply()

    def check_integrity(self, held_by_core: int) -> None:
        self._apply()
        used = [b for blocks in self._blocks.values() for b in blocks]
        if len(set(used) | set(self._free)) != self._num_blocks or len(used) != len(set(used)):
            raise AssertionError(f"blocks lost or doubled: used {used}, free {self._free}")
        taken = sum(1 for b in used if isinstance(self.side.owner_of(b), ConnectorOwner))
        if taken != held_by_core:
            raise AssertionError(
                f"the connector took {taken} blocks, the core holds {held_by_core}"
            )


ADAPTERS: dict[str, Callable[[int], EngineDouble]] = {
    "pdserve": PdserveDouble,
    "vllm": VllmDouble,
}
