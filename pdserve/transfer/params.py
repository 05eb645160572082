"""`kv_transfer_params`: the wire contract between the router and the instances.

The names follow vLLM's P/D connectors so a user who knows vLLM finds the same words.
The router adds these to the JSON body of a completion request; an instance echoes
its own view back in the response body under the same key.

Pull (sequential):
  router -> P  {do_remote_decode, transfer_mode="pull", transfer_id} (max_tokens=1)
  P -> router  {remote_engine_id, remote_host, remote_port, remote_block_ids,
                remote_num_tokens, first_token_id, transfer_id, prefill_done_time}
  router -> D  everything P returned + {do_remote_prefill, transfer_mode="pull"}
  With a cluster token P also returns {expires_at, signature}: an HMAC-SHA256 keyed with
  the token over the fields D uses (`SignedFields`), which D verifies before it reads
  (`verify`); without a token nothing is signed and D trusts whoever sent the params
  (P still refuses a READ claim for blocks it does not hold for that transfer id).
Push (concurrent; the router learned P's identity from P's `GET /kv/info`):
  router -> P  {do_remote_decode, transfer_mode="push", transfer_id}
  router -> D  {do_remote_prefill, transfer_mode="push", transfer_id,
                remote_engine_id, remote_host, remote_port}
  P -> router  {transfer_id, remote_num_tokens, prefill_done_time}
"""

from __future__ import annotations

import hmac
import ipaddress
import math
import re
import time
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from pdserve.token_logprob import MAX_LOGPROBS, TokenLogprob

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
    expires_at: float | None = None  # pull: unix time P's hold (lease) ends
    signature: str | None = None  # pull: P's HMAC of the fields D uses (see `sign`)
    # pull: the logprobs of `first_token_id` when the request asked for logprobs
    first_token_logprobs: TokenLogprob | None = None


class InvalidKVTransferParams(ValueError):
    """Malformed `kv_transfer_params`: the HTTP layer turns this into a 400."""


# Bounds on what a leg may carry. Ids are made by pdserve (uuid hex, "cmpl-<X-Request-Id>")
# and stay far below these; the bounds only keep hostile input out of logs and pool tags.
MAX_ID_CHARS = 256
_ID_RE = re.compile(r"[\x21-\x7e]+")  # printable ASCII, no spaces
# A DNS name (RFC 1123 labels) or an IP literal; anything else would make ZMQ raise deep
# inside a connector thread instead of here.
_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOSTNAME_RE = re.compile(rf"(?=.{{1,253}}$){_LABEL}(\.{_LABEL})*\.?")

_SIGNATURE_RE = re.compile(r"[0-9a-f]{64}")

_DECODE_PULL = ("remote_engine_id", "remote_host", "remote_port", "remote_block_ids")
_DECODE_PULL += ("remote_num_tokens", "first_token_id", "transfer_id")
_DECODE_PUSH = ("transfer_id", "remote_engine_id", "remote_host", "remote_port")


def valid_id(value: str) -> bool:
    """Whether `value` may name a transfer, engine or incarnation (bounded printable ASCII)."""
    return len(value) <= MAX_ID_CHARS and _ID_RE.fullmatch(value) is not None


def parse_kv_transfer_params(raw: Any) -> KVTransferParams:
    """Decode and check a request's `kv_transfer_params`; raises InvalidKVTransferParams."""
    try:
        params = msgspec.convert(raw, KVTransferParams)
    except msgspec.ValidationError as exc:
        raise InvalidKVTransferParams(f"kv_transfer_params: {exc}") from None
    except UnicodeEncodeError:  # msgspec encodes keys and enum values as UTF-8 to match them
        raise InvalidKVTransferParams(
            "kv_transfer_params: keys and values must be valid Unicode (no lone surrogates)"
        ) from None
    validate(params)
    return params


def validate(p: KVTransferParams) -> None:
    """Check that the fields a leg needs are present and sane (no instance needed)."""
    if p.do_remote_decode and p.do_remote_prefill:
        raise InvalidKVTransferParams("do_remote_decode and do_remote_prefill are exclusive")
    _check_fields(p)
    if not (p.do_remote_decode or p.do_remote_prefill):
        return
    if p.transfer_mode is None:
        raise InvalidKVTransferParams("kv_transfer_params.transfer_mode is required")
    if p.do_remote_prefill:
        need = _DECODE_PULL if p.transfer_mode == "pull" else _DECODE_PUSH
        missing = [f for f in need if getattr(p, f) is None]
        if missing:
            raise InvalidKVTransferParams(
                f"kv_transfer_params is missing {', '.join(missing)} "
                f"(a decode leg with transfer_mode {p.transfer_mode!r} needs them)"
            )
    elif p.transfer_mode == "push" and not p.transfer_id:
        raise InvalidKVTransferParams("kv_transfer_params.transfer_id is required for push")


def _check_fields(p: KVTransferParams) -> None:
    """Each field on its own: ids, address, block ids, counts."""
    for name in ("transfer_id", "remote_engine_id", "remote_incarnation"):
        value = getattr(p, name)
        if value is not None and not valid_id(value):
            raise _bad(name, f"must be 1-{MAX_ID_CHARS} printable ASCII characters, no spaces")
    if p.remote_host is not None and not _is_host(p.remote_host):
        raise _bad("remote_host", "must be an IP address or a DNS name")
    if p.remote_port is not None and not 0 < p.remote_port < 65536:
        raise _bad("remote_port", "is out of range")
    blocks = p.remote_block_ids
    if blocks is not None and any(b < 0 for b in blocks):
        raise _bad("remote_block_ids", "must be >= 0")
    if blocks is not None and len(set(blocks)) != len(blocks):
        raise _bad("remote_block_ids", "must not repeat a block")
    if p.remote_num_tokens is not None and p.remote_num_tokens < 1:
        raise _bad("remote_num_tokens", "must be >= 1")
    if p.first_token_id is not None and p.first_token_id < 0:
        raise _bad("first_token_id", "must be >= 0")
    for name in ("prefill_done_time", "expires_at"):
        value = getattr(p, name)
        if value is not None and not math.isfinite(value):
            raise _bad(name, "must be a finite number")
    if p.signature is not None and not _SIGNATURE_RE.fullmatch(p.signature):
        raise _bad("signature", "must be 64 lowercase hex digits (HMAC-SHA256)")
    if p.first_token_logprobs is not None:
        _check_first_logprobs(p.first_token_logprobs, p.first_token_id)


def _check_first_logprobs(lp: TokenLogprob, first_token_id: int | None) -> None:
    """The first token's logprobs describe that token, with at most 20 top entries."""
    if lp.token_id != first_token_id:
        raise _bad("first_token_logprobs", "must describe first_token_id")
    top = len(lp.top_ids)
    if top > MAX_LOGPROBS or len(lp.top_logprobs) != top or lp.rank < 1:
        raise _bad("first_token_logprobs", f"must hold a rank and at most {MAX_LOGPROBS} pairs")
    if any(t < 0 for t in lp.top_ids) or any(v > 0 or math.isnan(v) for v in lp.top_logprobs):
        raise _bad("first_token_logprobs", "holds an impossible token id or logprob")
    if lp.logprob > 0 or math.isnan(lp.logprob):
        raise _bad("first_token_logprobs", "holds an impossible logprob")


def check_for_instance(
    p: KVTransferParams, instance: InstanceLimits, num_prompt_tokens: int
) -> None:
    """Check a leg against the instance that is to run it; raises InvalidKVTransferParams.

    Called twice: by the HTTP layer (to answer 400 before submission) and by the engine
    (the authority, for requests that do not come through HTTP).
    """
    if not (p.do_remote_decode or p.do_remote_prefill):
        return
    leg = "do_remote_decode" if p.do_remote_decode else "do_remote_prefill"
    wanted = "prefill" if p.do_remote_decode else "decode"
    if instance.role == "both":
        raise InvalidKVTransferParams(
            f"kv_transfer_params.{leg} needs a P/D instance; this one is monolithic "
            "(it runs without a KV connector)"
        )
    if instance.role != wanted:
        raise InvalidKVTransferParams(
            f"kv_transfer_params.{leg} needs a {wanted} instance; this one is {instance.role}"
        )
    if p.transfer_mode != instance.mode:
        raise _bad("transfer_mode", f"is {p.transfer_mode!r}, this instance uses {instance.mode!r}")
    if p.do_remote_prefill:
        _check_decode_leg(p, instance, num_prompt_tokens)


def _check_decode_leg(
    p: KVTransferParams, instance: InstanceLimits, num_prompt_tokens: int
) -> None:
    if p.remote_num_tokens is not None and p.remote_num_tokens != num_prompt_tokens:
        raise _bad(
            "remote_num_tokens",
            f"is {p.remote_num_tokens}, but the prompt has {num_prompt_tokens} tokens",
        )
    if p.transfer_mode != "pull":
        return
    need = -(-num_prompt_tokens // instance.block_size)
    if p.remote_block_ids is not None and len(p.remote_block_ids) != need:
        raise _bad(
            "remote_block_ids",
            f"names {len(p.remote_block_ids)} blocks; a prompt of {num_prompt_tokens} tokens "
            f"fills {need} blocks of {instance.block_size} tokens",
        )
    if p.first_token_id is not None and p.first_token_id >= instance.vocab_size:
        raise _bad("first_token_id", f"is outside the vocabulary [0, {instance.vocab_size})")


def check_remote_blocks(p: KVTransferParams, remote_num_blocks: int) -> None:
    """Pull: every block P named must exist in P's cache (known after the handshake)."""
    bad = [b for b in p.remote_block_ids or () if b >= remote_num_blocks]
    if bad:
        raise _bad(
            "remote_block_ids",
            f"names block {bad[0]}, but the prefill instance has {remote_num_blocks} blocks",
        )


class SignedFields(msgspec.Struct, array_like=True, frozen=True):
    """Every field of pull params that D acts on, in a fixed order: what P signs.

    The legs' flags (`do_remote_decode`/`do_remote_prefill`) are left out: the router flips
    them between P's answer and D's request, and D's role already fixes their meaning.
    """

    transfer_mode: str | None
    transfer_id: str | None
    remote_engine_id: str | None
    remote_incarnation: str | None
    remote_host: str | None
    remote_port: int | None
    remote_block_ids: list[int] | None
    remote_num_tokens: int | None
    first_token_id: int | None
    prefill_done_time: float | None
    expires_at: float | None
    first_token_logprobs: TokenLogprob | None


_SIGNING_DOMAIN = b"pdserve kv_transfer_params v1\0"  # keeps these MACs apart from frames'


def _mac(p: KVTransferParams, key: bytes) -> str:
    fields = SignedFields(*(getattr(p, f) for f in SignedFields.__struct_fields__))
    return hmac.new(key, _SIGNING_DOMAIN + msgspec.msgpack.encode(fields), "sha256").hexdigest()


def sign(p: KVTransferParams, key: bytes) -> KVTransferParams:
    """P: `p` with its signature (`expires_at` must already be set)."""
    return msgspec.structs.replace(p, signature=_mac(p, key))


def verify(p: KVTransferParams, key: bytes) -> None:
    """D: raise InvalidKVTransferParams unless P signed exactly these fields with `key`."""
    if p.signature is None:
        raise _bad("signature", "is missing; this instance needs params signed by P")
    if not hmac.compare_digest(p.signature.encode(), _mac(p, key).encode()):
        raise _bad(
            "signature",
            "does not match: the params were changed or not made by a prefill instance of "
            "this cluster",
        )


def check_pull_params(params: KVTransferParams, key: bytes | None) -> None:
    """D (pull): with a cluster token, P's signature over every field D uses must hold;
    raises InvalidKVTransferParams otherwise. Pure: the engine core's connector and a front
    end in another process (`EngineCoreClient`) check alike."""
    if key is not None and params.do_remote_prefill:
        verify(params, key)


def lease_ended(p: KVTransferParams, now: float | None = None) -> str | None:
    """D: why P no longer holds the blocks of these params (`expires_at` passed), or None.
    Params without `expires_at` (unsigned) are left to P's claim check."""
    now = time.time() if now is None else now
    if p.expires_at is not None and p.expires_at < now:
        return f"the lease on the prefill instance ended at {p.expires_at:.3f} (unix time)"
    return None


@dataclass(frozen=True)
class InstanceLimits:
    """What `check_for_instance` needs to know about the instance running a leg."""

    role: Literal["both", "prefill", "decode"]
    mode: TransferModeName | None  # None on a monolithic instance
    block_size: int
    vocab_size: int


def _bad(field: str, what: str) -> InvalidKVTransferParams:
    return InvalidKVTransferParams(f"kv_transfer_params.{field} {what}")


def _is_host(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return _HOSTNAME_RE.fullmatch(host) is not None
    return True


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
