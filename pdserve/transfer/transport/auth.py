"""Cluster-token challenge-response: each side proves it knows the token, never sends it.

Handshake (both backends, see `handshake`): the client sends a fresh nonce, the server
answers with its own nonce and a proof, the client checks it and answers with its proof.

    proof(role) = HMAC-SHA256(key, role || transcript)
    transcript  = msgpack([LABEL, backend, client engine, client incarnation,
                           server engine, server incarnation, client nonce, server nonce])

Both nonces are fresh per connection, so a recorded proof is useless later (no replay);
the role label differs for the two directions, so a proof cannot be reflected back; the
identities are bound in, so a proof for one pair of incarnations does not fit another.

Policy: a side with a token requires a valid proof from the other side and refuses the
connection otherwise. A side without a token sends empty proofs and accepts anyone, so a
tokenless instance can only talk to other tokenless instances (a token holder refuses it).
Pure functions; no I/O.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets

import msgspec

NONCE_BYTES = 32
TOKEN_ENV = "PDSERVE_CLUSTER_TOKEN"
_LABEL = b"pdserve-transport-auth-v1"
CLIENT = b"client"
SERVER = b"server"


def new_nonce() -> bytes:
    """A fresh random challenge."""
    return secrets.token_bytes(NONCE_BYTES)


def resolve_token(flag_value: str | None) -> str | None:
    """The cluster token: the CLI flag, else $PDSERVE_CLUSTER_TOKEN, else None (no auth)."""
    return flag_value or os.environ.get(TOKEN_ENV) or None


def transcript(
    backend: str,
    client: tuple[str, str],
    server: tuple[str, str],
    client_nonce: bytes,
    server_nonce: bytes,
) -> bytes:
    """The bytes both proofs cover: backend, both identities, both nonces."""
    fields = [_LABEL, backend, *client, *server, client_nonce, server_nonce]
    return msgspec.msgpack.encode(fields)


def _key(token: str) -> bytes:
    # A derived key keeps the raw token out of every HMAC computation's inputs.
    return hashlib.sha256(_LABEL + token.encode()).digest()


def prove(token: str | None, role: bytes, transcript_bytes: bytes) -> bytes:
    """This side's proof for `role`; empty without a token."""
    if token is None:
        return b""
    return hmac.new(_key(token), role + transcript_bytes, hashlib.sha256).digest()


def verify(token: str | None, role: bytes, transcript_bytes: bytes, proof: bytes) -> bool:
    """Whether `proof` shows the other side knows our token (always True without a token)."""
    if token is None:
        return True
    return hmac.compare_digest(prove(token, role, transcript_bytes), proof)
