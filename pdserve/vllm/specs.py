"""What the scheduler side tells the worker side each step (inside the connector metadata).

Plain msgspec structs, no vLLM types: vLLM pickles the metadata to its workers.
"""

from __future__ import annotations

import msgspec

from pdserve.vllm.params import Mode


class RecvSpec(msgspec.Struct, frozen=True, kw_only=True):
    """D: request `request_id` holds `block_ids` (reserved by vLLM until we report it in
    finished_recving); fill them with P's blocks `remote_block_ids`, pairwise."""

    request_id: str
    mode: Mode
    remote_engine_id: str
    remote_incarnation: str  # "": not known yet (push, legs at once): the handshake's
    remote_request_id: str  # the transfer's key on P
    remote_address: tuple[str, int]
    block_ids: list[int]
    remote_block_ids: list[int]
    first_block: int  # index of block_ids[0] in P's list (D's prefix cache held the rest)
    num_tokens: int


class ReleaseSpec(msgspec.Struct, frozen=True, kw_only=True):
    """D: vLLM will not load this request's KV after all (e.g. a one-token prompt, which it
    recomputes anyway): tell P to free the blocks it holds for us now, not at lease end."""

    remote_request_id: str
    remote_address: tuple[str, int]


class SendSpec(msgspec.Struct, frozen=True, kw_only=True):
    """P: request `request_id` finished its prefill; vLLM keeps `block_ids` for us until we
    report it in finished_sending (after the write, D's PullDone, an abort or the lease)."""

    request_id: str
    block_ids: list[int]
    num_tokens: int
    transfer_id: str = ""  # the router's id, which D's registration names; "": request_id

    @property
    def key(self) -> str:
        """The id D's messages name this transfer by."""
        return self.transfer_id or self.request_id


class WorkerCard(msgspec.Struct, frozen=True, kw_only=True):
    """Worker -> scheduler at start (vLLM's handshake metadata): this worker's identity."""

    engine_id: str
    incarnation: str
