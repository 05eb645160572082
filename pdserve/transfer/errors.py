"""How a failed KV transfer reads in a request's error, and back.

Kept apart from the connector so that an engine front end in another process (which has
no connector and no torch) can map an engine error to its HTTP answer.
"""

from __future__ import annotations

import re

# Why a transfer failed, as the client sees it (the HTTP layer's error `code` is "kv_<cause>"):
TRANSFER_ERROR_CAUSES = frozenset(
    {
        "peer_down",  # the prefill instance died or restarted while we waited on it
        "peer_unreachable",  # no handshake with it (nobody there, wrong engine, wrong token)
        "timeout",  # no KV within the decode instance's watchdog
        "transfer_failed",  # the READ/WRITE or the prefill itself failed
        "lease_expired",  # the prefill instance no longer holds the blocks
        "params_rejected",  # kv_transfer_params not signed by a cluster member (or forged)
    }
)
_TRANSFER_ERROR_RE = re.compile(r"KV transfer failed \[([a-z_]+)\]: (.*)", re.DOTALL)


def transfer_error(cause: str, detail: str) -> str:
    """The error text of a request whose KV transfer failed (see `parse_transfer_error`)."""
    return f"KV transfer failed [{cause}]: {detail}"


def parse_transfer_error(error: str | None) -> tuple[str, str] | None:
    """(cause, detail) of an error made by `transfer_error`; None for any other error."""
    found = _TRANSFER_ERROR_RE.fullmatch(error or "")
    if found is None or found.group(1) not in TRANSFER_ERROR_CAUSES:
        return None
    return found.group(1), found.group(2)
