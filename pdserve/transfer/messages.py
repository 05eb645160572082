"""Typed control messages between instances (side channel and transport notifications).

One msgspec tagged union, one codec. Block ids are plain ints; engine identity is
(engine_id, incarnation): a restarted instance has a new incarnation, so nothing
addressed to its previous life is ever applied to it.
"""

from __future__ import annotations

from enum import StrEnum

import msgspec

from pdserve.token_logprob import TokenLogprob
from pdserve.transfer.errors import TransferCause


class Compat(msgspec.Struct, frozen=True, kw_only=True):
    """What two instances must agree on to exchange KV blocks."""

    model: str
    dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    layout: str

    def mismatch(self, other: Compat) -> str | None:
        """A sentence naming every difference, or None if compatible."""
        diffs = [
            f"{f}: {getattr(self, f)!r} here vs {getattr(other, f)!r} there"
            for f in self.__struct_fields__
            if getattr(self, f) != getattr(other, f)
        ]
        return "; ".join(diffs) or None


class Hello(msgspec.Struct, tag=True, kw_only=True):
    """Handshake request: the sender's identity, compat and transport metadata."""

    nonce: str
    engine_id: str
    incarnation: str
    reply_to: tuple[str, int]
    compat: Compat
    num_blocks: int
    transport_metadata: bytes


class HelloReply(msgspec.Struct, tag=True, kw_only=True):
    nonce: str
    engine_id: str
    incarnation: str
    compat: Compat
    num_blocks: int
    transport_metadata: bytes
    error: str | None = None


class PushRegistration(msgspec.Struct, tag=True, kw_only=True):
    """D -> P: my blocks for `transfer_id` are reserved; write the prompt's KV there."""

    transfer_id: str
    engine_id: str
    incarnation: str
    reply_to: tuple[str, int]
    block_ids: list[int]
    num_tokens: int
    # Prefix caching: D already holds the prompt's first `skip_blocks` blocks; `block_ids`
    # receive P's blocks from that index on (0 from a D without caching or a hit).
    skip_blocks: int = 0


class PushDone(msgspec.Struct, tag=True, kw_only=True):
    """P -> D, as the WRITE's notification (delivered only after the data)."""

    transfer_id: str
    # None: P's engine computes no first token for D (vLLM: D computes the prompt's last
    # token again itself); pdserve's P always sends the one it sampled.
    first_token_id: int | None
    prefill_done_time: float
    first_token_logprobs: TokenLogprob | None = None  # when the request asked for logprobs


class PushFailCause(StrEnum):
    """Why P will never write a registered transfer (PushFailed.cause; P's metric label)."""

    UNKNOWN_TRANSFER = "unknown_transfer"  # no prompt for it reached P within the grace
    EXPIRED = "expired"  # P knew the prompt, but it never finished (registration_ttl_s)
    RELEASED = "released"  # the router released the transfer
    PREFILL_FAILED = "prefill_failed"  # the prompt was aborted or failed on P
    UNKNOWN_PEER = "unknown_peer"  # P does not know D's incarnation (handshake again)
    SIZE_MISMATCH = "size_mismatch"  # D registered another prompt size than P computed
    WRITE_FAILED = "write_failed"  # posting, writing or notifying failed

    def client_cause(self) -> TransferCause:
        """The cause D's client sees (pdserve.transfer.errors)."""
        if self is PushFailCause.UNKNOWN_TRANSFER:
            return TransferCause.UNKNOWN_TRANSFER
        return TransferCause.TRANSFER_FAILED


class PushFailed(msgspec.Struct, tag=True, kw_only=True):
    """P -> D: the write for `transfer_id` will never come; fail the request now."""

    transfer_id: str
    reason: str
    unknown_peer: bool = False  # P does not know D's incarnation: D should handshake again
    cause: PushFailCause = PushFailCause.WRITE_FAILED


class PushAbort(msgspec.Struct, tag=True, kw_only=True):
    """D -> P: I gave up on `transfer_id`; do not write (ack when it is safe)."""

    transfer_id: str
    engine_id: str
    incarnation: str
    reply_to: tuple[str, int]


class PushAbortAck(msgspec.Struct, tag=True, kw_only=True):
    """P -> D: no write for `transfer_id` is or will be in flight; quarantine may end."""

    transfer_id: str


class PullClaim(msgspec.Struct, tag=True, kw_only=True):
    """D -> P, before its READ: I am about to read `block_ids` of `transfer_id`.

    P answers PullClaimReply (same nonce): ok only if it still holds exactly these blocks
    for that transfer and nobody else claimed them; the hold is then kept for D (its lease
    starts again) until D's PullDone. A refused claim means no READ is posted.
    """

    nonce: str
    transfer_id: str
    block_ids: list[int]
    engine_id: str
    incarnation: str
    reply_to: tuple[str, int]


class PullClaimReply(msgspec.Struct, tag=True, kw_only=True):
    nonce: str
    error: str | None = None
    lease_expired: bool = False  # the refusal's cause: P no longer holds the transfer


class PullDone(msgspec.Struct, tag=True, kw_only=True):
    """D -> P: I finished reading `transfer_id` (ok or not); free the held blocks.

    P frees them only if the sender (engine id, incarnation) is the one that claimed them,
    or, for a hold nobody claimed (D failed before its claim), if `block_ids` are the hold's.
    """

    transfer_id: str
    ok: bool
    engine_id: str = ""
    incarnation: str = ""
    block_ids: list[int] = []


class Ping(msgspec.Struct, tag=True, kw_only=True):
    """Liveness probe of a peer this instance waits on (see KVConnector's heartbeat)."""

    reply_to: tuple[str, int]


class Pong(msgspec.Struct, tag=True, kw_only=True):
    engine_id: str
    incarnation: str
    address: tuple[str, int]  # the side channel that answered (the Ping's target)


Message = Hello | HelloReply | PushRegistration | PushDone | PushFailed | PushAbort
Message = Message | PushAbortAck | PullClaim | PullClaimReply | PullDone | Ping | Pong
Request = Hello | PullClaim  # messages answered by a reply carrying the same nonce
Reply = HelloReply | PullClaimReply

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes) -> Message:
    """Raises msgspec.DecodeError / ValidationError on malformed input."""
    return _decoder.decode(data)
