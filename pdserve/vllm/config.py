"""The connector's settings, read once from vLLM's `kv_connector_extra_config`.

Every option is declared here once; unknown keys are refused so a typo does not silently
fall back to a default. The cluster token comes from the environment or a file, never from
the JSON (which vLLM logs).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal, get_args

Mode = Literal["push", "pull"]
TransportKind = Literal["tcp", "nixl"]
TOKEN_ENV = "PDSERVE_CLUSTER_TOKEN"
DEFAULT_SIDE_PORT = 5610


@dataclass(frozen=True)
class VllmConnectorConfig:
    """Settings of one vLLM instance's PdserveConnector (scheduler and worker read the same)."""

    mode: Mode = "push"
    transport: TransportKind = "tcp"
    side_host: str = "127.0.0.1"  # the side channel (ZMQ) binds here
    side_port: int = DEFAULT_SIDE_PORT  # fixed: the scheduler puts it in P's params
    advertise_host: str | None = None  # what peers dial; None: side_host
    transport_port: int = 0  # the transport's data listener (0: a free port)
    cluster_token_file: str | None = None  # else $PDSERVE_CLUSTER_TOKEN, else no auth
    lease_s: float = 60.0  # P frees finished blocks no D claimed after this
    registration_grace_s: float = 30.0  # P keeps a registration for an unknown request this long
    recv_timeout_s: float = 120.0  # D fails a receive that has not completed after this
    handshake_timeout_s: float = 30.0
    heartbeat_s: float = 2.0  # D pings every P it waits on this often
    heartbeat_misses: int = 10  # a P silent this many periods is declared dead
    transfer_timeout_s: float = 30.0  # a transfer to a silent peer errors after this
    # P, push: write each layer of a prompt as vLLM saves it (`save_kv_layer`), in the step
    # that completes the prompt; else (or when D's registration comes late) in one write.
    push_layerwise: bool = True
    # The pull core's side channel and transport ports (0: free ones; P's params name the
    # side channel). The push core uses `side_port` and `transport_port`.
    pull_side_port: int = 0
    pull_transport_port: int = 0

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> VllmConnectorConfig:
        """Parse `kv_connector_extra_config`; ValueError naming any unknown or bad key."""
        extra = dict(extra or {})
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise ValueError(f"PdserveConnector: unknown extra config keys {unknown}")
        if extra.get("mode", "push") not in get_args(Mode):
            raise ValueError(f"PdserveConnector: mode must be push or pull, not {extra['mode']!r}")
        kind = extra.get("transport", "tcp")
        if kind not in get_args(TransportKind):
            raise ValueError(f"PdserveConnector: transport must be tcp or nixl, not {kind!r}")
        for name, value in extra.items():
            typ = known[name].type
            if typ in ("int", "float") and not isinstance(value, int | float):
                raise ValueError(f"PdserveConnector: {name} must be a number, not {value!r}")
            if typ == "bool" and not isinstance(value, bool):
                raise ValueError(f"PdserveConnector: {name} must be true or false, not {value!r}")
        return cls(**extra)

    @property
    def advertised(self) -> str:
        return self.advertise_host or self.side_host

    def cluster_token(self) -> str | None:
        """The token from `cluster_token_file`, else from $PDSERVE_CLUSTER_TOKEN, else None."""
        if self.cluster_token_file:
            return Path(self.cluster_token_file).read_text().strip() or None
        return os.environ.get(TOKEN_ENV) or None
