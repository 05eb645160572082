"""HTTP keep-alive timing shared by pdserve's servers and its own HTTP clients.

A server closes a connection once it has been idle for its keep-alive timeout; a client
reuses a pooled connection until its own expiry. When the two are equal (5 s: uvicorn's
default, and that of the client library `bench` used then), a client can send a request on
a connection the server is closing at that very moment: the request fails with a read error
before any byte of the answer, and aiohttp does not retry it (nor did that library; seen
once in ~250 requests of a bench run, session 8).
So pdserve's servers (instances, router) keep idle connections well past the time pdserve's
clients (the router's legs, `bench`, `soak`, `pdserve.http_client`) keep them, and those
clients drop theirs first. Clients of other makers should keep their expiry below
`SERVER_KEEPALIVE_S` (docs/router.md).
"""

from __future__ import annotations

SERVER_KEEPALIVE_S = 30.0  # uvicorn `timeout_keep_alive` of every pdserve server
CLIENT_KEEPALIVE_S = 4.0  # aiohttp `keepalive_timeout` of every pdserve client
