"""HTTP keep-alive timing shared by pdserve's servers and its own HTTP clients.

A server closes a connection once it has been idle for its keep-alive timeout; a client
reuses a pooled connection until its own expiry. When the two are equal (uvicorn's and
httpx's defaults are both 5 s), a client can send a request on a connection the server is
closing at that very moment: the request fails with a read error before any byte of the
answer, and neither httpx nor aiohttp retries it (seen once in ~250 requests of a bench
run, session 8).
So pdserve's servers (instances, router) keep idle connections well past the time pdserve's
clients (the router's legs, `bench`, `soak`) keep them, and those clients drop theirs first.
Clients of other makers should keep their expiry below `SERVER_KEEPALIVE_S` (docs/router.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the servers import this module too, and need no HTTP client
    import httpx

SERVER_KEEPALIVE_S = 30.0  # uvicorn `timeout_keep_alive` of every pdserve server
CLIENT_KEEPALIVE_S = 4.0  # keep-alive expiry of every pdserve client (aiohttp or httpx)


def client_limits(
    max_connections: int | None, max_keepalive_connections: int | None = None
) -> httpx.Limits:
    """Connection limits for a pdserve HTTP client, with the keep-alive expiry above."""
    import httpx

    return httpx.Limits(
        max_connections=max_connections,
        max_keepalive_connections=max_keepalive_connections,
        keepalive_expiry=CLIENT_KEEPALIVE_S,
    )
