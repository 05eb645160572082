"""What the scheduler side tells the worker side each step (inside the connector metadata).

Plain msgspec structs, no vLLM types: vLLM pickles the metadata to its workers. Each spec
says which of the request's blocks vLLM lends the worker's transfer core, and until when
(pdserve.vllm.engine_side has the whole ownership story).
"""

from __future__ import annotations

import msgspec

from pdserve.vllm.params import Mode


class RecvSpec(msgspec.Struct, frozen=True, kw_only=True):
    """D: request `request_id` waits for its prompt's KV (WAITING_FOR_REMOTE_KVS) in
    `block_ids` (its blocks through the prompt): vLLM lends `block_ids[first_block:]` until
    the request is in finished_recving; the first `first_block` are D's own prefix-cache
    hits (shared, read-only), which P's `remote_block_ids[first_block:]` do not fill."""

    request_id: str
    mode: Mode
    remote_engine_id: str
    remote_incarnation: str  # "": not known yet (push, legs at once): the handshake's
    remote_request_id: str  # the transfer's key on P
    remote_address: tuple[str, int]
    block_ids: list[int]
    remote_block_ids: list[int]  # empty for push (P writes into D's blocks)
    first_block: int
    num_tokens: int
    remote_num_tokens: int | None = None  # P's answer: the tokens whose KV it holds
    expires_at: float | None = None  # pull, with a cluster token: P's lease end, signed
    signature: str | None = None  # pull, with a cluster token: P's signature


class ReleaseSpec(msgspec.Struct, frozen=True, kw_only=True):
    """D: vLLM will not load this request's KV after all (a one-token prompt, which it
    recomputes anyway, or a request that ended before its blocks were allocated): tell P
    to free the blocks it holds for us now, not at lease end."""

    mode: Mode
    remote_request_id: str
    remote_address: tuple[str, int]
    remote_block_ids: list[int]  # pull: what P holds (its claim check names them)


class PrefillSpec(msgspec.Struct, frozen=True, kw_only=True):
    """P: a prompt whose KV goes to a decode instance entered vLLM (first scheduled), or
    will never be computed (aborted). vLLM lends nothing here, but for an aborted push
    prompt whose layers the worker may be writing (its completing step was named in a
    `LayerSpec`): vLLM delayed freeing its blocks and lends `block_ids` until the request
    is in finished_sending (once no layer write posted for it is pending)."""

    request_id: str
    transfer_id: str  # the id D's messages name it by: the router's, else the request id
    mode: Mode
    block_ids: list[int] = msgspec.field(default_factory=list)  # aborted: lent (above)


class SendSpec(msgspec.Struct, frozen=True, kw_only=True):
    """P: request `request_id` finished its prefill; vLLM delayed freeing its blocks, and
    lends `block_ids` (those holding the prompt's `num_tokens` tokens) until the request is
    in finished_sending (after the write, D's PullDone, an abort, a release or the lease)."""

    request_id: str
    block_ids: list[int]
    num_tokens: int
    transfer_id: str = ""  # the router's id, which D's registration names; "": request_id
    mode: Mode = "push"

    @property
    def key(self) -> str:
        """The id D's messages name this transfer by."""
        return self.transfer_id or self.request_id


class LayerSpec(msgspec.Struct, frozen=True, kw_only=True):
    """P, push: this step completes the prompt of `request_id`: its layers may be written
    to D as `save_kv_layer` saves them (the blocks stay the request's meanwhile)."""

    request_id: str
    transfer_id: str
    block_ids: list[int]  # the blocks holding the prompt's `num_tokens` tokens
    num_tokens: int


class StepSpecs(msgspec.Struct, kw_only=True):
    """One step's work for the worker."""

    recvs: list[RecvSpec] = msgspec.field(default_factory=list)
    sends: list[SendSpec] = msgspec.field(default_factory=list)
    releases: list[ReleaseSpec] = msgspec.field(default_factory=list)
    admitted: list[PrefillSpec] = msgspec.field(default_factory=list)
    aborted: list[PrefillSpec] = msgspec.field(default_factory=list)
    layerwise: list[LayerSpec] = msgspec.field(default_factory=list)

    def __bool__(self) -> bool:
        return any(getattr(self, f) for f in self.__struct_fields__)


class WorkerCard(msgspec.Struct, frozen=True, kw_only=True):
    """Worker -> scheduler at start (vLLM's handshake metadata): this worker's identity
    and the side-channel port of its transfer core for each mode (P's params name it)."""

    engine_id: str
    incarnation: str
    push_port: int = 0
    pull_port: int = 0

    def port(self, mode: Mode) -> int:
        return self.push_port if mode == "push" else self.pull_port
