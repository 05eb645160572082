"""The legs of a P/D request when the instances are vLLM's OpenAI servers (`--engine vllm`).

vLLM's connectors (its NixlConnector and NixlPushConnector, or pdserve's connector loaded
into vLLM) speak vLLM's `kv_transfer_params`, which are not pdserve's: the router treats
them as opaque dicts and never rewrites what P returns.

- Pull: P gets `{do_remote_decode: true, do_remote_prefill: false}` with `max_tokens=1`;
  the `kv_transfer_params` of P's answer go to D untouched.
- Push with pdserve's connector: both legs at once. P gets `{do_remote_decode: true,
  transfer_mode: push, transfer_id}` and D `{do_remote_prefill: true, transfer_mode: push,
  transfer_id, remote_engine_id, remote_host, remote_port}` (P's connector, `PrefillPeer`),
  the same router-chosen transfer id on both: D registers its blocks at admission and P
  writes once its prefill ends (pdserve.vllm.params).
- Push with NixlPushConnector: both legs at once, under one fresh `X-Request-Id` (vLLM's
  push pairs D's registration with P's request by the id's base). D's params name P's connector (its
  engine id and side channel: `PrefillPeer`, from the router's configuration, since vLLM has
  no /kv/info), the transfer's shape (`tp_size`), and the fields vLLM 0.32's D scheduler
  reads even in push mode (`remote_request_id`, P's request id before vLLM's random suffix,
  and an empty `remote_block_ids`; a missing key kills D's engine core).

What vLLM's instances do not have, the router does without: no /kv/info, /load or
/kv/release (P's blocks of a request D never takes are freed by vLLM's own lease), no
signed legs, and no prefill-done time from P (the router uses the time P's answer reached
it; pdserve.router.dispatch).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

Params = dict[str, Any]
# vLLM's OpenAI server prefixes the X-Request-Id it is given with these (per endpoint).
REQUEST_ID_PREFIX = {"/v1/completions": "cmpl-", "/v1/chat/completions": "chatcmpl-"}


@dataclass(frozen=True)
class PrefillPeer:
    """A vLLM prefill instance's KV connector, as D must name it in a push leg."""

    engine_id: str
    host: str
    port: int

    @classmethod
    def parse(cls, text: str) -> PrefillPeer:
        """`ENGINE_ID@HOST:PORT`; ValueError naming the form otherwise."""
        engine_id, at, address = text.partition("@")
        host, colon, port = address.rpartition(":")
        if not (at and colon and engine_id and host and port.isdigit()):
            raise ValueError(f"not ENGINE_ID@HOST:PORT: {text!r}")
        return cls(engine_id, host.strip("[]"), int(port))

    def __str__(self) -> str:
        return f"{self.engine_id}@{self.host}:{self.port}"


def prefill_params() -> Params:
    """P's leg: compute the prompt and keep its blocks for a decode instance."""
    return {"do_remote_decode": True, "do_remote_prefill": False}


def pdserve_push_params(peer: PrefillPeer, transfer_id: str) -> tuple[Params, Params]:
    """P's and D's legs of a push through pdserve's connector, paired by `transfer_id`."""
    common = {"transfer_mode": "push", "transfer_id": transfer_id}
    p_params = {"do_remote_decode": True, "do_remote_prefill": False, **common}
    d_params = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": peer.engine_id,
        "remote_host": peer.host,
        "remote_port": peer.port,
        **common,
    }
    return p_params, d_params


def push_decode_params(peer: PrefillPeer, request_id: str, path: str) -> Params:
    """D's leg of a push request sent to P under `request_id` (its X-Request-Id) on `path`."""
    prefix = REQUEST_ID_PREFIX.get(path, "cmpl-")
    suffix = "-0" if prefix == "cmpl-" else ""  # completions number their prompts
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": peer.engine_id,
        "remote_host": peer.host,
        "remote_port": peer.port,
        "remote_request_id": f"{prefix}{request_id}{suffix}",
        "remote_block_ids": [],
        "tp_size": 1,
    }
