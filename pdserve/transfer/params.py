"""`kv_transfer_params`: the wire contract between the router and the instances.

The names follow vLLM's P/D connectors so a user who knows vLLM finds the same words.
The router adds these to the JSON body of a completion request; an instance echoes
its own view back in the response body under the same key.

Pull (sequential):
  router -> P  {do_remote_decode, transfer_mode="pull"}            (max_tokens=1)
  P -> router  {remote_engine_id, remote_host, remote_port, remote_block_ids,
                remote_num_tokens, first_token_id, transfer_id, prefill_done_time}
  router -> D  everything P returned + {do_remote_prefill, transfer_mode="pull"}
Push (concurrent; the router learned P's identity from P's `GET /kv/info`):
  router -> P  {do_remote_decode, transfer_mode="push", transfer_id}
  router -> D  {do_remote_prefill, transfer_mode="push", transfer_id,
                remote_engine_id, remote_host, remote_port}
  P -> router  {transfer_id, remote_num_tokens, prefill_done_time}
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

TransferModeName = Literal["pull", "push"]


class KVTransferParams(
    msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True
):
    """Every field a leg may carry; which are required depends on the leg (see `validate`)."""

    do_remote_decode: bool = False  # this instance prefills; a remote one decodes
    do_remote_prefill: bool = False  # this instance decodes; a remote one prefilled
    transfer_mode: TransferModeName | None = None
    transfer_id: str | None = None
    remote_engine_id: str | None = None
    remote_incarnation: str | None = None  # when given, a different one forces a re-handshake
    remote_host: str | None = None
    remote_port: int | None = None  # the remote instance's side-channel port
    remote_block_ids: list[int] | None = None  # pull: P's blocks holding the prompt's KV
    remote_num_tokens: int | None = None  # prompt tokens whose KV P holds
    first_token_id: int | None = None  # pull: the token P sampled after the prompt
    prefill_done_time: float | None = None  # unix time P finished the prompt (handoff metric)


class InvalidKVTransferParams(ValueError):
    """Malformed `kv_transfer_params`: the HTTP layer turns this into a 400."""


_DECODE_PULL = ("remote_engine_id", "remote_host", "remote_port", "remote_block_ids")
_DECODE_PULL += ("remote_num_tokens", "first_token_id", "transfer_id")
_DECODE_PUSH = ("transfer_id", "remote_engine_id", "remote_host", "remote_port")


def parse_kv_transfer_params(raw: Any) -> KVTransferParams:
    """Decode and check a request's `kv_transfer_params`; raises InvalidKVTransferParams."""
    try:
        params = msgspec.convert(raw, KVTransferParams)
    except msgspec.ValidationError as exc:
        raise InvalidKVTransferParams(f"kv_transfer_params: {exc}") from None
    validate(params)
    return params


def validate(p: KVTransferParams) -> None:
    """Check that the fields a leg needs are present and sane."""
    if p.do_remote_decode and p.do_remote_prefill:
        raise InvalidKVTransferParams("do_remote_decode and do_remote_prefill are exclusive")
    if not (p.do_remote_decode or p.do_remote_prefill):
        return
    if p.transfer_mode is None:
        raise InvalidKVTransferParams("kv_transfer_params.transfer_mode is required")
    if p.do_remote_prefill:
        need = _DECODE_PULL if p.transfer_mode == "pull" else _DECODE_PUSH
        missing = [f for f in need if getattr(p, f) is None]
        if missing:
            raise InvalidKVTransferParams(f"kv_transfer_params is missing {', '.join(missing)}")
    elif p.transfer_mode == "push" and not p.transfer_id:
        raise InvalidKVTransferParams("kv_transfer_params.transfer_id is required for push")
    if p.remote_block_ids is not None and any(b < 0 for b in p.remote_block_ids):
        raise InvalidKVTransferParams("kv_transfer_params.remote_block_ids must be >= 0")
    if p.remote_port is not None and not 0 < p.remote_port < 65536:
        raise InvalidKVTransferParams("kv_transfer_params.remote_port is out of range")


class InstanceInfo(msgspec.Struct, kw_only=True):
    """`GET /kv/info` of an instance: what a router needs to pair it with others."""

    engine_id: str
    incarnation: str
    role: Literal["both", "prefill", "decode"]
    transfer_mode: TransferModeName | None
    transport: str | None
    side_channel_host: str | None
    side_channel_port: int | None
    model: str


class InstanceLoad(msgspec.Struct, kw_only=True):
    """`GET /load` of an instance: a cheap load report for routing policies."""

    num_running: int
    num_waiting: int
    num_waiting_for_kv: int
    kv_blocks_used: int
    kv_blocks_total: int
