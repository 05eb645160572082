"""What a caller proves with the cluster token over HTTP: P/D legs and routes for routers.

With a cluster token on an instance, its HTTP API serves two things only to callers that
know the token (docs/transport.md, "Connector security"):

- **P/D legs** (a request whose `kv_transfer_params` make it a prefill or decode leg). The
  router signs each leg: `X-PDServe-Leg-Signature: <mac>:<unix seconds>` with
  `mac = HMAC-SHA256(token, LEG_DOMAIN || seconds || 0 || msgpack(every field of the leg's
  parsed KVTransferParams, in declaration order))`. Every field the instance acts on is
  covered, including a push D leg's remote engine id, incarnation, host and port, so a
  decode instance never dials a peer that an unauthenticated caller named.
- **Routes for routers** (`/kv/info`, `/load`, the router's `/router/instances`):
  `X-PDServe-Cluster-Auth: <mac>:<unix seconds>` with `mac = HMAC-SHA256(token,
  ROUTE_DOMAIN || seconds || 0 || path)`.

The raw token never travels. A proof is accepted for `MAX_AGE_S` either side of its
timestamp (clock skew between hosts), so a captured header is useless later; within that
window the instance's gate refuses a leg signature it has already seen (`SeenSignatures`),
and a route proof only reads. The release of a hold (`pdserve.transfer.release`) uses the
same HMAC helper (`mac`) with its own domain; the domains keep each kind of MAC from
standing in for another.

Pure functions and one small owned cache, no I/O, nothing heavier than `hmac` and msgspec:
the router, an instance's front end (also with `--engine-process`, which never imports
torch) and clients (tests, benchmarks, operators) use this module. Run as
`python -m pdserve.transfer.cluster_auth PATH` it prints the route header for PATH with
$PDSERVE_CLUSTER_TOKEN (for curl).
"""

from __future__ import annotations

import enum
import heapq
import hmac
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from pdserve.transfer.params import InvalidKVTransferParams, KVTransferParams

TOKEN_ENV = "PDSERVE_CLUSTER_TOKEN"  # the variable `pdserve serve`, `router` and `up` read
LEG_SIGNATURE_HEADER = "X-PDServe-Leg-Signature"
CLUSTER_AUTH_HEADER = "X-PDServe-Cluster-Auth"
MAX_AGE_S = 60  # a proof is valid this long either side of its timestamp
# Domains keep these MACs apart from each other's and from releases' and params'.
LEG_DOMAIN = b"pdserve p/d leg v1\0"
ROUTE_DOMAIN = b"pdserve route for routers v1\0"
_HEX_CHARS = frozenset("0123456789abcdef")
_MAC_HEX_LEN = 64


class Proof(enum.Enum):
    """The verdict on a caller's proof of the cluster token."""

    OK = "ok"
    MISSING = "missing"  # the instance has a token, the request carries no proof: 401
    WRONG = "wrong"  # not the token's MAC of this request (or malformed): 403
    EXPIRED = "expired"  # the token's, but its timestamp is more than MAX_AGE_S away: 403
    REPLAYED = "replayed"  # a leg signature already accepted once: 403


def mac(token: str, domain: bytes, payload: bytes) -> str:
    """HMAC-SHA256 of `domain || payload` keyed with the token, hex (the one MAC helper)."""
    return hmac.new(token.encode(), domain + payload, "sha256").hexdigest()


def _stamped(seconds: int, payload: bytes) -> bytes:
    return str(seconds).encode() + b"\0" + payload


def _header(token: str, domain: bytes, payload: bytes, now: float | None) -> str:
    seconds = int(time.time() if now is None else now)
    return f"{mac(token, domain, _stamped(seconds, payload))}:{seconds}"


def _check(
    token: str | None, domain: bytes, payload: bytes, header: str | None, now: float | None
) -> Proof:
    if token is None:
        return Proof.OK
    if not header:
        return Proof.MISSING
    parsed = _parse(header)
    if parsed is None:
        return Proof.WRONG
    given, seconds = parsed
    expected = mac(token, domain, _stamped(seconds, payload))
    if not hmac.compare_digest(given.encode(), expected.encode()):
        return Proof.WRONG
    now = time.time() if now is None else now
    return Proof.OK if abs(now - seconds) <= MAX_AGE_S else Proof.EXPIRED


def _parse(header: str) -> tuple[str, int] | None:
    """(mac, seconds) of `<64 hex>:<decimal seconds>`, or None if it is not that."""
    given, sep, stamp = header.partition(":")
    if not sep or len(given) != _MAC_HEX_LEN or not set(given) <= _HEX_CHARS:
        return None
    if not (stamp.isascii() and stamp.isdigit() and len(stamp) <= 12):
        return None
    return given, int(stamp)


# -- P/D legs --------------------------------------------------------------------------------


def leg_payload(params: KVTransferParams) -> bytes:
    """The canonical bytes of a leg: every field of its parsed params, in declaration
    order (a field added to KVTransferParams is covered without a change here)."""
    return msgspec.msgpack.encode(msgspec.structs.astuple(params))


def sign_leg(
    token: str, params: Mapping[str, Any] | KVTransferParams, now: float | None = None
) -> str:
    """The router: the `LEG_SIGNATURE_HEADER` value for a leg carrying `params` (a dict is
    parsed as the instance will parse it; InvalidKVTransferParams if it cannot be)."""
    if not isinstance(params, KVTransferParams):
        try:
            params = msgspec.convert(params, KVTransferParams)
        except msgspec.ValidationError as exc:
            raise InvalidKVTransferParams(f"kv_transfer_params: {exc}") from None
    return _header(token, LEG_DOMAIN, leg_payload(params), now)


def check_leg(
    token: str | None, params: KVTransferParams, header: str | None, now: float | None = None
) -> Proof:
    """An instance: whether `header` is the token's fresh signature of exactly `params`
    (always OK without a token). Replays are the caller's (`SeenSignatures`)."""
    return _check(token, LEG_DOMAIN, leg_payload(params), header, now)


@dataclass
class SeenSignatures:
    """The leg signatures an instance accepted while they could still be replayed (until
    their timestamp is `MAX_AGE_S` old). Owned by one admission gate, used on its event
    loop only; holds only valid signatures, so it grows with the router's rate, not with a
    stranger's."""

    _expiry: list[tuple[float, str]] = field(default_factory=list)  # heap by expiry
    _seen: set[str] = field(default_factory=set)

    def first_use(self, header: str, now: float | None = None) -> bool:
        """Record a valid `header`; False if it was recorded before (a replay)."""
        now = time.time() if now is None else now
        while self._expiry and self._expiry[0][0] < now:
            self._seen.discard(heapq.heappop(self._expiry)[1])
        if header in self._seen:
            return False
        self._seen.add(header)
        seconds = int(header.rpartition(":")[2])
        heapq.heappush(self._expiry, (seconds + MAX_AGE_S, header))
        return True

    def __len__(self) -> int:
        return len(self._seen)


# -- routes for routers ----------------------------------------------------------------------


def route_proof(token: str, path: str, now: float | None = None) -> str:
    """The `CLUSTER_AUTH_HEADER` value for a GET of `path` (e.g. "/load")."""
    return _header(token, ROUTE_DOMAIN, path.encode(), now)


def route_headers(token: str | None, path: str) -> dict[str, str]:
    """Headers proving the token for `path`; none without a token (clients' helper)."""
    return {CLUSTER_AUTH_HEADER: route_proof(token, path)} if token else {}


def check_route(
    token: str | None, path: str, header: str | None, now: float | None = None
) -> Proof:
    """An instance or the router: whether `header` proves the token for `path`."""
    return _check(token, ROUTE_DOMAIN, path.encode(), header, now)


def main(argv: list[str]) -> int:
    """Print `X-PDServe-Cluster-Auth: ...` for each path given, with $PDSERVE_CLUSTER_TOKEN."""
    token = os.environ.get(TOKEN_ENV)
    if not token or not argv:
        print(
            f"usage: {TOKEN_ENV}=... python -m pdserve.transfer.cluster_auth PATH", file=sys.stderr
        )
        return 2
    for path in argv:
        print(f"{CLUSTER_AUTH_HEADER}: {route_proof(token, path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
