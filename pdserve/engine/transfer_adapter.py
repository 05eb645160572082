"""pdserve's engine side of the transfer contract (pdserve.transfer.adapter).

The transfer core sees pdserve's requests only as `RemoteRequest` snapshots made here,
and moves blocks only through `EngineBlocks`, which records each move in the block pool
under the core's typed owners (`Hold`, `Quarantine`) and takes the blocks off the
request, so `Scheduler.finish` never frees them. Engine thread only, like the pool.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pdserve.engine.request import Request
from pdserve.kv.block_pool import BlockPool
from pdserve.transfer.adapter import ConnectorOwner, RemoteRequest


class EngineBlocks:
    """`EngineSide` over the engine's block pool and its live requests."""

    def __init__(self, pool: BlockPool, requests: Mapping[str, Request]) -> None:
        self._pool = pool
        self._requests = requests

    def take_blocks(self, request_id: str, owner: ConnectorOwner) -> list[int]:
        req = self._requests.get(request_id)
        if req is None or not req.block_ids:
            return []
        blocks = req.block_ids
        self._pool.transfer(blocks, request_id, owner)
        req.block_ids = []
        return blocks

    def free_blocks(self, blocks: Sequence[int], owner: ConnectorOwner) -> None:
        self._pool.free(blocks, owner)


def remote_view(req: Request, num_tokens: int | None = None) -> RemoteRequest:
    """The core's view of a P/D request now. `num_tokens`: a decode leg's prompt (its
    blocks are to be filled), a prefill leg's computed tokens (its blocks are full), or
    the given count (the prompt, for `layer_hook` before the step that completes it)."""
    assert req.kv_transfer is not None
    if num_tokens is None:
        num_tokens = req.num_prompt_tokens if req.needs_remote_kv else req.num_computed_tokens
    return RemoteRequest(
        request_id=req.request_id,
        params=req.kv_transfer,
        prompt_token_ids=req.prompt_token_ids,
        block_ids=tuple(req.block_ids),
        num_tokens=num_tokens,
        num_cached_blocks=req.num_cached_blocks,
        last_logprob=req.last_logprob,
    )
