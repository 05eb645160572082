"""Configuration: one frozen dataclass per component, built once at start-up, never mutated.

CLI flags map one-to-one onto these fields; `pdserve.cli` builds them and hands them down.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pdserve.faults import NO_FAULTS, Faults

Dtype = Literal["auto", "float32", "bfloat16", "float16"]
Role = Literal["both", "prefill", "decode"]
TransferMode = Literal["pull", "push"]
TransportKind = Literal["tcp", "nixl"]


def default_cache_dir() -> Path:
    """Where built-in models are generated (override with PDSERVE_CACHE_DIR)."""
    env = os.environ.get("PDSERVE_CACHE_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pdserve"


@dataclass(frozen=True)
class ModelConfig:
    """Which checkpoint to load and how."""

    model: str = "builtin:tiny"  # "builtin:NAME" or a local Hugging Face directory
    dtype: Dtype = "auto"
    device: str = "cpu"
    max_model_len: int | None = None  # None: the checkpoint's max_position_embeddings
    seed: int = 0  # default sampling seed source for requests without one
    cache_dir: Path = field(default_factory=default_cache_dir)


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: block size and the memory budget that sets the number of blocks."""

    block_size: int = 16
    kv_cache_memory_gib: float = 0.25
    num_blocks: int | None = None  # overrides the memory budget (tests)
    # Reuse the KV of full blocks whose token prefix was computed before (on by default, as
    # in vLLM; `--no-enable-prefix-caching` turns it off). See pdserve.engine.scheduler.
    enable_prefix_caching: bool = True


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits."""

    max_num_batched_tokens: int = 2048  # per-step token budget (prefill chunks + decodes)
    max_num_seqs: int = 64  # cap on running sequences
    max_prefill_chunk: int | None = None  # None: limited only by the token budget


@dataclass(frozen=True)
class EngineConfig:
    """Everything one engine instance needs."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    threads: int | None = None  # torch intra-op threads; None keeps torch's default
    faults: Faults = NO_FAULTS  # tests only (pdserve.faults): reads `step_delay_s`


@dataclass(frozen=True)
class ServerConfig:
    """One instance's HTTP front end."""

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None  # None: derived from the model path
    api_key: str | None = None
    # A P/D instance's cluster token (its connector's; None on a monolithic instance): P/D
    # legs and routes for routers need a proof of it (pdserve.transfer.cluster_auth).
    cluster_token: str | None = None


@dataclass(frozen=True)
class TransportConfig:
    """KV transport backend and its side channel."""

    kind: TransportKind = "tcp"
    host: str = "127.0.0.1"
    port: int = 0  # 0: pick a free port
    advertise_host: str | None = None  # the address peers dial; None: `host` (not a wildcard)
    cluster_token: str | None = None
    timeout_s: float = 10.0  # a pending transfer to a dead peer errors after this
    nixl_backend: Literal["UCX", "LIBFABRIC"] = "UCX"


@dataclass(frozen=True)
class ConnectorConfig:
    """P/D transfer settings of one instance (its KV connector)."""

    role: str  # "prefill" | "decode" | "both"
    mode: str  # "pull" | "push"
    engine_id: str
    incarnation: str = field(default_factory=lambda: secrets.token_hex(6))
    side_host: str = "127.0.0.1"
    side_port: int = 0
    side_advertise_host: str | None = None  # the address peers are told; None: `side_host`
    cluster_token: str | None = None
    lease_s: float = 30.0  # P holds finished blocks at most this long
    # D waits at most this long for the KV (watchdog). Push reserves D's blocks while P's
    # queue drains, so this bounds lost transfers, not queueing; dead peers are caught by
    # the heartbeat within seconds.
    recv_timeout_s: float = 120.0
    quarantine_s: float = 60.0  # D keeps fenced blocks at most this long
    handshake_timeout_s: float = 10.0
    push_layerwise: bool = True  # P: stream each layer's KV as soon as the layer is computed
    heartbeat_s: float = 0.5  # D pings the prefill instances it waits on this often
    heartbeat_misses: int = 6  # a peer silent this many periods is declared down
    registration_ttl_s: float = 30.0  # P drops a registration with no prompt alive after this
    # P (push): a registration for a transfer P has no prompt for (never queued, finished or
    # released here) waits this long for its P leg (the router sends both legs at once, and
    # D's registration may come before P's HTTP gate hands the prompt to the engine), then
    # D is told `unknown_transfer` instead of waiting `registration_ttl_s` for nothing.
    unknown_transfer_grace_s: float = 5.0
    # D: decode legs queued or waiting for KV from one prefill instance (side-channel
    # address) at most; more are refused (cause `overloaded`). Twice the default
    # max_num_seqs: legs beyond what D can admit may queue, an unbounded flood may not.
    max_waiting_per_peer: int = 128
    # D: blocks reserved for requests waiting for remote KV at most this fraction of the
    # pool (a leg over it stays queued while other requests run); one alone always fits.
    max_waiting_kv_fraction: float = 0.5
    # P: blocks held for transfers no decode instance has claimed (pull) or registered for
    # (push) at most this fraction of the pool; new P legs over it are refused (`overloaded`).
    max_unclaimed_hold_fraction: float = 0.5
    # D: handshake attempts with one address (backing off, within handshake_timeout_s in
    # all) before D gives up on it: its waiting requests fail, its socket is closed, and new
    # legs naming it fail at once for `unreachable_cooldown_s`.
    handshake_tries: int = 3
    unreachable_cooldown_s: float = 10.0
    faults: Faults = NO_FAULTS  # tests only (pdserve.faults): the transfer faults
