"""`kv_transfer_params` as the connector reads and writes them (vLLM's keys, plus ours).

The router sends P `{"do_remote_decode": true}`; P's response carries `RemoteParams` as a
dict, which the router passes to D unchanged. Keys mirror vLLM's own connectors
(do_remote_prefill, remote_engine_id, remote_host, remote_port, remote_block_ids,
remote_request_id); pdserve adds `remote_incarnation` (a restarted P is a new peer),
`remote_num_tokens` and `transfer_mode`.
"""

from __future__ import annotations

from typing import Any, Literal, get_args

import msgspec

Mode = Literal["push", "pull"]


class RemoteParams(msgspec.Struct, frozen=True, kw_only=True):
    """What D needs to get the prompt's KV from P: who P is and which blocks hold it."""

    do_remote_prefill: bool = True
    do_remote_decode: bool = False
    remote_engine_id: str
    remote_incarnation: str
    remote_request_id: str
    remote_host: str
    remote_port: int  # P's side channel
    remote_block_ids: list[int]
    remote_num_tokens: int
    transfer_mode: Mode

    def to_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)


def wants_remote_decode(params: dict[str, Any] | None) -> bool:
    """P leg: the router asked this instance to prefill and hand the KV to a decoder."""
    return bool(params and params.get("do_remote_decode"))


def remote_prefill(params: dict[str, Any] | None) -> RemoteParams | None:
    """D leg: the parsed params, None for a normal request; ValueError if malformed."""
    if not params or not params.get("do_remote_prefill"):
        return None
    try:
        return msgspec.convert(params, RemoteParams)
    except msgspec.ValidationError as exc:
        raise ValueError(f"invalid kv_transfer_params for a decode leg: {exc}") from None


def requested_mode(params: dict[str, Any] | None) -> Mode | None:
    """P leg: the transfer mode the router asked for (`transfer_mode`), None for the default."""
    mode = (params or {}).get("transfer_mode")
    return mode if mode in get_args(Mode) else None
