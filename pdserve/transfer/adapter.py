"""The contract between the transfer core and an engine: the only way they talk.

The transfer core (pdserve.transfer: connector, pull, push, lanes, side channel,
transports) imports nothing from any engine. Each engine gives it one `EngineSide` and
one `KVRegions` and calls it through `TransferCore`; everything that crosses is typed
here. Two engines implement it: pdserve's (pdserve.engine.transfer_adapter) and vLLM's
(pdserve.vllm.engine_side and pdserve.vllm.transfers, as a vLLM KV connector).

Engine -> core (`TransferCore`, engine thread unless said otherwise):
  P  `prefill_admitted(req)`   a prompt whose KV goes to a decode instance entered the
                               engine (no blocks yet).
  P  `layer_hook(reqs, last)`  a step will complete these prompts (`num_tokens`: the whole
                               prompt): a per-layer callback (layer-wise push) or None. The
                               engine calls it with each layer's index (its `KVRegions`
                               order) once the step has written that layer. `last` (an
                               engine that passes no first token, vLLM): D may be told the
                               KV is complete once every layer is written, before
                               `prefill_done`, which then only hands the blocks back.
  P  `prefill_done(req, tok)`  the prompt is computed and P sampled `tok`: the core takes
                               the request's blocks (`EngineSide.take_blocks`, owner
                               `Hold`) and returns the params for the router. `tok` is None
                               for an engine whose D computes the prompt's last token again
                               itself (vLLM): D's `KVReady.first_token_id` is then None.
  P  `prefill_failed(req, why)` the prompt will never be computed (abort, error). If a
                               layer hook was made for it, layer writes may still read its
                               blocks: the core takes those the engine still gives
                               (`take_blocks`, owner `Hold`) and frees them once none is
                               pending (vLLM lends them only when it delayed their free).
  D  `start_receive(req)`      the request was admitted with blocks for its whole prompt,
                               still owned by the request: the core fills them (past its
                               `num_cached_blocks`).
  D  `cancel_receive(req)`     the request ends while its KV may still come (also after a
                               `KVFailed`: the watchdog's leaves the receive armed): the core
                               fences its blocks (owner `Quarantine`) if a transfer could
                               still land in them; else it does nothing.
  D  `decline_transfer(params)` a decode leg will not load its KV after all (it computes
                               the prompt itself): P is told to free its hold now.
  both `poll()`                what the engine must do now: `KVReady` (the KV is in the
                               request's blocks: emit the first token, if any, and decode)
                               or `KVFailed` (fail the request, for a typed cause).
One of `prefill_done` / `prefill_failed` is called exactly once per admitted P prompt,
and `cancel_receive` for a D request that ends before `KVReady` (after `KVFailed` too).

Core -> engine (`EngineSide`, engine thread only: inside one of the calls above):
  `take_blocks(request_id, owner)`  the live request's blocks pass to `owner`; the request
                                    keeps none, and the engine never frees them itself.
  `free_blocks(blocks, owner)`      `owner`'s blocks go back to the engine for reuse (all
                                    that `take_blocks` gave for that owner at once).
Core -> transports (`KVRegions`): the engine's KV tensors as transport regions and the
  (region, offset, length) descriptors of a block list per layer; the core never looks
  inside a block.

Who owns a block, at every moment (the engine's books record it, typed):
  P: the request (its id; prefilling) -> `Hold(tid)` (taken in `prefill_done`; freed by
     the core when the transfer ends, its lease passes or the router releases it; or taken
     in `prefill_failed` after a layer hook, freed once no layer write is pending).
  D: the request (its id; admitted, waiting for KV) -> still the request once `KVReady`
     (it decodes), or -> `Quarantine(tid)` (taken in `cancel_receive`, or when a peer is
     declared down while a pull may still be claiming) -> free (`free_blocks`, once no
     transfer can land in them). A request failed by `KVFailed` keeps the blocks the
     core did not fence; the engine frees them when it ends the request, like any other.
  The core touches (its transports read or write) only blocks under `Hold`/`Quarantine`,
  those of a D request it was told to fill (`start_receive`) and has not reported yet,
  and, P with layer-wise push, each layer of the blocks `layer_hook` named once the
  engine calls the hook for that layer (the layer is final; the request keeps the blocks).
  pdserve's engine keeps these books in its block pool; vLLM's scheduler keeps them as
  delayed frees that end when the request id comes back in finished_sending /
  finished_recving (pdserve.vllm.engine_side).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import msgspec

from pdserve.config import ConnectorConfig
from pdserve.token_logprob import TokenLogprob
from pdserve.transfer.errors import TransferCause, transfer_error
from pdserve.transfer.params import KVTransferParams
from pdserve.transfer.side_channel import Address
from pdserve.transfer.stats import ConnectorMetrics

if TYPE_CHECKING:
    import torch

    from pdserve.transfer.descriptors import Desc


class Hold(msgspec.Struct, frozen=True):
    """Block owner, P: the blocks of a finished prompt kept for transfer `transfer_id`."""

    transfer_id: str


class Quarantine(msgspec.Struct, frozen=True):
    """Block owner, D: blocks a late write or read of `transfer_id` might still hit."""

    transfer_id: str


ConnectorOwner = Hold | Quarantine


class RemoteRequest(msgspec.Struct, frozen=True):
    """What the core knows of one P/D request: a snapshot the engine makes for each call.

    `prompt_token_ids` may be the engine's own list (read only). `num_tokens`: the tokens
    whose KV is in the blocks (P: computed; D: the prompt, to be filled).
    `num_cached_blocks`: D, the first blocks the request already holds from the prefix
    cache (shared, read-only): the core neither fills nor names them to P.
    `last_logprob`: P, the logprobs of the token sampled last (at `prefill_done`: the first
    token, which travels to D with it), when the request asked for them.
    """

    request_id: str
    params: KVTransferParams
    prompt_token_ids: Sequence[int]
    block_ids: tuple[int, ...]
    num_tokens: int
    num_cached_blocks: int = 0
    last_logprob: TokenLogprob | None = None

    @property
    def transfer_id(self) -> str:
        return transfer_id_for(self.params, self.request_id)

    @property
    def remote_address(self) -> Address | None:
        return remote_address_of(self.params)


class KVReady(msgspec.Struct, frozen=True):
    """Engine event: the request's prompt KV is in its blocks; P sampled `first_token_id`
    (None when P's engine passes none to `prefill_done`: the engine computes the prompt's
    last token again itself, as vLLM does)."""

    request_id: str
    first_token_id: int | None
    prefill_done_time: float
    first_token_logprobs: TokenLogprob | None = None  # P's, when the request asked


class KVFailed(msgspec.Struct, frozen=True):
    """Engine event: the KV will never arrive; fail the request for `cause`."""

    request_id: str
    cause: TransferCause
    detail: str

    @property
    def error(self) -> str:
        """The request's error (pdserve.transfer.errors: the HTTP layer maps it to a 502,
        a 400 for `params_rejected`)."""
        return transfer_error(self.cause, self.detail)


Event = KVReady | KVFailed


@runtime_checkable
class EngineSide(Protocol):
    """What the core asks of an engine (engine thread only; see the module doc)."""

    def take_blocks(self, request_id: str, owner: ConnectorOwner) -> list[int]:
        """Pass every block of the live request to `owner` and return them (empty if it
        has none, or is gone); the request keeps none."""
        ...

    def free_blocks(self, blocks: Sequence[int], owner: ConnectorOwner) -> None:
        """Give `owner`'s blocks back to the engine."""
        ...


class KVRegions(Protocol):
    """Where the engine's KV blocks are, for the transports (pdserve.transfer.descriptors):
    the tensors to register (region i is the i-th on every instance of the same engine and
    model) and the descriptors of paired block lists, per layer. pdserve's engine gives
    `descriptors.OneRegion` ([layers, k|v, blocks, ...] in one region); vLLM's gives
    pdserve.vllm.layout.KVLayout (one region per layer)."""

    @property
    def num_blocks(self) -> int: ...

    @property
    def num_layers(self) -> int: ...

    @property
    def block_nbytes(self) -> int: ...

    def regions(self) -> Sequence[tuple[str, torch.Tensor]]: ...

    def descriptors(
        self,
        remote_num_blocks: int,
        local_blocks: Sequence[int],
        remote_blocks: Sequence[int],
        layers: Sequence[int] | None = None,
    ) -> tuple[list[Desc], list[Desc]]:
        """Paired (local, remote) descriptors moving `local_blocks` <-> `remote_blocks`
        (a peer with `remote_num_blocks` blocks) for `layers` (all by default)."""
        ...


@runtime_checkable
class TransferCore(Protocol):
    """What an engine calls on the core (engine thread unless said otherwise)."""

    cfg: ConnectorConfig
    transport_kind: str
    wake: Callable[[], None]  # set by the engine's driver: worker threads call it

    @property
    def side_address(self) -> Address: ...

    def prefill_admitted(self, req: RemoteRequest) -> None: ...

    def layer_hook(
        self, reqs: list[RemoteRequest], done_after_last_layer: bool = False
    ) -> Callable[[int], None] | None: ...

    def prefill_done(self, req: RemoteRequest, first_token: int | None) -> KVTransferParams: ...

    def prefill_failed(self, req: RemoteRequest, reason: str) -> None: ...

    def start_receive(self, req: RemoteRequest) -> None: ...

    def cancel_receive(self, req: RemoteRequest) -> None: ...

    def release_transfer(self, tid: str) -> None: ...

    def decline_transfer(self, params: KVTransferParams) -> None: ...

    def decode_waiting(self, tid: str) -> bool:
        """Any thread."""
        ...

    def has_events(self) -> bool:
        """Any thread; cheap."""
        ...

    def poll(self) -> list[Event]: ...

    def check_params(self, params: KVTransferParams) -> None:
        """Any thread; raises InvalidKVTransferParams."""
        ...

    def transfer_in_use(self, tid: str) -> bool:
        """Any thread."""
        ...

    def transfers_in_use(self) -> list[str]: ...

    def remote_num_blocks(self, engine_id: str, incarnation: str) -> int | None:
        """Any thread: the KV blocks of a peer known from a handshake, or None."""
        ...

    def peer_sizes(self) -> dict[str, tuple[str, int]]: ...

    def unclaimed_blocks(self) -> int: ...

    def num_blocks_held(self) -> int:
        """Blocks under `Hold` or `Quarantine` (any thread)."""
        ...

    def count_refused_leg(self) -> None: ...

    def metrics(self) -> ConnectorMetrics: ...

    def stopped(self) -> list[str]: ...

    def close(self) -> None: ...


def transfer_id_for(params: KVTransferParams | None, request_id: str) -> str:
    """The transfer id of a P/D request: the router's, else the request id."""
    return (params.transfer_id if params and params.transfer_id else None) or request_id


def remote_address_of(params: KVTransferParams | None) -> Address | None:
    """D: the side channel of the prefill instance a request's KV comes from."""
    if params is None or params.remote_host is None or params.remote_port is None:
        return None
    return (params.remote_host, params.remote_port)
