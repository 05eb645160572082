"""`kv_transfer_params` as the connector reads and writes them (vLLM's keys, plus ours).

The router sends P `{"do_remote_decode": true}`; P's response carries `RemoteParams` as a
dict, which the router passes to D unchanged. Keys mirror vLLM's own connectors
(do_remote_prefill, remote_engine_id, remote_host, remote_port, remote_block_ids,
remote_request_id); pdserve adds `remote_incarnation` (a restarted P is a new peer),
`remote_num_tokens` and `transfer_mode`.

Push with both legs at once (pdserve's router): P gets `{do_remote_decode, transfer_mode:
push, transfer_id}` and D, at the same time, `{do_remote_prefill, transfer_mode: push,
transfer_id, remote_engine_id, remote_host, remote_port}`: D knows neither P's blocks nor
its incarnation yet (the handshake tells it the incarnation; P writes whatever it computed
into the blocks D registered). `transfer_id` pairs the two legs on P; without it P's
request id does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, get_args

import msgspec

from pdserve.transfer.params import KVTransferParams

Mode = Literal["push", "pull"]


class RemoteParams(msgspec.Struct, frozen=True, kw_only=True):
    """What D needs to get the prompt's KV from P: who P is and which blocks hold it."""

    do_remote_prefill: bool = True
    do_remote_decode: bool = False
    remote_engine_id: str
    remote_host: str
    remote_port: int  # P's side channel
    transfer_mode: Mode
    # From P's answer (sequential legs); absent when D's leg goes out with P's (push):
    remote_incarnation: str = ""  # "": the one the handshake finds at remote_host:port
    remote_request_id: str = ""  # the transfer's key on P (P's request id or transfer_id)
    remote_block_ids: list[int] = msgspec.field(default_factory=list)
    remote_num_tokens: int | None = None  # None: P computes the whole prompt
    transfer_id: str = ""  # the router's id for the transfer; P keys it by this if set
    # Pull with a cluster token: P's lease end and its signature over what D uses
    # (pdserve.transfer.params.sign over `core_params`), which D's core verifies.
    expires_at: float | None = None
    signature: str | None = None

    def __post_init__(self) -> None:
        if not self.key:
            raise ValueError("needs remote_request_id or transfer_id")
        if self.transfer_mode == "pull" and not (
            self.remote_incarnation and self.remote_block_ids and self.remote_num_tokens
        ):
            raise ValueError("pull needs P's answer (remote_incarnation, remote_block_ids)")

    @property
    def key(self) -> str:
        """The transfer's id on P (what D's registration, claim and release name)."""
        return self.remote_request_id or self.transfer_id

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
    except (msgspec.ValidationError, ValueError) as exc:
        raise ValueError(f"invalid kv_transfer_params for a decode leg: {exc}") from None


def requested_mode(params: dict[str, Any] | None) -> Mode | None:
    """P leg: the transfer mode the router asked for (`transfer_mode`), None for the default."""
    mode = (params or {}).get("transfer_mode")
    return mode if mode in get_args(Mode) else None


def transfer_id(params: dict[str, Any] | None) -> str | None:
    """P leg: the router's id for this transfer (`transfer_id`), None when it gave none."""
    tid = (params or {}).get("transfer_id")
    return tid if isinstance(tid, str) and tid else None


def core_params(
    *,
    mode: Mode,
    key: str,
    engine_id: str,
    incarnation: str,
    address: tuple[str, int],
    block_ids: Sequence[int],
    num_tokens: int | None,
    expires_at: float | None = None,
    signature: str | None = None,
) -> KVTransferParams:
    """A decode leg's params as pdserve's transfer core reads them. P signs exactly this
    (with `signature` None) and D's worker builds it again from the spec, so both sides
    name the same fields. No first token: vLLM's D computes the prompt's last token again."""
    return KVTransferParams(
        do_remote_prefill=True,
        transfer_mode=mode,
        transfer_id=key,
        remote_engine_id=engine_id,
        remote_incarnation=incarnation or None,
        remote_host=address[0],
        remote_port=address[1],
        remote_block_ids=list(block_ids) or None,
        remote_num_tokens=num_tokens,
        expires_at=expires_at,
        signature=signature,
    )
