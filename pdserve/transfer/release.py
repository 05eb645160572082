"""The router's release of a prefill instance's hold: `POST /kv/release` and its signature.

When a request's decode leg is refused or fails before D's stream starts, or the client
goes away between the legs, nobody will ever read (pull) or be written (push) the prompt's
KV that P keeps under `Hold(transfer_id)`. The router then tells P at once, instead of
leaving the blocks held until the lease ends:

    POST /kv/release  {"transfer_id": T}
    X-PDServe-Release-Signature: HMAC-SHA256(token, DOMAIN || T), hex

With a cluster token on P, an unsigned release is refused (401) and a wrongly signed one
too (403); neither frees anything. Without a token on P the call is unauthenticated, like
every other loopback-without-token path (docs/transport.md). The transfer id is random
(`uuid4().hex`) and short-lived, and the signature binds only it: a captured signature
can only release the same transfer again, which is idempotent.

The MAC is `pdserve.transfer.cluster_auth.mac`, the one helper that legs and routes for
routers use too (each with its own domain). Pure functions, no I/O, nothing heavier than
`hmac`: the router and an instance's front end (also with `--engine-process`, which never
imports torch) both use this module.
"""

from __future__ import annotations

import enum
import hmac
import os

from pdserve.transfer.cluster_auth import TOKEN_ENV, mac

SIGNATURE_HEADER = "X-PDServe-Release-Signature"
RELEASE_PATH = "/kv/release"
_DOMAIN = b"pdserve kv release v1\0"  # keeps these MACs apart from params' and frames'


class ReleaseAuth(enum.Enum):
    """The verdict on a release's signature."""

    OK = "ok"
    MISSING = "missing"  # P has a token, the release carries no signature: 401
    WRONG = "wrong"  # the signature is not the token's for this transfer: 403


def token_from_env(flag_value: str | None) -> str | None:
    """The cluster token: the flag, else $PDSERVE_CLUSTER_TOKEN, else None (no auth)."""
    return flag_value or os.environ.get(TOKEN_ENV) or None


def release_signature(token: str, transfer_id: str) -> str:
    """The router's signature of a release of `transfer_id` (64 hex digits)."""
    return mac(token, _DOMAIN, transfer_id.encode())


def check_release(token: str | None, transfer_id: str, signature: str | None) -> ReleaseAuth:
    """P: whether a release of `transfer_id` carrying `signature` may be applied here."""
    if token is None:
        return ReleaseAuth.OK
    if not signature:
        return ReleaseAuth.MISSING
    expected = release_signature(token, transfer_id)
    if hmac.compare_digest(signature.encode(), expected.encode()):
        return ReleaseAuth.OK
    return ReleaseAuth.WRONG
