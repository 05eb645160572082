"""The router's configuration: one frozen dataclass, built from the CLI once at start-up.

The fields that are `pdserve router` flags declare them here (pdserve.options).
"""

from __future__ import annotations

import argparse
import typing
from dataclasses import dataclass
from typing import Literal

from pdserve.config import API_KEY_ENV, TOKEN_ENV, TransferMode
from pdserve.options import option, port_number
from pdserve.router.vllm_legs import PrefillPeer
from pdserve.server.body_limit import MAX_BODY_BYTES
from pdserve.vllm.instance import Connector, Engine

__all__ = ["POLICY_NAMES", "PolicyName", "RouterConfig", "TransferMode", "normalize_url"]
PolicyName = Literal["round_robin", "least_loaded", "least_tokens", "load_aware", "cache_aware"]
POLICY_NAMES: tuple[PolicyName, ...] = typing.get_args(PolicyName)

# Prompts shorter than this (in tokens) are prefilled on the decode instance itself
# (conditional disaggregation; 0 disables). Measured on the 2-core CPU machine, 1P1D push
# (docs/results.md, "local prefill below 64 tokens"): up to 48 tokens local prefill wins
# TTFT in both runs at equal or better TPOT for D's other streams; from 128 tokens it raises
# their TPOT (1.3-1.9x, 6.6x at 1,024). The crossover lies between 32 and 64 tokens in one
# run and between 64 and 128 in the other, so 64 is the default: it sits in both ranges.
# Another cluster's crossover differs (a GPU's prefill is far cheaper per token): measure it
# with `scripts/bench/routing/bench_routing.py crossover`.
DEFAULT_LOCAL_PREFILL_BELOW = 64


def normalize_url(url: str) -> str:
    """`host:port` or `http://host:port/` -> `http://host:port`."""
    url = url.strip().rstrip("/")
    return url if "://" in url else f"http://{url}"


def _peer(text: str) -> PrefillPeer:
    """argparse type of `--prefill-peer`."""
    try:
        return PrefillPeer.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


@dataclass(frozen=True)
class RouterConfig:
    """Everything one router process needs; never mutated after start-up."""

    prefill_urls: tuple[str, ...] = option(
        flag="--prefill",
        nargs="+",
        parse=normalize_url,
        metavar="URL",
        help="prefill instance URL(s); repeat or list several",
    )
    decode_urls: tuple[str, ...] = option(
        flag="--decode",
        nargs="+",
        parse=normalize_url,
        metavar="URL",
        help="decode instance URL(s); repeat or list several",
    )
    kv_transfer: TransferMode = option(help="pull: P then D, sequential; push: both legs at once")
    policy: PolicyName = option(
        "round_robin",
        help="instance selection per role (default: %(default)s; docs/router.md)",
    )
    # What the instances are: pdserve's (its kv_transfer_params, /kv/info, /load, signed
    # legs, releases) or vLLM's OpenAI servers (vLLM's params passed through; vllm_legs).
    engine: Engine = option(
        "pdserve",
        help="the instances' engine: pdserve, or vLLM's OpenAI server (vLLM's"
        " kv_transfer_params passed from P to D untouched; no /kv/info, /load or releases;"
        " docs/router.md) (default: %(default)s)",
    )
    # With vLLM instances, the KV connector they run (pdserve's inside vLLM, or vLLM's NIXL).
    connector: Connector = option(
        "pdserve",
        help="--engine vllm: the instances' KV connector: pdserve's or vLLM's NIXL ones"
        " (push sends both legs at once with either; pull sends D's leg after P's answer)"
        " (default: %(default)s)",
    )
    # vLLM prefill instances' connectors, one per prefill URL in order (push with
    # `engine="vllm"` needs them: vLLM has no /kv/info to read them from); () : none known.
    prefill_peers: tuple[PrefillPeer, ...] = option(
        (),
        flag="--prefill-peer",
        nargs="+",
        parse=_peer,
        metavar="ENGINE_ID@HOST:PORT",
        help="--engine vllm: each prefill instance's KV connector (engine id and side"
        " channel), in the order of --prefill; push needs them",
    )
    host: str = option("127.0.0.1", help="address to listen on (default: %(default)s)")
    port: int = option(8000, parse=port_number, help="port to listen on (default: %(default)s)")
    # Checked on the client's requests and sent to the instances (one key for the cluster).
    api_key: str | None = option(
        None,
        env=API_KEY_ENV,
        help=f"required from clients and sent to the instances (default: ${API_KEY_ENV})",
    )
    # Signs the router's releases of prefill holds (pdserve.transfer.release); must be the
    # instances' token when they have one (else P refuses the release and the lease frees).
    cluster_token: str | None = option(
        None,
        help="the instances' cluster token: the router signs its P/D legs and releases and"
        " proves it on /kv/info and /load polls; /router/instances then needs a proof of it"
        f" too (default: ${TOKEN_ENV}; instances with a token refuse a router without it)",
    )
    release_timeout_s: float = 5.0  # bound on one release call to P
    # Bound on each leg: P's whole answer, D's first token, and every gap between D's chunks.
    request_timeout_s: float = option(
        300.0,
        flag="--request-timeout",
        metavar="S",
        help="bound on P's answer, D's first token and each gap in D's stream"
        " (default: %(default)s)",
    )
    connect_timeout_s: float = 5.0
    health_interval_s: float = 1.0
    health_timeout_s: float = 2.0  # a busy CPU instance can answer /health slowly
    health_failures_to_eject: int = 2
    # A D stream whose instance was ejected ends once D has then been silent this long (a
    # busy D can miss health checks while still streaming; a frozen one sends nothing).
    ejected_stream_grace_s: float = 5.0
    load_interval_s: float = 0.25  # `/load` polls, for the policies that use it
    local_prefill_below: int = option(
        DEFAULT_LOCAL_PREFILL_BELOW,
        metavar="N",
        help="prompts of fewer than N tokens are prefilled on the decode instance itself,"
        " skipping prefill and transfer (0: never; default: %(default)s, the crossover"
        " measured on 1P1D CPU; docs/router.md)",
    )
    # Decode tokens a request is counted for when the client sets no max_tokens (chat).
    default_max_tokens: int = 256
    # HTTP/1.1 needs one connection per concurrent stream, so the pool must not be the limit.
    max_connections: int = 10_000
    max_body_bytes: int = MAX_BODY_BYTES  # a larger client body gets a 413

    def __post_init__(self) -> None:
        if not self.prefill_urls or not self.decode_urls:
            raise ValueError("the router needs at least one prefill and one decode instance")
        if min(self.request_timeout_s, self.health_interval_s, self.load_interval_s) <= 0:
            raise ValueError("timeouts and intervals must be positive")
        if self.ejected_stream_grace_s < 0:
            raise ValueError("ejected_stream_grace_s must be >= 0")
        if self.local_prefill_below < 0 or self.default_max_tokens < 1:
            raise ValueError("local_prefill_below must be >= 0, default_max_tokens >= 1")
        if self.prefill_peers and len(self.prefill_peers) != len(self.prefill_urls):
            raise ValueError("give one prefill peer per prefill URL, in the same order")
        if self.concurrent_legs and self.engine == "vllm" and not self.prefill_peers:
            raise ValueError("push to vLLM instances needs every prefill instance's peer")
        if self.health_failures_to_eject < 1:
            raise ValueError("health_failures_to_eject must be at least 1")

    @property
    def concurrent_legs(self) -> bool:
        """Whether a request's P and D legs go out at once, D's naming P up front (push, with
        every engine and connector). Otherwise (pull) D's leg follows P's answer and carries
        its params."""
        return self.kv_transfer == "push"
