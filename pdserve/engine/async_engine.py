"""Asyncio-facing handle on the engine loop (which runs in its own thread).

Owned by the HTTP front end. The engine thread owns every KV block; the front end
only ever sees request ids and `RequestOutput`s.
"""
# Implementation lands with the engine loop (issue 1); the signatures below are the contract.
