"""How a failed KV transfer reads in a request's error, and back.

Kept apart from the connector so that an engine front end in another process (which has
no connector and no torch) can map an engine error to its HTTP answer.
"""

from __future__ import annotations

import re
from enum import StrEnum


class TransferCause(StrEnum):
    """Why a transfer failed, as the client sees it (the HTTP layer's error `code` is
    "kv_<cause>"). A StrEnum, so a cause compares equal to its string."""

    PEER_DOWN = "peer_down"  # the prefill instance died or restarted while we waited on it
    PEER_UNREACHABLE = "peer_unreachable"  # no handshake (nobody there, wrong engine/token)
    TIMEOUT = "timeout"  # no KV within the decode instance's watchdog
    TRANSFER_FAILED = "transfer_failed"  # the READ/WRITE or the prefill itself failed
    LEASE_EXPIRED = "lease_expired"  # the prefill instance no longer holds the blocks
    PARAMS_REJECTED = "params_rejected"  # params not signed by a cluster member (or forged)
    # Push: the prefill instance never heard of the transfer (no P leg reached it in time).
    UNKNOWN_TRANSFER = "unknown_transfer"
    # The instance refused the leg: too much KV already waits on that peer or is held for
    # decode instances that have not come (retrying later may work).
    OVERLOADED = "overloaded"


TRANSFER_ERROR_CAUSES = frozenset(c.value for c in TransferCause)
_TRANSFER_ERROR_RE = re.compile(r"KV transfer failed \[([a-z_]+)\]: (.*)", re.DOTALL)


def transfer_error(cause: TransferCause, detail: str) -> str:
    """The error text of a request whose KV transfer failed (see `parse_transfer_error`)."""
    return f"KV transfer failed [{TransferCause(cause).value}]: {detail}"


def parse_transfer_error(error: str | None) -> tuple[TransferCause, str] | None:
    """(cause, detail) of an error made by `transfer_error`; None for any other error."""
    found = _TRANSFER_ERROR_RE.fullmatch(error or "")
    if found is None or found.group(1) not in TRANSFER_ERROR_CAUSES:
        return None
    return TransferCause(found.group(1)), found.group(2)
