"""Configuration: one frozen dataclass per component, built once at start-up, never mutated.

A field that is a command-line flag declares it here, once (`pdserve.options.option`: the
flag, its help; the default is the field's): `pdserve serve` adds these flags to its parser
and builds these configs back from what it parsed (pdserve.server.serve_args).
"""

from __future__ import annotations

import argparse
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pdserve.faults import NO_FAULTS, Faults
from pdserve.options import from_flag, option, port_number, positive_float, positive_int

Dtype = Literal["auto", "float32", "bfloat16", "float16"]
Role = Literal["both", "prefill", "decode"]
TransferMode = Literal["pull", "push"]
TransportKind = Literal["tcp", "nixl"]
API_KEY_ENV = "PDSERVE_API_KEY"
TOKEN_ENV = "PDSERVE_CLUSTER_TOKEN"
LogLevel = Literal["critical", "error", "warning", "info", "debug"]

# vLLM's dtype names, as pdserve's (`--dtype half` is float16, `--dtype float` float32).
DTYPE_ALIASES: dict[str, Dtype] = {
    "auto": "auto",
    "half": "float16",
    "float16": "float16",
    "bfloat16": "bfloat16",
    "float": "float32",
    "float32": "float32",
}

# Titles of `pdserve serve`'s argument groups that the fields below are listed under.
MODEL_GROUP, CACHE_GROUP, SCHED_GROUP, HTTP_GROUP = "model", "KV cache", "scheduler", "HTTP"
PD_GROUP = "P/D disaggregation"


def dtype_name(text: str) -> Dtype:
    """argparse type of `--dtype`: vLLM's names, as pdserve's."""
    try:
        return DTYPE_ALIASES[text]
    except KeyError:
        names = ", ".join(DTYPE_ALIASES)
        raise argparse.ArgumentTypeError(f"unknown dtype {text!r} (choose from {names})") from None


def default_cache_dir() -> Path:
    """Where built-in models are generated (override with PDSERVE_CACHE_DIR)."""
    env = os.environ.get("PDSERVE_CACHE_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pdserve"


@dataclass(frozen=True)
class ModelConfig:
    """Which checkpoint to load and how."""

    model: str = option(
        "builtin:tiny",
        group=MODEL_GROUP,
        help="'builtin:NAME' or a local Hugging Face model directory (default: %(default)s)",
    )
    dtype: Dtype = option(
        "auto",
        group=MODEL_GROUP,
        parse=dtype_name,
        metavar="{auto,float32,bfloat16,float16}",
        help="weight dtype; vLLM's half and float are float16 and float32 (default: %(default)s)",
    )
    device: str = option("cpu", group=MODEL_GROUP, help="torch device (default: %(default)s)")
    max_model_len: int | None = option(  # None: the checkpoint's max_position_embeddings
        None,
        group=MODEL_GROUP,
        parse=positive_int,
        help="max tokens per request, prompt + output (default: the model's context length)",
    )
    seed: int = option(  # default sampling seed source for requests without one
        0, group=MODEL_GROUP, help="sampling seed for requests without one (default: %(default)s)"
    )
    cache_dir: Path = field(default_factory=default_cache_dir)


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: block size and the memory budget that sets the number of blocks."""

    block_size: int = option(
        16, group=CACHE_GROUP, parse=positive_int, help="tokens per KV block (default: %(default)s)"
    )
    kv_cache_memory_gib: float = option(
        0.25,
        flag="--kv-cache-memory",
        group=CACHE_GROUP,
        parse=positive_float,
        metavar="GIB",
        help="GiB of memory for the paged KV cache; sets the number of blocks "
        "(default: %(default)s)",
    )
    num_blocks: int | None = option(  # overrides the memory budget (tests)
        None,
        flag="--num-kv-blocks",
        group=CACHE_GROUP,
        parse=positive_int,
        help="exact number of KV blocks (overrides --kv-cache-memory)",
    )
    # Reuse the KV of full blocks whose token prefix was computed before (on by default, as
    # in vLLM; `--no-enable-prefix-caching` turns it off). See pdserve.engine.scheduler.
    enable_prefix_caching: bool = option(
        True,
        group=CACHE_GROUP,
        negatable=True,
        help="reuse the KV of full blocks whose token prefix was computed before "
        "(vLLM's flag; default: on, --no-enable-prefix-caching turns it off)",
    )


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits."""

    max_num_batched_tokens: int = option(
        2048,
        group=SCHED_GROUP,
        parse=positive_int,
        help="token budget of one engine step (prefill chunks + decodes) (default: %(default)s)",
    )
    max_num_seqs: int = option(
        64,
        group=SCHED_GROUP,
        parse=positive_int,
        help="max requests running at once (default: %(default)s)",
    )
    max_prefill_chunk: int | None = option(  # None: limited only by the token budget
        None,
        group=SCHED_GROUP,
        parse=positive_int,
        help="max prompt tokens of one request per step (default: the step's token budget)",
    )


@dataclass(frozen=True)
class EngineConfig:
    """Everything one engine instance needs."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    threads: int | None = option(  # torch intra-op threads; None keeps torch's default
        None,
        group=SCHED_GROUP,
        parse=positive_int,
        help="torch intra-op threads (default: torch's choice)",
    )
    faults: Faults = NO_FAULTS  # tests only (pdserve.faults): reads `step_delay_s`


@dataclass(frozen=True)
class ServerConfig:
    """One instance's HTTP front end."""

    host: str = option(
        "127.0.0.1", group=HTTP_GROUP, help="address to listen on (default: %(default)s)"
    )
    port: int = option(
        8000,
        group=HTTP_GROUP,
        parse=port_number,
        help="port to listen on (0: any free port) (default: %(default)s)",
    )
    served_model_name: str | None = option(  # None: derived from the model path
        None, group=MODEL_GROUP, help="model name in the API (default: derived from --model)"
    )
    api_key: str | None = option(
        None,
        group=HTTP_GROUP,
        env=API_KEY_ENV,
        help=f"require 'Authorization: Bearer KEY' on /v1/* (default: ${API_KEY_ENV}, "
        "unset: no key)",
    )
    # A P/D instance's cluster token (its connector's; None on a monolithic instance): P/D
    # legs and routes for routers need a proof of it (pdserve.transfer.cluster_auth).
    cluster_token: str | None = None


@dataclass(frozen=True)
class TransportConfig:
    """KV transport backend and its side channel."""

    kind: TransportKind = option(
        "tcp",
        flag="--transport",
        group=PD_GROUP,
        help="KV transport backend; nixl needs `pip install nixl-cu12` (default: %(default)s)",
    )
    host: str = from_flag("--kv-host", "127.0.0.1")
    port: int = option(  # 0: pick a free port
        0,
        flag="--kv-port",
        group=PD_GROUP,
        help="port of the KV transport's listener: tcp's data connections, NIXL's metadata "
        "exchange (UCX opens its own data connections); fix it when a firewall sits between "
        "hosts (default: a free one)",
    )
    advertise_host: str | None = None  # the address peers dial; None: `host` (not a wildcard)
    cluster_token: str | None = from_flag("--cluster-token", None)
    timeout_s: float = option(  # a pending transfer to a dead peer errors after this
        10.0,
        flag="--transfer-timeout",
        group=PD_GROUP,
        help="a transfer to an unresponsive peer fails after this many seconds "
        "(default: %(default)s)",
    )
    nixl_backend: Literal["UCX", "LIBFABRIC"] = "UCX"


@dataclass(frozen=True)
class ConnectorConfig:
    """P/D transfer settings of one instance (its KV connector)."""

    role: Role = option(
        flag_default="both",
        required=False,
        group=PD_GROUP,
        help="both: monolithic instance; prefill/decode: one side of a P/D pair "
        "(default: %(default)s)",
    )
    mode: TransferMode = option(
        flag="--kv-transfer",
        flag_default="pull",
        required=False,
        group=PD_GROUP,
        help="how KV moves from prefill to decode; must match the router (default: %(default)s)",
    )
    engine_id: str = option(
        required=False, group=PD_GROUP, help="this instance's id among peers (default: random)"
    )
    incarnation: str = field(default_factory=lambda: secrets.token_hex(6))
    side_host: str = option(
        "127.0.0.1",
        flag="--kv-host",
        group=PD_GROUP,
        help="address the side channel and transport listen on (default: %(default)s)",
    )
    side_port: int = option(
        0,
        flag="--side-channel-port",
        group=PD_GROUP,
        help="side-channel port (default: a free one, see GET /kv/info)",
    )
    side_advertise_host: str | None = option(  # the address peers are told; None: `side_host`
        None,
        flag="--kv-advertise-host",
        group=PD_GROUP,
        help="address peers are told to reach the side channel and transport at (in "
        "/kv/info, pull params, the transport card); required when --kv-host is a wildcard "
        "such as 0.0.0.0 (default: --kv-host)",
    )
    cluster_token: str | None = option(
        None,
        env=TOKEN_ENV,
        group=PD_GROUP,
        help="shared secret peers must prove (challenge-response, never sent); "
        f"default: ${TOKEN_ENV}",
    )
    lease_s: float = option(  # P holds finished blocks at most this long
        30.0,
        flag="--kv-lease",
        group=PD_GROUP,
        help="prefill: seconds finished blocks are held for a decode instance "
        "(default: %(default)s)",
    )
    # D waits at most this long for the KV (watchdog). Push reserves D's blocks while P's
    # queue drains, so this bounds lost transfers, not queueing; dead peers are caught by
    # the heartbeat within seconds.
    recv_timeout_s: float = option(
        120.0,
        flag="--kv-recv-timeout",
        group=PD_GROUP,
        help="decode: seconds to wait for a prompt's KV before failing the "
        "request (default: %(default)s)",
    )
    quarantine_s: float = 60.0  # D keeps fenced blocks at most this long
    handshake_timeout_s: float = 10.0
    # P: stream each layer's KV as soon as the layer is computed.
    push_layerwise: bool = option(
        True,
        flag="--no-push-layerwise",
        group=PD_GROUP,
        help="push: write a prompt's KV in one go after prefill instead of layer by "
        "layer as each layer finishes",
    )
    heartbeat_s: float = 0.5  # D pings the prefill instances it waits on this often
    heartbeat_misses: int = 6  # a peer silent this many periods is declared down
    registration_ttl_s: float = 30.0  # P drops a registration with no prompt alive after this
    # P (push): a registration for a transfer P has no prompt for (never queued, finished or
    # released here) waits this long for its P leg (the router sends both legs at once, and
    # D's registration may come before P's HTTP gate hands the prompt to the engine), then
    # D is told `unknown_transfer` instead of waiting `registration_ttl_s` for nothing.
    unknown_transfer_grace_s: float = option(
        5.0,
        flag="--kv-unknown-transfer-grace",
        group=PD_GROUP,
        metavar="X",
        help="prefill, push: seconds a decode registration for a transfer with no prompt here "
        "waits for its prompt before the decode instance is told the transfer is unknown "
        "(default: %(default)s)",
    )
    # D: decode legs queued or waiting for KV from one prefill instance (side-channel
    # address) at most; more are refused (cause `overloaded`). Twice the default
    # max_num_seqs: legs beyond what D can admit may queue, an unbounded flood may not.
    max_waiting_per_peer: int = option(
        128,
        flag="--kv-max-waiting-per-peer",
        group=PD_GROUP,
        metavar="N",
        help="decode: legs queued or waiting for KV from one prefill instance at most; more are "
        "refused (kv_overloaded) (default: %(default)s)",
    )
    # D: blocks reserved for requests waiting for remote KV at most this fraction of the
    # pool (a leg over it stays queued while other requests run); one alone always fits.
    max_waiting_kv_fraction: float = option(
        0.5,
        flag="--kv-max-waiting-fraction",
        group=PD_GROUP,
        metavar="X",
        help="decode: fraction of the KV blocks that requests waiting for remote KV may reserve; "
        "a leg over it waits in the queue (default: %(default)s)",
    )
    # P: blocks held for transfers no decode instance has claimed (pull) or registered for
    # (push) at most this fraction of the pool; new P legs over it are refused (`overloaded`).
    max_unclaimed_hold_fraction: float = option(
        0.5,
        flag="--kv-max-unclaimed-fraction",
        group=PD_GROUP,
        metavar="X",
        help="prefill: fraction of the KV blocks held for transfers no decode instance has "
        "claimed or registered for; new prefill legs over it are refused (kv_overloaded) "
        "(default: %(default)s)",
    )
    # D: handshake attempts with one address (backing off, within handshake_timeout_s in
    # all) before D gives up on it: its waiting requests fail, its socket is closed, and new
    # legs naming it fail at once for `unreachable_cooldown_s`.
    handshake_tries: int = option(
        3,
        flag="--kv-handshake-tries",
        group=PD_GROUP,
        metavar="N",
        help="decode: handshake attempts (backing off, within the handshake timeout) before "
        "giving up on an address (default: %(default)s)",
    )
    unreachable_cooldown_s: float = option(
        10.0,
        flag="--kv-unreachable-cooldown",
        group=PD_GROUP,
        metavar="X",
        help="decode: seconds legs naming an address given up on fail at once, without dialing "
        "(default: %(default)s)",
    )
    faults: Faults = NO_FAULTS  # tests only (pdserve.faults): the transfer faults
